"""CPU, ~60-100 s (one spawn of 4 gloo ranks, each importing SGLang): the plugin on real CP ranks.

Pool and forward metadata (sglang_ext/mem_cache/). The oracle is SGLang's unmodified
`DSATokenToKVPool` fed the same writes through the same calls (`set_index_k_scale_buffer`:
SGLang's triton `SetKAndS`, run by the triton interpreter; `set_mla_kv_buffer`). On every CP rank
(N = 4 with one-layer-ahead prefetch, N = 2 with prefetch off, and N = 2 with an fp8 KV cache
(656-byte FlashMLA rows, quantized by both pools with SGLang's quantizer) and prefetch, as
subgroups of the same 4 processes), for three fixed extend batches (new requests; continuations whose prefix ends
mid-page; a radix hit sharing a page-aligned prefix) and then random mixes of new requests,
continuations and radix hits:
- SGLang's real `DeepseekSparseAttnBackend.init_forward_metadata` (with SGLang's interleave
  strategy selecting each rank's requests) starts the pool's batch and rewrites its page tables;
- for every layer, what attention reads (`get_key_buffer` at the rewritten `page_table_1`), what
  the indexer reads (`get_index_k_scale_buffer` with `indexer_logical_page_table`, i.e. SGLang's
  `GetKAndS`; the raw pages at `real_page_table`) equal the oracle's bytes at the logical slots;
- after each batch every page a rank owns equals the oracle's page, and each rank holds ~1/N of
  the oracle's bytes;
- every rank of a group issued the same history all-gathers in the same order, and a batch
  without history issued none.
Not run here: the GPU kernels that consume these views (FlashMLA, DeepGEMM MQA logits, top-k).

Narrow tail gather (sglang_ext/layers/). SGLang's interleave strategy shards a batch's hidden
states (`prepare_cp_forward`, `cp_shard_hidden_states`); `cp_gather_after_forward` then feeds
`LogitsProcessor._get_pruned_states`, both as patched by the plugin (loaded through its entry
point with `load_plugins()` in each rank). With shared KV on, the logits processor must get the
same rows as with it off (SGLang's full gather + pruning), from [bs, hidden] instead of
[tokens, hidden], without the full gather; batches that need input logprobs keep the full gather.
"""

from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.dsa_pool import LAYERS, PAGE, no_dcp, pool_kwargs  # noqa: E402
from helpers.paged_requests import PagedRequests  # noqa: E402
from sglang_nsa_cp.comm import TrafficCounter, run_ranks  # noqa: E402

register_cpu_ci(est_time=80, suite="nsa-cp-test-cpu")


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


# Small on purpose: SGLang's index-K kernels run in the triton interpreter, ~7 ms per token.
BATCHES = [
    [(0, 70), (1, 9)],  # new requests: no history (no collective)
    [(0, 60), (1, 4)],  # continuations, prefixes ending mid-page, one crossing into a third page
    [(2, 3), (1, 2), (3, 1)],  # request 2 shares request 0's first page (radix hit); a new request
]
FORKS = {2: (2, 0, PAGE)}  # before batch 2: request 2 starts with request 0's first page


def _random_mix(seed, num_batches=3):
    """Batches mixing new requests, continuations and radix hits (requests 4-7, which the fixed
    batches do not use); (batches, forks) as BATCHES and FORKS. Small: the interpreter is slow."""
    rng = random.Random(seed)
    lens, batches, forks = {}, [], {}
    for b in range(num_batches):
        batch = [(r, rng.randint(1, 40)) for r in sorted(lens) if rng.random() < 0.7]
        free = [r for r in range(4, 8) if r not in lens]
        sources = [r for r, n in lens.items() if n >= PAGE]
        if free and sources and rng.random() < 0.5:  # a radix hit on another request's first page
            forks[b] = (free[0], rng.choice(sources), PAGE)
            lens[free[0]] = PAGE
            batch.append((free.pop(0), rng.randint(1, 30)))
        if free:
            batch.append((free[0], rng.randint(1, 90)))
        for r, n in batch:
            lens[r] = lens.get(r, 0) + n
        batches.append(batch)
    return batches, forks


def _chunk(num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    k_nope = torch.randn(num_tokens, 1, 512, generator=g).to(torch.bfloat16)
    k_rope = torch.randn(num_tokens, 1, 64, generator=g).to(torch.bfloat16)
    index_k = (torch.randn(num_tokens, 128, generator=g) * 4).to(torch.float8_e4m3fn)
    index_s = torch.rand(num_tokens, 1, generator=g) + 0.25
    return k_nope, k_rope, index_k, index_s


def _dsa_backend(pool, req_to_token):
    """SGLang's `DeepseekSparseAttnBackend` with the state `init_forward_metadata` reads (its
    constructor needs a model runner and published server arguments)."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.layers.attention.kv_shard_hooks import get_kv_shard_pool

    backend = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    backend.device = "cpu"
    backend.token_to_kv_pool = pool
    backend._kv_shard_pool = get_kv_shard_pool(pool)  # SGLang's own detection of a sharded pool
    assert backend._kv_shard_pool is pool, "SGLang does not see the pool as logical-page sharded"
    backend.req_to_token = req_to_token
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    backend.physical_page_size = PAGE
    backend.dsa_index_kpool = 1
    backend.dsa_index_topk = 2048
    backend.use_mha = False  # SGLang's choice for sharded pools (supports_mha_one_shot is False)
    backend.dsa_prefill_impl = backend.dsa_decode_impl = "flashmla_sparse"
    backend._arange_buf = torch.arange(16, dtype=torch.int32)
    backend.set_dsa_prefill_impl = lambda _batch: None  # GPU-dependent MHA/MLA choice
    backend.get_topk_transform_method = lambda _mode: TopkTransformMethod.PAGED  # the prefill-CP transform
    backend._build_topk_v2_plan = lambda _seqlens: None  # sgl-kernel top-k plan
    backend._init_kpool_metadata = lambda metadata, *a, **k: metadata  # index_kpool == 1
    return backend


def _init_forward_metadata(backend, req_pool_indices, prefix, seq, n):
    """`init_forward_metadata` of an extend batch, as SGLang runs it on a CP rank."""
    from sglang.srt.layers.attention import dsa_backend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    extend = [s - p for s, p in zip(seq.tolist(), prefix)]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(prefix),
        req_pool_indices=req_pool_indices,
        seq_lens=seq,
        seq_lens_cpu=seq,
        seq_lens_sum=int(seq.sum()),
        extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=extend,
        extend_seq_lens=torch.tensor(extend),
        global_num_tokens_cpu=None,
    )
    # Stand-ins for three config lookups: CP interleave is on (SGLang's own predicate minus its
    # config read), no DP/CP padding of the indexer lengths, no CUDA schedule metadata.
    cp_interleave = lambda fb: fb.forward_mode.is_context_parallel_extend() and sum(fb.extend_seq_lens_cpu) >= n > 1  # noqa: E731
    with (
        mock.patch.object(dsa_backend, "can_dsa_prefill_cp_interleave", cp_interleave),
        mock.patch.object(dsa_backend, "pad_dsa_cache_seqlens", lambda _fb, x: x),
        mock.patch.object(dsa_backend, "is_cuda", lambda: False),
    ):
        backend.init_forward_metadata(batch)
    return backend.forward_metadata


def _check_latent_views(pool, ref, meta, table, layer, where):
    """What attention reads: rows of `get_key_buffer` at SGLang's (rewritten) page_table_1, for this
    rank's requests (bs_idx under CP), against the unmodified pool at the logical slots (bytes: an
    fp8 pool's rows are FlashMLA's 656-byte rows, typed float8_e4m3fn by both pools)."""
    dense, full = pool.get_key_buffer(layer), ref.get_key_buffer(layer)
    assert dense.dtype == full.dtype and dense.shape[1:] == full.shape[1:], (
        f"{where}: {dense.dtype} {dense.shape} vs {full.dtype} {full.shape}"
    )
    dense, full = dense.view(torch.uint8), full.view(torch.uint8)
    for j, kv_len in enumerate(meta.cache_seqlens_int32.tolist()):
        got = dense[meta.page_table_1[j, :kv_len].long()]
        want = full[table[j, :kv_len].long()]
        bad = (got != want).any(-1).flatten().nonzero().flatten()
        assert bad.numel() == 0, f"{where}: latent of local request {j} differs at positions {bad[:8].tolist()}"


def _check_index_views(pool, ref, meta, layer, where):
    """What the indexer reads (`_get_topk_ragged`): `get_index_k_scale_buffer` with SGLang's
    `indexer_logical_page_table`; and the dense page ids the paged readers get (`real_page_table`)."""
    seq = meta.indexer_seq_lens_cpu
    if len(seq) == 0:
        return
    args = (layer, meta.indexer_seq_lens, meta.indexer_logical_page_table, int(seq.sum()), int(seq.max()))
    got_k, got_s = pool.get_index_k_scale_buffer(*args)
    want_k, want_s = ref.get_index_k_scale_buffer(*args)
    assert torch.equal(got_k, want_k), f"{where}: index keys differ"
    assert torch.equal(got_s, want_s), f"{where}: index scales differ"
    dense_pages = pool.get_index_k_with_scale_buffer(layer)
    full_pages = ref.get_index_k_with_scale_buffer(layer)
    for j, kv_len in enumerate(seq.tolist()):
        pages = -(-kv_len // PAGE)
        got = dense_pages[meta.real_page_table[j, :pages].long()]
        want = full_pages[meta.indexer_logical_page_table[j, :pages].long()]
        key_bytes = (kv_len - (pages - 1) * PAGE) * 128  # the last page is only partly written
        assert torch.equal(got[:-1], want[:-1]) and torch.equal(got[-1, :key_bytes], want[-1, :key_bytes]), (
            f"{where}: dense index pages of local request {j} differ"
        )


def _sglang_pages(pool) -> int:
    """Logical pages of SGLang's pool of the same size (rows: size + one page); the shared pool's
    `num_logical_pages` rounds this up to whole rows of N for the owner-classed allocator."""
    return pool.size // PAGE + 1


def _check_owned_pages(pool, ref, n, rank, where):
    for layer in range(LAYERS):
        latent, index = pool.store.latent[layer], pool.store.index[layer]
        full_latent, full_index = ref.kv_buffer[layer][:, 0], ref.index_k_with_scale_buffer[layer]
        for page in range(rank, _sglang_pages(ref), n):
            q = page // n
            assert torch.equal(latent[q * PAGE : (q + 1) * PAGE], full_latent[page * PAGE : (page + 1) * PAGE]), (
                f"{where}: rank {rank} latent page {page} (local {q}), layer {layer}"
            )
            assert torch.equal(index[q], full_index[page]), f"{where}: rank {rank} index page {page}, layer {layer}"


def _run_scenario(rank, n, group, seed, prefetch, kv="bf16"):
    from sglang.srt.layers.cp import base as cp_base
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    if kv == "fp8":  # SGLang's Triton fp8 quantizer is ~20 ms per program in the interpreter
        from helpers import sglang_cpu_stand_ins

        sglang_cpu_stand_ins.install_fp8_kv_stand_ins()  # its torch twin, in both pools (sglang_cpu_forward.md)
    size = 24 * PAGE
    cp_base.init_cp_strategy(enable_prefill_cp=True, cp_size=n, cp_strategy="interleave")
    from sglang_nsa_cp.envs import envs

    with no_dcp(), get_parallel().override(attn_cp_rank=rank, attn_cp_size=n, enable_cp_tp_group_sharing=False):
        ref = DSATokenToKVPool(**pool_kwargs(size, kv))
        with envs.SGLANG_NSA_CP_PREFETCH.override(prefetch):
            pool = SharedKVDSATokenToKVPool(**pool_kwargs(size, kv), cp_rank=rank, cp_size=n, cp_group=group)
        assert pool.prefetcher.enabled == prefetch
        pool.prefetcher.min_pages_per_rank = 1  # these histories are a few pages: prefetch them all the same
        pool.counter = TrafficCounter()
        reqs = PagedRequests(torch.zeros((8, 512), dtype=torch.int32), _sglang_pages(ref), PAGE, seed)
        backend = _dsa_backend(pool, reqs.req_to_token)
        local_requests, history, gathers = [], [], []
        mix, mix_forks = _random_mix(seed)
        forks = {**FORKS, **{len(BATCHES) + b: f for b, f in mix_forks.items()}}
        for b, batch in enumerate(BATCHES + mix):
            if b in forks:
                idx, source, length = forks[b]
                reqs.fork(idx, source=source, length=length)
            prefix, seq, loc = reqs.extend(batch)
            history.append(any(prefix))
            before = len(pool.counter.events)
            req_pool_indices, seq = torch.tensor([i for i, _ in batch]), torch.tensor(seq)
            meta = _init_forward_metadata(backend, req_pool_indices, prefix, seq, n)  # calls begin_shard_extend
            early = pool.prefetcher.early  # launched layer 0 ahead
            # This rank's requests: those with local queries under interleave (SGLang's bs_idx).
            extend = [s - p for s, p in zip(seq.tolist(), prefix)]
            bs_idx = cp_base.get_cp_strategy().shard_per_request(extend, torch.tensor(extend))[2]
            local_requests.append(len(bs_idx))
            table = reqs.req_to_token[req_pool_indices[bs_idx], : int(seq[bs_idx].max())]
            assert torch.equal(meta.indexer_logical_page_table, table[:, ::PAGE].long() // PAGE), f"{n=}, {rank=}, {b=}"
            for layer in range(LAYERS):
                where = f"N={n}, rank={rank}, batch={b}, layer={layer}"
                k_nope, k_rope, index_k, index_s = _chunk(loc.numel(), seed * 100 + b * 10 + layer)
                for p in (ref, pool):  # the indexer stores its keys first, attention then writes the latent
                    p.set_index_k_scale_buffer(layer, loc, index_k, index_s)
                _check_index_views(pool, ref, meta, layer, where)
                for p in (ref, pool):
                    p.set_mla_kv_buffer(_Layer(layer), loc, k_nope, k_rope)
                _check_latent_views(pool, ref, meta, table, layer, where)
            pool.end_shard_extend()
            gathers.append((len(pool.counter.events) - before, early))
            _check_owned_pages(pool, ref, n, rank, f"N={n}, batch={b}")
        return dict(
            n=n,
            kv=kv,
            prefetch=prefetch,
            batches=BATCHES + mix,
            local_requests=local_requests,
            history=history,
            gathers=gathers,
            events=pool.counter.events,
            pool_bytes=pool.get_kv_size_bytes(),
            ref_bytes=ref.get_kv_size_bytes(),
        )


class _GlooCoordinator:
    """The parts of SGLang's GroupCoordinator that the CP strategies and our hooks use, over gloo."""

    def __init__(self, group, world_size, rank):
        self.device_group = group
        self.world_size = world_size
        self.rank_in_group = rank
        self.full_gathers = 0

    def all_gather_into_tensor(self, output, input):
        self.full_gathers += 1
        dist.all_gather_into_tensor(output, input, group=self.device_group)
        return output


TAIL_BATCHES = [  # (extend_lens, prefix_lens)
    ([37, 20, 5], [0, 64, 3]),
    ([1, 1, 9, 2], [5, 0, 0, 70]),
    ([50], [10]),
]


def _check_tail_gather(rank, n, group):
    from sglang.srt.layers.cp import base as cp_base
    from sglang.srt.layers.cp import utils as cp_utils
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.envs import envs

    cp_base.init_cp_strategy(enable_prefill_cp=True, cp_size=n, cp_strategy="interleave")
    coordinator = _GlooCoordinator(group, n, rank)
    override = dict(
        attn_cp_rank=rank, attn_cp_size=n, attn_cp_group=coordinator, enable_cp_tp_group_sharing=False, attn_dp_size=1
    )
    shapes = []
    for b, (extend_lens, prefix_lens) in enumerate(TAIL_BATCHES):
        where = f"N={n}, rank={rank}, batch={b} {extend_lens=} {prefix_lens=}"
        num_tokens = sum(extend_lens)
        fb = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.arange(num_tokens),
            seq_lens_cpu=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)]),
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens=torch.tensor(extend_lens),
            attn_cp_metadata=None,
            global_num_tokens_cpu=None,
            out_cache_loc=None,
            return_logprob=False,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            spec_info=None,
        )
        meta = LogitsMetadata(
            forward_mode=ForwardMode.EXTEND, extend_seq_lens=fb.extend_seq_lens, extend_seq_lens_cpu=list(extend_lens)
        )
        hidden = torch.randn(
            num_tokens, 24, generator=torch.Generator().manual_seed(b)
        )  # the model body's output, every token
        with get_parallel().override(**override):
            cp_utils.prepare_cp_forward(fb)
            local = cp_utils.cp_shard_hidden_states(hidden, fb)
            with envs.SGLANG_NSA_CP_SHARED_KV.override(False):  # today: full gather, SGLang's pruning
                full = cp_utils.cp_gather_after_forward(local, fb)
                today = LogitsProcessor._get_pruned_states(None, full, None, None, meta)[0]
            assert torch.equal(today, hidden[torch.cumsum(fb.extend_seq_lens, 0) - 1]), where
            with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
                before = coordinator.full_gathers
                narrow = cp_utils.cp_gather_after_forward(local, fb)
                assert coordinator.full_gathers == before, f"{where}: the narrow path issued the full gather"
                pruned = LogitsProcessor._get_pruned_states(None, narrow, None, None, meta)[0]
                assert tuple(narrow.shape) == (len(extend_lens), 24), f"{where}: {tuple(narrow.shape)}"
                assert torch.equal(pruned, today), f"{where}: the logits processor got other rows"
                fb.return_logprob = True  # input logprobs need every token: the full gather stays
                assert torch.equal(cp_utils.cp_gather_after_forward(local, fb), full), where
        shapes.append((tuple(full.shape), tuple(narrow.shape)))
    return shapes


# (N, KV cache dtype, prefetch): N = 4 with prefetch, N = 2 without, N = 2 with fp8 rows and prefetch
CONFIGS = ((4, "bf16", True), (2, "bf16", False), (2, "fp8", True))


def _rank_main(rank, world, group, configs):
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the plugin's entry point, as every SGLang process does
    out = {"pool": [], "tail": []}
    for n, kv, prefetch in configs:
        groups = [
            dist.new_group(list(range(s, s + n))) for s in range(0, world, n)
        ]  # collective, same order everywhere
        sub_rank, sub_group = rank % n, groups[rank // n]
        pool_check = lambda: _run_scenario(sub_rank, n, sub_group, seed=7 + n, prefetch=prefetch, kv=kv)  # noqa: E731
        for key, check in (("pool", pool_check), ("tail", lambda: _check_tail_gather(sub_rank, n, sub_group))):
            try:
                out[key].append(check())
            except AssertionError as exc:  # reported by the test that owns the check
                out[key].append(f"AssertionError: {exc}")
    return out


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_rank_main, 4, args=(CONFIGS,), timeout_s=600)


def test_sharded_pool_views_match_unmodified_dsa_pool_at_4_and_2_ranks_bf16_and_fp8(rank_results):
    for rank, out in enumerate(rank_results):
        for r in out["pool"]:
            assert isinstance(r, dict), f"rank {rank}: {r}"
            # Each rank stores ~1/N of the pages (+1 trash page): the same logical pool in 1/N memory.
            pages = 24 + 1
            expected = (-(-pages // r["n"]) + 1) / pages
            assert r["pool_bytes"] / r["ref_bytes"] == pytest.approx(expected), f"{rank=}, {r}"
            # One latent and one index-page all-gather per layer for a batch with history, none without.
            assert [g for g, _ in r["gathers"]] == [2 * LAYERS if h else 0 for h in r["history"]], f"{rank=}, {r}"
            # with prefetch on, every batch with history launched its layers ahead; off, none did
            assert [e for _, e in r["gathers"]] == [h and r["prefetch"] for h in r["history"]], f"{rank=}, {r}"
            assert any(r["history"][len(BATCHES) :]) and not all(r["history"]), f"{rank=}: the random mix lacks a case"
    # SGLang's interleave gives some rank of N=4 no query of some request in the last fixed batch,
    # so the page table it rewrites is the bs_idx-filtered one.
    last_batch = [r["local_requests"][len(BATCHES) - 1] for out in rank_results for r in out["pool"] if r["n"] == 4]
    assert min(last_batch) < len(BATCHES[-1]), last_batch
    assert {r["prefetch"] for out in rank_results for r in out["pool"]} == {True, False}
    assert [r["kv"] for r in rank_results[0]["pool"]] == [kv for _, kv, _ in CONFIGS]


def test_every_rank_issues_the_same_history_collectives_in_the_same_order(rank_results):
    for i, (n, _, _) in enumerate(CONFIGS):
        per_process = [out["pool"][i] for out in rank_results]  # process p is rank p % n of group p // n
        for start in range(0, 4, n):
            members = per_process[start : start + n]
            assert all(m["batches"] == members[0]["batches"] for m in members), f"N={n}: different batches"
            for m in members[1:]:
                assert m["events"] == members[0]["events"], f"N={n}, ranks {start}..{start + n - 1}: collectives differ"


def test_narrow_tail_gather_gives_the_logits_processor_todays_rows(rank_results):
    for rank, out in enumerate(rank_results):
        for shapes in out["tail"]:
            assert isinstance(shapes, list), f"rank {rank}: {shapes}"
            for (full_rows, _), (narrow_rows, _), (extend_lens, _) in zip(
                [s[0] for s in shapes], [s[1] for s in shapes], TAIL_BATCHES
            ):
                assert full_rows == sum(extend_lens) and narrow_rows == len(extend_lens)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
