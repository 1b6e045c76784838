"""benchmark/traffic.py's bytes per forward against the sizes SGLang's own code hands its
collectives on CPU: the layer-split pool's owner broadcasts (its real buffers, the broadcast
recorded), the sharded pool's gather plan (`begin_shard_extend`'s send block), the interleave CP
strategy's chunk all-gathers (the gathered tensors recorded); and the arms' totals at GLM-5 size."""

import os
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
sys.path.insert(0, os.path.join(ROOT, "test"))

import trace_budget as TB  # noqa: E402
import traffic as TF  # noqa: E402
from helpers.dsa_pool import no_dcp, pool_kwargs  # noqa: E402

GLM5 = TB.load_model("glm5")


def by_name(terms):
    return {t.name: t for t in terms}


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_layer_split_broadcasts_what_sglangs_pool_broadcasts(kv):
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

    seen = []

    def record(self, tensor, layer_id, src_tensor=None, use_layer_broadcast_comm=False):
        seen.append((layer_id, tensor.nbytes))
        return tensor

    layers, rows = 5, 64 * 10
    kwargs = dict(pool_kwargs(rows, kv), layer_num=layers)
    with no_dcp(), mock.patch.object(LayerSplitDSATokenToKVPool, "_init_layer_broadcast_comm", lambda self: None), \
            mock.patch.object(LayerSplitDSATokenToKVPool, "_broadcast_tensor_from_owner", record):  # fmt: skip
        pool = LayerSplitDSATokenToKVPool(layer_shard_rank=1, layer_shard_size=2, **kwargs)
        for layer in range(layers):  # what one forward's attention and indexer read, layer by layer
            pool.get_key_buffer(layer)
            pool.get_broadcastable_index_k_with_scale_buffer(layer)
    terms = by_name(TF.kv_terms("layer_split", 2, kv, layers, TF.Batch(((128, 0),)), rows))
    latent, index = terms["owner broadcast, latent buffer"], terms["owner broadcast, index-K buffer"]
    assert seen == [(layer, size) for layer in range(layers) for size in (latent.bus_bytes, index.bus_bytes)]
    assert latent.count == index.count == layers and latent.stream == "side" and index.stream == "compute"
    # rank 1 of 2 owns layers 3, 4 (get_layer_shard_range: the first 5 % 2 ranks own one more)
    assert latent.received_bytes == (layers - 2) * latent.bus_bytes


def test_shared_gather_is_the_padded_block_of_sglangs_plan():
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    n, ps = 4, 64
    pool = object.__new__(PageInterleaveDSATokenToKVPool)  # begin_shard_extend's arithmetic only
    pool.shard_spec = SimpleNamespace(page_size=ps, shard_size=n, max_prefix_tokens=1 << 20, chunk_tokens=1 << 16)
    pool.device, pool._debug_plan_checks, pool.shard_rank, pool._epoch, pool._translate_cache = "cpu", True, 1, 0, {}
    pool._page_pos, pool._trash_base = torch.zeros(10_000, dtype=torch.int32), 0
    pool._chunk_base, pool._local_page_stride, pool.start_layer = 1 << 19, 1 << 20, 0
    sent = []
    pool._prefetch_layer = lambda layer: sent.append(pool._send_rows.numel())
    # two requests, prefixes of 3 and 5 pages with cyclic owners (rotation bases 2 and 1), 2 new pages each
    pages = [[42, 43, 44, 81, 82], [121, 122, 123, 124, 125, 162, 163]]
    req_to_token = torch.zeros(2, 8 * ps, dtype=torch.int64)
    for i, row in enumerate(pages):
        for j, page in enumerate(row):
            req_to_token[i, j * ps : (j + 1) * ps] = page * ps + torch.arange(ps)
    pool.begin_shard_extend(req_to_token, torch.tensor([0, 1]), [3 * ps, 5 * ps], [5 * ps, 7 * ps])
    batch = TF.Batch(((2 * ps, 3 * ps), (2 * ps, 5 * ps)))
    assert batch.history_pages(n) == (8, 12)  # every rank's block: ceil(3/4) + ceil(5/4) = 3 pages
    assert sent == [12 // n * ps]
    gather = by_name(TF.kv_terms("shared", n, "fp8", 78, batch, 0))["history all-gather (latent + index K)"]
    assert gather.bus_bytes == 12 * ps * (656 + 132) * 3 / 4 and gather.stream == "side"
    assert "history all-gather (latent + index K)" not in by_name(TF.kv_terms("shared", n, "fp8", 78,
                                                                               TF.Batch(((512, 0),)), 0))  # fmt: skip


def test_cp_chunk_gathers_are_what_sglangs_interleave_strategy_gathers():
    import sglang.srt.layers.cp.interleave as interleave
    from sglang.srt.runtime_context import get_parallel

    gathered = []

    def record(out, x):
        gathered.append(out.nbytes)

    tokens, n, rank = 1001, 4, 1
    per = [len(range(r, tokens, n)) for r in range(n)]
    batch = SimpleNamespace(attn_cp_metadata=interleave.InterleaveContextParallelMetadata(
        total_seq_lens=tokens, per_rank_actual_token=per))  # fmt: skip
    with get_parallel().override(attn_cp_size=n, attn_cp_rank=rank, attn_cp_group=SimpleNamespace(world_size=n)), \
            mock.patch.object(interleave, "attn_cp_all_gather_into_tensor", record), \
            mock.patch.object(torch.cuda, "current_stream", lambda *a: None):  # fmt: skip
        from sglang.srt.layers.cp.padding import pad_logical_token_to_physical

        pad_logical_token_to_physical(batch.attn_cp_metadata)  # as SGLang's CP set-up does before the forward
        strategy = interleave.InterleaveCPStrategy(n)
        bf16 = dict(dtype=torch.bfloat16)
        strategy.materialize_full_mla_kv(batch, None, torch.zeros(per[rank], 1, 512, **bf16),
                                         torch.zeros(per[rank], 1, 64, **bf16))  # fmt: skip
        strategy.materialize_full_indexer_k_cache(torch.zeros(per[rank], 128, **bf16), batch)
    for arm in ("replicated", "shared", "layer_split"):
        terms = by_name(TF.kv_terms(arm, n, "fp8", 3, TF.Batch(((tokens, 0),)), 64 * 10))
        outs = [terms[f"{name} all-gather"].bus_bytes * n / (n - 1) for name in ("chunk latent", "chunk indexer key")]
        assert outs == gathered, (arm, outs, gathered)
    assert TF.kv_terms("dp_attention", 1, "fp8", 3, TF.Batch(((tokens, 0),)), 0) == []
    assert TF.kv_terms("tp", 1, "fp8", 3, TF.Batch(((tokens, 0),)), 0) == []


def test_glm5_cp8_forward_bytes_per_arm():
    # GLM-5 fp8 at CP 8, 8,192 new tokens after 100,000 of history, the pools of a CP-8 node
    scratch = 2 * (1 * 202_752 + 8192 + 64) * 788  # any scratch: only layer split's pool size matters here
    pools = {p: TB.node_budget(GLM5, TB.Layout(p, 8), "fp8", 61464, scratch).tokens_per_rank for p in TB.PATHS}
    batch = TF.Batch(((8192, 100_032),))
    kv = {p: TF.kv_bytes_per_forward(TF.forward_terms(p, 8, "fp8", GLM5, batch, pools[p])) for p in TB.PATHS}
    history = 8 * -(-1563 // 8) * 64 * 788 * 7 / 8  # 1,563 pages padded to 8 x 196
    chunk = 8192 * (1152 + 256) * 7 / 8
    assert kv["shared"] == pytest.approx(78 * (history + chunk))
    assert kv["replicated"] == pytest.approx(78 * chunk)
    rows = pools["layer_split"]
    per_layer = (rows + 64) * 656 + (rows + 65) // 64 * 64 * 132
    assert per_layer / 1e9 == pytest.approx(2.51, abs=0.01)  # ~2.5 GB a layer at 3.19M rows
    assert kv["layer_split"] == pytest.approx(78 * chunk + (78 - 9) * per_layer)
    assert kv["layer_split"] > 25 * kv["shared"]
    assert kv["dp_attention"] == kv["tp"] == 0
    hidden = {p: by_name(TF.forward_terms(p, 8, "fp8", GLM5, batch, pools[p])) for p in ("tp", "dp_attention")}
    tp_reduce = hidden["tp"]["hidden all-reduce (attention out, MoE out)"].forward_bus_bytes
    dp_move = hidden["dp_attention"]["hidden gather + reduce-scatter around the MoE"].forward_bus_bytes
    assert tp_reduce == pytest.approx(2 * dp_move) and dp_move == pytest.approx(78 * 2 * 8192 * 6144 * 2 * 7 / 8)
    # the flag's tail gather is one row per request from each rank, replicated's each rank's share of the chunk
    tails = {p: by_name(TF.forward_terms(p, 8, "fp8", GLM5, batch, pools[p]))["tail gather for the logits"]
             for p in ("shared", "replicated")}  # fmt: skip
    assert tails["replicated"].bus_bytes == 8192 // 8 * tails["shared"].bus_bytes
    assert all(line.count(":") >= 1 for line in TF.describe(TF.forward_terms("shared", 8, "fp8", GLM5, batch, 0)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
