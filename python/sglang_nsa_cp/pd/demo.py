"""End-to-end PD disaggregation with the reference model: shared-KV CP prefill -> owned-page
transfer -> greedy decode on a non-CP decode instance, checked against the single-rank oracle.

    prefill ranks 0..N-1 (spawned, gloo)             decode instance (this process)
    ------------------------------------             ------------------------------
    shared-KV CP prefill of each chunk               pool = KVStore.replicated(...)   (cp_size 1)
    (KVStore shard, SharedCPKV, prefill_cp)          rx = OwnedPageReceiver(pool's buffers)
    after a request's last chunk:                    rx.expect(request, pages, N, nonce) -> dst pages
      OwnedPageSender.send(rx.address, request,  ->  rx.wait(request): Committed
                           its logical pages, nonce) DecodeKV.adopt(request, dst pages, length)
    first token = argmax(last-token logits)      ->  greedy decode_step_pd(...) x steps

Every message between them is keyed with a shared secret: SGLANG_NSA_CP_PD_SECRET when set, else
a fresh random one this run hands its ranks (`run_pd(secret=...)`). Each request's use of its id
carries a nonce the decode and the ranks both get from here, as a router would give them.

The oracle runs the same chunks through `reference.single` (SlotKVCache + prefill_single) and the
same greedy decode with `decode_step`. The check: identical decoded tokens; the decode pool's KV
equal to the single-rank KV at every position (latent rows and index scales, float32 model
outputs, within `oracle.RTOL` relative; index K fp8 bytes exactly); every transferred page equal,
byte for byte, to its owner's shard page; every request committed and every page freed after.

The decode KV context (`DecodeKV`) is the prefill's own page bookkeeping at cp_size 1:
a `layout.RequestPageTable` whose allocator is the receiver's (`layout.OwnerClassedAllocator` with
one owner class: the decode instance has one free list; the receiver takes a request's pages from
it in `expect()`, decode takes the pages new tokens need from it). A committed request is adopted as a request whose
cached prefix is its transferred length, living in the destination pages; a decode step is then
an extend of one token per request, scheduled like any prefill batch (a cp_size 1 split), and
the pool is read and written as the replicated CP path does (`KVStore.write`, `read_index_k`).

The first output token travels with the prefill ranks' results here; SGLang sends it in the
request's aux (metadata) buffer after the KV.
"""

from __future__ import annotations

import secrets
import time
from typing import Hashable, Sequence

import torch

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter, run_ranks
from sglang_nsa_cp.disagg import KVBuffers, coalesce_runs
from sglang_nsa_cp.disagg.auth import FROM_ENV, SGLANG_NSA_CP_PD_SECRET
from sglang_nsa_cp.layout import OwnerClassedAllocator, RequestPageTable
from sglang_nsa_cp.pd.engine import EngineConfig, MooncakeEngine
from sglang_nsa_cp.pd.protocol import new_nonce
from sglang_nsa_cp.pd.receiver import OwnedPageReceiver
from sglang_nsa_cp.pd.sender import OwnedPageSender
from sglang_nsa_cp.pd.status import Committed
from sglang_nsa_cp.oracle import DTYPES, PATH_SPLIT_MODES, RTOL, Scenario, build_model, rel_err
from sglang_nsa_cp.reference import DenseKV, DSAModel, SlotKVCache, SynchronousKV, decode_step, prefill_single
from sglang_nsa_cp.reference.cp import SharedCPKV, prefill_cp
from sglang_nsa_cp.shared_kv import KVStore

DEFAULT_DECODE_STEPS = 4


# ---- decode side ---------------------------------------------------------------------------


class DecodeKV(SynchronousKV):
    """KV context of the decode instance: the receiver's pool, with each request's pages.

    store      KVStore.replicated(...): the buffers the receiver registered (latent
               [pages * page_size, latent_dim], index [pages, page_size * 132] per layer).
    allocator  the receiver's allocator (`receiver.allocator`: one owner class, cp_size 1).

    adopt() a committed request, then per step begin_batch() + model forward (this object is
    the model's KV context). release() frees the pages decode allocated; the transferred pages
    are the receiver's (`receiver.release(request)`).
    """

    def __init__(self, store: KVStore, allocator: OwnerClassedAllocator):
        if store.cp_size != 1 or allocator.cp_size != 1:
            raise ValueError(
                f"the decode pool is not sharded: need KVStore.replicated and a cp_size 1 allocator, got "
                f"cp_size {store.cp_size} and {allocator.cp_size}"
            )
        self.store = store
        self.page_size = store.page_size
        self.table = RequestPageTable(allocator, store.page_size)
        self._transferred: dict[Hashable, int] = {}  # request -> pages that came with the transfer
        self._all_rows = torch.arange(store.num_slots, device=store.latent[0].device)
        self.batch = None

    def adopt(self, key: Hashable, pages: Sequence[int], length: int) -> None:
        """A committed transfer: positions 0..length-1 of `key` are in decode `pages`."""
        if key in self.table.pages:
            raise ValueError(f"request {key!r} is already decoding")
        if len(pages) != -(-length // self.page_size):
            raise ValueError(f"{length} tokens need {-(-length // self.page_size)} pages, got {len(pages)}")
        self.table.pages[key] = list(pages)
        self.table.lengths[key] = length
        self._transferred[key] = len(pages)

    def begin_batch(self, keys: Sequence[Hashable], extend_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Schedule one extend batch (a decode step: one token per request); new pages come from
        the decode allocator. Returns (positions, request_ids) of the batch's tokens, flat order."""
        plan, batch = self.table.schedule(keys, extend_lens, "interleave")  # cp_size 1: rank 0 has all
        self.store.check_slots(batch.out_cache_loc)
        device = self.store.latent[0].device
        self.batch = batch
        self._slots = batch.out_cache_loc.to(device)
        self._req_rows = batch.req_to_token().to(device)
        return plan.device_tensor("positions", device, 0), plan.device_tensor("request_ids", device, 0)

    def layer_kv(self, layer_id, latent, index_key, index_scale) -> DenseKV:
        if self.batch is None:
            raise RuntimeError("DecodeKV.layer_kv called before begin_batch")
        self.store.write(layer_id, self._slots, latent, index_key, index_scale)
        key, scale = kernels.read_index_k(self.store.index[layer_id], self._all_rows, self.page_size)
        return DenseKV(self.store.latent[layer_id], key, scale, self._req_rows)

    def slots_of(self, key: Hashable) -> torch.Tensor:
        """int64 [length]: pool slot of every position of a request."""
        return self.table.slots(key)

    def release(self, key: Hashable) -> None:
        pages = self.table.pages.pop(key)
        self.table.lengths.pop(key)
        self.table.allocator.free(pages[self._transferred.pop(key) :])


@torch.no_grad()
def decode_step_pd(model: DSAModel, kv: DecodeKV, keys: Sequence[Hashable], token_ids: torch.Tensor) -> torch.Tensor:
    """One decode step on the decode pool: token_ids int64 [bs] -> logits [bs, vocab]."""
    positions, request_ids = kv.begin_batch(keys, [1] * len(keys))
    return model.logits(model(token_ids.reshape(-1), positions, request_ids, kv))


# ---- prefill side (one spawned process per CP rank) ----------------------------------------


def _last_chunk(s: Scenario) -> dict[str, int]:
    return {key: c for c, chunk in enumerate(s.chunks) for key, _ in chunk}


def prefill_rank(
    rank: int,
    world: int,
    group,
    s: Scenario,
    decode_address: str,
    engine_config: EngineConfig,
    nonces: dict[str, int],
    secret: bytes | None,
) -> dict:
    """Shared-KV CP prefill of every chunk; each request's owned pages go to the decode after the
    chunk that finishes it. Call through `run_ranks`."""
    start = time.perf_counter()
    model = build_model(s)
    cfg = model.config
    table = RequestPageTable(OwnerClassedAllocator(s.num_pages(), world), s.page_size)
    store = KVStore(
        cp_size=world,
        rank=rank,
        num_layers=cfg.num_layers,
        num_pages=s.num_pages(),
        page_size=s.page_size,
        latent_dim=cfg.latent_dim,
        latent_dtype=DTYPES[s.dtype],
    )
    sender = OwnedPageSender(
        KVBuffers(store.latent, store.index, s.page_size), rank, world, engine_config=engine_config, secret=secret
    )
    last_chunk = _last_chunk(s)
    counter = TrafficCounter()
    logits, sends = [], {}
    try:
        for c, (chunk, ids) in enumerate(zip(s.chunks, s.tokens(cfg.vocab_size))):
            keys = [k for k, _ in chunk]
            plan, batch = table.schedule(keys, [n for _, n in chunk], PATH_SPLIT_MODES[s.split]["shared"])
            kv = SharedCPKV(store, plan, batch, rank, group, counter, prefetch=s.prefetch)
            logits.append(prefill_cp(model, torch.cat(ids), kv, narrow_tail=True))
            for key in keys:
                if last_chunk[key] == c:  # finished: send the whole request once
                    sends[key] = sender.send(decode_address, key, table.pages[key], nonce=nonces[key])
    finally:
        sender.close()
    return {
        "logits": logits,
        "sends": sends,
        "stats": sender.stats,
        "pages": {k: list(v) for k, v in table.pages.items()},
        "latent": store.latent,
        "index": store.index,
        "traffic": counter.as_dict(),
        "seconds": time.perf_counter() - start,
    }


# ---- the run and its checks ----------------------------------------------------------------


def _pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def _greedy(first: dict[str, int], keys, steps, step_fn) -> dict[str, list[int]]:
    tokens = {k: [first[k]] for k in keys}
    for _ in range(steps):
        logits = step_fn(torch.tensor([tokens[k][-1] for k in keys], dtype=torch.long))
        for k, t in zip(keys, logits.argmax(dim=-1).tolist()):
            tokens[k].append(t)
    return tokens


def _kv_diff(single: SlotKVCache, pool: KVStore, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Single-rank slots vs decode-pool slots, every layer.

    Latent rows and index scales are float32 model outputs: compared within `RTOL` relative (a
    token computed on another CP rank, in another batch shape, can differ in the last bit).
    Index keys are fp8 bytes: compared exactly.
    """
    lat_err, scale_err, key_bytes, key_mismatch, scale_inexact, rows = 0.0, 0.0, 0, 0, 0, 0
    for layer in range(pool.num_layers):
        for s_slots, d_slots in pairs:
            if not s_slots.numel():
                continue
            rows += s_slots.numel()
            lat_err = max(lat_err, rel_err(pool.latent[layer][d_slots], single.latent[layer, s_slots]))
            key, scale = kernels.read_index_k(pool.index[layer], d_slots, pool.page_size)
            want_key, want_scale = single.index_key[layer, s_slots], single.index_scale[layer, s_slots]
            key_bytes += key.numel()
            key_mismatch += int((key != want_key).sum())
            scale_inexact += int((scale.view(torch.int32) != want_scale.view(torch.int32)).sum())
            scale_err = max(scale_err, rel_err(scale, want_scale))
    return {
        "rows": rows,  # positions x layers compared
        "max_rel_latent_err": lat_err,
        "index_key_bytes": key_bytes,
        "index_key_mismatched_bytes": key_mismatch,
        "index_scales_not_bit_equal": scale_inexact,
        "max_rel_index_scale_err": scale_err,
        "ok": lat_err <= RTOL and key_mismatch == 0 and scale_err <= RTOL,
    }


def _transfer_exact(ranks: list[dict], pool: KVStore, dst: dict[str, list[int]], world: int) -> bool:
    """Every transferred decode page holds its owner's shard page, byte for byte (kv and index)."""
    ps = pool.page_size
    for key, pages in dst.items():
        for k, (p, q) in enumerate(zip(ranks[0]["pages"][key], pages)):
            shard, local = ranks[p % world], p // world
            for layer in range(pool.num_layers):
                got = pool.latent[layer][q * ps : (q + 1) * ps]
                want = shard["latent"][layer][local * ps : (local + 1) * ps]
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    return False
                if not torch.equal(pool.index[layer][q], shard["index"][layer][local]):
                    return False
    return True


def run_pd(
    s: Scenario,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    timeout_s: float = 300.0,
    engine: MooncakeEngine | None = None,
    engine_config: EngineConfig = EngineConfig(),
    secret=FROM_ENV,
) -> dict:
    """Prefill `s` on s.cp_size spawned shared-KV ranks, transfer to a decode pool in this
    process, decode `decode_steps` tokens greedily; compare with the single-rank oracle.
    secret: the PD key (FROM_ENV: SGLANG_NSA_CP_PD_SECRET, or a fresh random one when unset)."""
    if decode_steps < 0:
        raise ValueError(f"decode_steps must be >= 0, got {decode_steps}")
    if secret == FROM_ENV:
        secret = SGLANG_NSA_CP_PD_SECRET.get() or secrets.token_bytes(32)
    start = time.perf_counter()
    model = build_model(s)
    cfg, ps, dtype = model.config, s.page_size, DTYPES[s.dtype]
    lengths = s.final_lengths()
    keys = list(lengths)
    last_chunk = _last_chunk(s)
    chunk_tokens = s.tokens(cfg.vocab_size)

    # The oracle: single-rank prefill of the same chunks, then the same greedy decode.
    pool_pages = sum(_pages(n + decode_steps, ps) for n in lengths.values())
    single = SlotKVCache(cfg, pool_pages * ps, ps, dtype=dtype)
    single_logits = [
        prefill_single(model, ids, single, [k for k, _ in chunk]) for chunk, ids in zip(s.chunks, chunk_tokens)
    ]
    single_pages = {k: (single.slots_of(k)[::ps] // ps).tolist() for k in keys}

    def first_tokens(per_chunk_logits) -> dict[str, int]:
        out = {}
        for key in keys:
            c = last_chunk[key]
            out[key] = int(per_chunk_logits[c][[k for k, _ in s.chunks[c]].index(key)].argmax())
        return out

    single_tokens = _greedy(
        first_tokens(single_logits), keys, decode_steps, lambda t: decode_step(model, single, keys, t)
    )

    # The decode instance: a replicated-shaped pool, the receiver, then the prefill ranks.
    pool = KVStore.replicated(
        num_layers=cfg.num_layers, num_pages=pool_pages, page_size=ps, latent_dim=cfg.latent_dim, latent_dtype=dtype
    )
    rx = OwnedPageReceiver(
        KVBuffers(pool.latent, pool.index, ps),
        engine=engine,
        engine_config=engine_config,
        timeout_s=timeout_s,
        secret=secret,
    )
    report: dict = {
        "cp_size": s.cp_size,
        "decode_steps": decode_steps,
        "decode_pool_pages": pool_pages,
        "keyed": secret is not None,
    }
    try:
        nonces = {key: new_nonce() for key in keys}
        dst = {key: rx.expect(key, _pages(n, ps), s.cp_size, nonce=nonces[key]) for key, n in lengths.items()}
        prefill_start = time.perf_counter()
        ranks = run_ranks(
            prefill_rank, s.cp_size, args=(s, rx.address, engine_config, nonces, secret), timeout_s=timeout_s
        )
        report["prefill_seconds"] = time.perf_counter() - prefill_start
        statuses = {key: rx.wait(key, timeout_s=30) for key in keys}
        failed = {k: repr(st) for k, st in statuses.items() if not isinstance(st, Committed)}
        report["committed"] = not failed
        if failed:
            report.update(failures=failed, decoded_tokens_match=False, ok=False)
            return report
        report["transfer_exact"] = _transfer_exact(ranks, pool, dst, s.cp_size)  # before decode writes

        decode_start = time.perf_counter()
        ctx = DecodeKV(pool, rx.allocator)
        for key in keys:
            ctx.adopt(key, dst[key], lengths[key])
        pd_tokens = _greedy(
            first_tokens(ranks[0]["logits"]), keys, decode_steps, lambda t: decode_step_pd(model, ctx, keys, t)
        )
        report["decode_seconds"] = time.perf_counter() - decode_start

        transferred, decoded = [], []
        for key in keys:
            s_slots, d_slots, n = single.slots_of(key), ctx.slots_of(key), lengths[key]
            transferred.append((s_slots[:n], d_slots[:n]))
            decoded.append((s_slots[n:], d_slots[n:]))
        kv = {"transferred": _kv_diff(single, pool, transferred), "decoded": _kv_diff(single, pool, decoded)}
        logit_err = max(rel_err(r["logits"][c], single_logits[c]) for r in ranks for c in range(len(s.chunks)))

        stats = [r["stats"] for r in ranks]
        num_buffers = 2 * cfg.num_layers
        page_bytes = rx.buffers.bytes_per_page()
        baseline_transfers = sum(len(coalesce_runs(single_pages[k], dst[k])) * num_buffers for k in keys)
        report.update(
            {
                "requests": {
                    k: {
                        "prefill_tokens": lengths[k],
                        "logical_pages": ranks[0]["pages"][k],
                        "decode_pages": ctx.table.pages[k],
                        "tokens": pd_tokens[k],
                        "single_tokens": single_tokens[k],
                    }
                    for k in keys
                },
                "decoded_tokens_match": pd_tokens == single_tokens,
                "max_rel_prefill_logit_err": logit_err,
                "kv": kv,
                "bytes_per_page": page_bytes,
                "bytes_per_rank": [st.nbytes for st in stats],
                "transfers_per_rank": [st.transfers for st in stats],
                "pages_per_rank": [st.pages for st in stats],
                "batches_per_rank": [st.batches for st in stats],
                "transfers_issued": sum(st.transfers for st in stats),
                "received_per_rank": {r: vars(v) for r, v in sorted(rx.stats.per_rank.items())},
                # Today's SGLang default: CP rank 0 holds every page and sends all of them, its
                # (SGLang-like, as reference.single allocates) pages coalesced against the same
                # decode pages.
                "rank0_sends_all": {
                    "bytes": sum(len(dst[k]) for k in keys) * page_bytes,
                    "transfers": baseline_transfers,
                },
            }
        )
        report["ok"] = bool(
            report["decoded_tokens_match"]
            and report["transfer_exact"]
            and all(d["ok"] for d in kv.values())
            and logit_err <= RTOL
        )
        for key in keys:
            ctx.release(key)
            rx.release(key)
        report["decode_pages_free_after_release"] = rx.allocator.free_pages() == pool_pages
    finally:
        rx.close()
        report["seconds"] = time.perf_counter() - start
    return report
