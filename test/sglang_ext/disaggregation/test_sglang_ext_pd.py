"""CPU, ~4-6 min (runs of 5, 4, 4 and 4 processes, each importing SGLang, on 2 cores): the
owned-page PD transfer inside SGLang 0.5.23's Mooncake disaggregation (sglang_ext/disaggregation/),
with bf16 and fp8 KV, and with an MTP draft pool.

Every role is its own spawned process running SGLang's real classes over Mooncake's TCP transport
on 127.0.0.1, the way a prefill CP rank and a decode scheduler run them:

- prefill CP rank r of N, with the plugin's flag and so SGLang's `--enable-kv-cache-sharding`
  on: SGLang's page-interleaved DSA pool (`PageInterleaveDSATokenToKVPool`, the plugin's
  subclass once loaded; `size` per rank, local page p // N holds logical page p of class
  p % N == r, logical pages 0..N-1 are the padding pages; filled with a byte pattern of (page,
  layer, kind)) over SGLang's attention-CP `GroupCoordinator` (gloo; the CPU stand-in turns the
  pool's PyNccl history gather into a gloo all-gather), the KV manager built by SGLang's own
  `PrefillBootstrapQueue._init_kv_manager` (buffer registration, DSA state set-up,
  `MooncakeKVManager` with its bootstrap and transfer threads; SGLang takes the shard rank and
  size from the group and ships only the owned KV and index-K pages), the plugin loaded through
  its entry point (its ledger, self-check and manifests), and per request a `MooncakeKVSender`
  driven like `Scheduler._send_kv_chunk` drives it (`init`, `send` per chunk of logical page ids,
  the DSA state pages on the last chunk, `poll`). Rank 0 also runs SGLang's bootstrap server.
- decode: a stock `DSATokenToKVPool` (no CP), the manager built by
  `DecodePreallocQueue._init_kv_manager`, and per request a `MooncakeKVReceiver`
  (`try_ensure_parallel_info`, `init`, `send_metadata` with its destination pages, `poll`). One
  decode loads the plugin (no flag), one is stock SGLang (plugin not loaded).
- with an EAGLE MTP draft: a draft pool on each side (the prefill's built as SGLang's
  `_build_mtp_kv_shard_pool` builds it: its own buffers with the target's size, shard spec and
  group; the decode's stock), registered through the same `_init_kv_manager` calls as SGLang's
  draft KV pool.

Request pages are logical page ids under SGLang's placement (>= N, owner p % N); one request's
come from SGLang's owner-rotating allocator (`PageInterleavePoolAllocator`), its decode pages
dealt out grouped by owner as the plugin's decode hook deals them.

Checked: a committed request's pages (MLA latent and index-K, every layer) are at the decode pages
of their positions and nothing else in the decode pool changed; each rank writes exactly its owned
pages (bytes = owned pages x page bytes + the request's metadata), the allocator's request in one
run per rank; a rank that never sends, a page a rank drops (caught by the rank's self-check, or
with that bypassed by the decode's manifest check) fail the request with a reason naming the
problem, and the next request commits. Every process has SGLANG_NSA_CP_PD_SECRET, so manifests are keyed (the stock decode
ignores them). With fp8 KV (656-byte FlashMLA rows written by the pools' own
`set_mla_kv_buffer`), the decode's pages equal a replicated prefill's (SGLang's own fp8 pool),
byte for byte. A rank whose write comes after the decode gave up on the room: SGLang's deferred
release (the drain ack) makes the pages safe to reuse only after that write landed (issue 17).
In process: the rank's self-check, the commit rule against the decode's own request, hostile
manifest frames (nested, oversized, 2e7 ranks, unkeyed, replayed), the hooks' pass-through
without the flag and the status socket's size limit. Not run here: the scheduler loop around
these calls (the CP all-reduce of poll states, the radix cache, chunked-prefill scheduling), the
pool's forward (test/sglang_ext/mem_cache/test_page_interleave_pool.py), RDMA, GPU memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.distributed import free_port, run_ranks  # noqa: E402

register_cpu_ci(est_time=120, suite="nsa-cp-test-cpu")

PAGE = 64
LAYERS = 2
# --kv-cache-dtype: (pool dtype, SGLang's kv_cache_dim, latent bytes of one page of one layer)
KV_FORMATS = {
    "bfloat16": (torch.bfloat16, 576, PAGE * 576 * 2),
    "fp8_e4m3": (torch.float8_e4m3fn, 656, PAGE * 656),  # FlashMLA rows: 512 fp8 + 4 fp32 scales + 64 bf16
}
KV_PAGE_BYTES = KV_FORMATS["bfloat16"][2]  # the tests without fp8
INDEX_PAGE_BYTES = PAGE * 132  # fp8 keys + fp32 scales of one page, one layer
PREFILL_PAGES = 48  # logical pages of the prefill CP group (pages 0..N-1: SGLang's padding pages); N divides it
DECODE_PAGES = 96
WAITING_TIMEOUT_S = 6  # decode: SGLANG_DISAGGREGATION_WAITING_TIMEOUT
SENTINEL = 0xEE


def _env(waiting_timeout=None):
    os.environ.update(
        TRITON_INTERPRET="1", MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1", OMP_NUM_THREADS="1",
        SGLANG_DISAGGREGATION_THREAD_POOL_SIZE="2", SGLANG_DISAGGREGATION_QUEUE_SIZE="1",
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="60", SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="5",
    )  # fmt: skip
    os.environ["SGLANG_NSA_CP_PD_SECRET"] = SECRET.decode()  # keyed manifests; a stock decode ignores them
    if waiting_timeout is not None:
        os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(waiting_timeout)
    torch.set_num_threads(1)


def _pattern(logical: int, layer: int, kind: int, nbytes: int) -> torch.Tensor:
    """The bytes of one page of one layer: kind 0 = MLA latent, 1 = index K/scale. The MTP draft's
    one layer is layer LAYERS."""
    base = (logical * 131 + layer * 17 + kind * 7) % 251
    return ((torch.arange(nbytes, dtype=torch.int64) * (2 * kind + 3) + base) % 251).to(torch.uint8)


def _pool_kwargs(size, kv="bfloat16", layers=LAYERS):
    dtype, kv_cache_dim, _ = KV_FORMATS[kv]
    return dict(size=size, page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
                layer_num=layers, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=kv_cache_dim)  # fmt: skip


def _latent(logical: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's bf16 latent of one page of one layer, (k_nope [64, 512], k_rope [64, 64])."""
    g = torch.Generator().manual_seed(logical * 131 + layer)
    kv = (torch.randn(PAGE, 576, generator=g) * torch.rand(PAGE, 1, generator=g) * 8).to(torch.bfloat16)
    return kv[:, :512].contiguous(), kv[:, 512:].contiguous()


def _write_latent(pool, pages):
    """Write `pages`' latent through the pool's own `set_mla_kv_buffer`, as attention does: the
    sharded pool (the plugin's subclass; outside an extend, no scratch) quantizes once and
    persists its owned rows, SGLang's replicated pool stores every row. The quantizer is the torch
    twin of SGLang's Triton one in both (sglang_cpu_forward.md: the interpreter is too slow for it)."""
    from helpers import sglang_cpu_stand_ins

    sglang_cpu_stand_ins.install_fp8_kv_stand_ins()
    for layer in range(LAYERS):
        for logical in pages:
            nope, rope = _latent(logical, layer)
            loc = torch.arange(logical * PAGE, (logical + 1) * PAGE)
            pool.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=layer)


def _publish(mode, cp_size, cp_rank, bootstrap_port, shard_group=None):
    """Publish the process's ServerArgs and ranks. shard_group: a shared-KV prefill CP rank's
    attention-CP group; then the plugin's flag and SGLang's `--enable-kv-cache-sharding` are on,
    as the plugin's start-up validation leaves them (`CommonKVManager.__init__` reads the shard
    rank and size off that group, Mooncake's DSA state send filters by them)."""
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    shared_kv = shard_group is not None
    server_args = ServerArgs(
        model_path="dummy", device="cpu", host="127.0.0.1", port=free_port(), page_size=PAGE,
        disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port, tp_size=cp_size, attn_cp_size=cp_size,
        enable_prefill_cp=cp_size > 1, enable_kv_cache_sharding=shared_kv,
    )  # fmt: skip
    if shared_kv:
        setattr(server_args, ATTR, True)  # what the plugin's start-up validation writes
    get_context().set_server_args(server_args)
    if shared_kv:
        get_parallel().override_permanently(attn_cp_group=shard_group)
    assert get_parallel().enable_kv_cache_sharding == shared_kv
    get_parallel().override_permanently(
        tp_rank=cp_rank,
        attn_cp_rank=cp_rank,
        attn_tp_rank=0,
        attn_dp_rank=0,
        pp_rank=0,
        attn_dcp_rank=0,
        dp_rank=None,
        pp_group=SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True),
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    return server_args


def _load_plugin():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # entry-point discovery, register(), HookRegistry.apply_hooks()
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert "sglang.srt.disaggregation.utils.get_kv_class" in HookRegistry._patched


def _scheduler_stub(server_args, kv="bfloat16", **extra):
    model_runner = SimpleNamespace(kv_cache_dtype_str=kv)
    return SimpleNamespace(
        rust_server=None, tp_worker=SimpleNamespace(model_runner=model_runner), enable_hisparse=False,
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(), num_hidden_layers=LAYERS),
        server_args=server_args, **extra,
    )  # fmt: skip


def _metadata_buffers():
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(16, 16, torch.float32, 1, max_top_logprobs_num=1)


def _wait(poll, done, deadline_s, what, interval_s=0.02):
    deadline = time.monotonic() + deadline_s
    while True:
        state = poll()
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still {state!r} after {deadline_s} s")
        time.sleep(interval_s)


def _status_name(status):
    from sglang.srt.disaggregation.base.conn import KVPoll

    return {
        int(getattr(KVPoll, n)): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
    }[int(status)]


def _port_open(port):
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- the prefill CP rank ----------------------------------------------------------------------------
class _Traffic:
    """Bytes and batch entries each request's transfers wrote, from SGLang's `_transfer_data`
    (the one call under every Mooncake write), attributed with the room of the chunk the worker
    thread took off its queue."""

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.rooms = {}
        self.write_end = {}  # room -> time.monotonic() a slowed write finished (faults)
        self.slowed = set()

    def install(self):
        from sglang.srt.disaggregation.common.utils import FastQueue
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        traffic, get, transfer, send_aux = (
            self,
            FastQueue.get,
            MooncakeKVManager._transfer_data,
            MooncakeKVManager.send_aux,
        )

        def tagged_get(q):
            item = get(q)
            traffic.local.room = getattr(item, "room", None)
            return item

        def counted_transfer(mgr, session, blocks):
            kind = "aux" if getattr(traffic.local, "aux", False) else "pages"
            with traffic.lock:
                stats = traffic.rooms.setdefault(traffic.local.room, {"pages": [0, 0], "aux": [0, 0]})
                stats[kind][0] += sum(length for _, _, length in blocks)
                stats[kind][1] += len(blocks)
            return transfer(mgr, session, blocks)

        def flagged_send_aux(mgr, *args, **kwargs):
            traffic.local.aux = True
            try:
                return send_aux(mgr, *args, **kwargs)
            finally:
                traffic.local.aux = False

        FastQueue.get, MooncakeKVManager._transfer_data, MooncakeKVManager.send_aux = (
            tagged_get,
            counted_transfer,
            flagged_send_aux,
        )


def _fill_shard(pool, rank, cp_size, kv="bfloat16", latent_pages=(), first_layer=0):
    """bf16: byte patterns of (page, layer, kind) in every owned page. fp8: the index pages the
    same, the latent of `latent_pages` written by the pool from `_latent` (quantized on write).
    SGLang's sharded pool holds the rank's local pages: logical page p (p % N == rank, p >= N) at
    local page p // N; local page 0 is the padding pages'. first_layer: the pattern's layer of the
    pool's layer 0 (an MTP draft pool's one layer is LAYERS)."""
    page_bytes = KV_FORMATS[kv][2]
    local_pages = pool.size // PAGE + 1  # SGLang's pool: size + one page
    assert cp_size * local_pages == PREFILL_PAGES, (cp_size, local_pages)
    for layer in range(pool.layer_num):
        latent = pool.kv_buffer[layer].view(torch.uint8).view(local_pages, -1)
        index = pool.index_k_with_scale_buffer[layer]
        assert latent.shape[1] == page_bytes and index.shape == (local_pages, INDEX_PAGE_BYTES), index.shape
        for logical in range(cp_size + rank, PREFILL_PAGES, cp_size):
            if kv == "bfloat16":
                latent[logical // cp_size] = _pattern(logical, first_layer + layer, 0, page_bytes)
            index[logical // cp_size] = _pattern(logical, first_layer + layer, 1, INDEX_PAGE_BYTES)
    if kv != "bfloat16":
        _write_latent(pool, latent_pages)


def _sharded_pools(rank, cp_size, shard_group, kv, draft):
    """The rank's SGLang page-interleaved DSA pool (the plugin's subclass: the plugin is loaded),
    as SGLang's KV configurator builds it under KV sharding: `size` is per rank, the spec the
    plugin's `make_page_shard_spec` gives, the attention-CP group as shard group. With a draft,
    the MTP layer's pool as `_build_mtp_kv_shard_pool` builds it: the target's size, spec and
    group, its own buffers."""
    from sglang.srt.mem_cache import page_interleave_pool
    from sglang.srt.runtime_context import get_parallel

    from helpers.sglang_model_harness import shard_spec

    import sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool as plugin_pool

    pool_class = page_interleave_pool.PageInterleaveDSATokenToKVPool
    assert pool_class is plugin_pool.PageInterleaveDSATokenToKVPool, "the plugin's REPLACE hook did not take"
    spec = shard_spec(rank, cp_size, context_len=4 * PAGE, chunk_tokens=4 * PAGE, contexts=1)
    size = (PREFILL_PAGES // cp_size - 1) * PAGE
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        pool = pool_class(**_pool_kwargs(size, kv), shard_spec=spec, shard_group=shard_group)
        draft_pool = None
        if draft:
            draft_pool = pool_class(
                **_pool_kwargs(pool.size, kv, layers=1), shard_spec=pool.shard_spec, shard_group=pool.shard_group
            )
    return pool, draft_pool


def _install_faults(rank, faults, traffic):
    """Test-only faults, applied outside the plugin's hooks: `drop`: rooms where this rank loses
    its first owned page after SGLang's filtering; `bypass`: rooms where its self-check is skipped;
    `slow`: {room: seconds} this rank's first page write of the room waits before it starts (its
    end time goes into `traffic.write_end`)."""
    from sglang.srt.disaggregation.common.conn import CommonKVSender
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    import sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn as plugin_conn

    slow, transfer = dict(faults.get(("slow", rank), {})), MooncakeKVManager._transfer_data
    traffic.slowed = set(slow)  # rooms whose slowed write has not finished

    def slow_transfer(mgr, session, blocks):
        room = getattr(traffic.local, "room", None)
        delay = slow.pop(room, None) if not getattr(traffic.local, "aux", False) else None
        if delay is not None:
            time.sleep(delay)  # the decode gives up meanwhile; this write still lands afterwards
        try:
            return transfer(mgr, session, blocks)
        finally:
            if delay is not None:
                traffic.write_end[room] = time.monotonic()
                traffic.slowed.discard(room)

    MooncakeKVManager._transfer_data = slow_transfer
    drop, bypass = faults.get(("drop", rank), set()), faults.get(("bypass", rank), set())
    dropped = set()
    prepare = CommonKVSender._prepare_send_indices

    def lossy_prepare(sender, kv_indices, state_indices=None):
        out = prepare(sender, kv_indices, state_indices)
        room = sender.bootstrap_room
        if room in drop and room not in dropped and len(out[0]) > 0:
            dropped.add(room)
            return (out[0][1:], out[1][1:]) + tuple(out[2:])
        return out

    self_check = plugin_conn.self_check

    def lenient_self_check(ledger, room):
        manifest, problem = self_check(ledger, room)
        return manifest, (None if room in bypass else problem)

    CommonKVSender._prepare_send_indices = lossy_prepare
    plugin_conn.self_check = lenient_self_check


def _prefill_rank(rank, cp_size, shard_group, bootstrap_port, requests, faults, draft=False, kv="bfloat16") -> list:
    results = []
    _env()
    _load_plugin()
    server_args = _publish("prefill", cp_size, rank, bootstrap_port, shard_group)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    if rank == 0:  # in SGLang the prefill's HTTP server process runs it
        MooncakeKVBootstrapServer("127.0.0.1", bootstrap_port)
    _wait(lambda: _port_open(bootstrap_port), bool, 90, "bootstrap server", interval_s=0.2)
    pool, draft_pool = _sharded_pools(rank, cp_size, shard_group, kv, draft)
    _fill_shard(pool, rank, cp_size, kv, sorted({p for req in requests for p in req["pages"]}))
    if draft_pool is not None:
        _fill_shard(draft_pool, rank, cp_size, first_layer=LAYERS)
    traffic = _Traffic()
    traffic.install()
    _install_faults(rank, faults, traffic)
    queue_stub = SimpleNamespace(
        transfer_backend=TransferBackend.MOONCAKE, tp_rank=rank, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft_pool, is_mla_backend=True, metadata_buffers=_metadata_buffers(),
        scheduler=_scheduler_stub(server_args, kv),
    )  # fmt: skip
    mgr = PrefillBootstrapQueue._init_kv_manager(queue_stub)
    assert mgr.enable_all_cp_ranks_for_transfer and not mgr.is_dummy_cp_rank
    assert (mgr.kv_shard_rank, mgr.kv_shard_size) == (rank, cp_size)
    info = {"kv_item_lens": list(mgr.kv_args.kv_item_lens), "state_item_lens": [list(x) for x in mgr.kv_args.state_item_lens],
            "aux_bytes": sum(mgr.kv_args.aux_item_lens)}  # fmt: skip
    results.append(("ready", rank, info))

    def serve(req):
        room = req["room"]
        if rank in req.get("silent", ()):
            return {"status": "silent"}
        sender = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER)(mgr, f"127.0.0.1:{bootstrap_port}", room)
        _wait(sender.poll, lambda s: s in (KVPoll.WaitingForInput, KVPoll.Failed), 60, f"room {room} bootstrap")
        pages = np.asarray(req["pages"], dtype=np.int32)
        sender.init(len(pages), aux_index=req["aux"])
        start = 0
        for i, size in enumerate(req["chunks"]):
            last = i == len(req["chunks"]) - 1
            sender.send(pages[start : start + size], [pages.copy()] if last else None)
            start += size
        status = _wait(sender.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), 60, f"room {room} transfer")
        with mgr.failure_lock:
            reason = mgr.failure_records.get(room)
        sender.clear()  # as the scheduler does once the room failed, a slowed write still going
        _wait(lambda: room not in traffic.slowed, lambda done: done, 30, f"room {room} late write")
        with traffic.lock:
            stats = traffic.rooms.get(room, {"pages": [0, 0], "aux": [0, 0]})
        return {
            "status": _status_name(status),
            "reason": reason,
            "stats": stats,
            "write_end": traffic.write_end.get(room),
        }

    def run(req):
        try:
            results.append(("room", rank, req["room"], serve(req)))
        except BaseException:
            results.append(("error", rank, traceback.format_exc()))

    threads = [threading.Thread(target=run, args=(req,), daemon=True) for req in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = [msg[2] for msg in results if msg[0] == "error"]
    assert not errors, f"prefill rank {rank}: a request's thread failed:\n" + "\n".join(errors)
    return results


# ---- the decode instance ------------------------------------------------------------------------------
def _decode(name, plugin, bootstrap_port, requests, draft=False, kv="bfloat16") -> list:
    results = []
    _env(waiting_timeout=WAITING_TIMEOUT_S)
    if plugin:
        _load_plugin()
    server_args = _publish("decode", 1, 0, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    if not plugin:
        from sglang.srt.plugins.hook_registry import HookRegistry

        assert not HookRegistry._patched, "the stock decode must run without the plugin"
    page_bytes = KV_FORMATS[kv][2]
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        pool = DSATokenToKVPool(**_pool_kwargs((DECODE_PAGES - 1) * PAGE, kv))
        draft_pool = DSATokenToKVPool(**_pool_kwargs((DECODE_PAGES - 1) * PAGE, kv, layers=1)) if draft else None
        replicated = None
        if kv != "bfloat16":  # what a replicated prefill (SGLang's own pool, every row) holds
            replicated = DSATokenToKVPool(**_pool_kwargs((PREFILL_PAGES - 1) * PAGE, kv))
            _write_latent(replicated, sorted({p for req in requests for p in req["pages"]}))

    def expected_latent(logical, layer):
        if replicated is None:
            return _pattern(logical, layer, 0, page_bytes)
        return replicated.kv_buffer[layer].view(torch.uint8).view(-1, page_bytes)[logical]

    # one entry per layer: the target's, then the MTP draft's (layer LAYERS)
    latent = [
        p.kv_buffer[i].view(torch.uint8).view(-1, page_bytes)
        for p in (pool, draft_pool)
        if p is not None
        for i in range(p.layer_num)
    ]
    index = [p.index_key_cache.buffer[i] for p in (pool, draft_pool) if p is not None for i in range(p.layer_num)]
    for t in latent + index:
        t.fill_(SENTINEL)
    queue_stub = SimpleNamespace(
        transfer_backend=TransferBackend.MOONCAKE, tp_rank=0, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft_pool, is_mla_backend=True, metadata_buffers=_metadata_buffers(),
        enable_staging=False, scheduler=_scheduler_stub(server_args, kv),
    )  # fmt: skip
    mgr = DecodePreallocQueue._init_kv_manager(queue_stub)
    addr = f"127.0.0.1:{bootstrap_port}"
    _wait(lambda: mgr.try_ensure_parallel_info(addr), bool, 90, "prefill bootstrap", interval_s=0.5)
    info = mgr.prefill_info_table[addr]
    results.append(("ready", name, {"target_cp_ranks": list(info.target_cp_ranks),
                                 "required": info.required_prefill_response_num}))  # fmt: skip
    used: set[int] = set()
    for req in requests:
        room, dst = req["room"], np.asarray(req["dst"], dtype=np.int32)
        t_room = time.monotonic()
        receiver = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)(mgr, addr, room)
        receiver.init(prefill_dp_rank=0)
        receiver.send_metadata(dst, req["aux"], [dst.copy()])
        fuzzed = req["fuzz"](mgr, room) if "fuzz" in req else {}  # a hostile peer while the room is in flight
        if "abort_after_s" in req:
            used.update(int(d) for d in dst)
            results.append(("room", name, room, _abort_and_wait_for_drain(mgr, receiver, req, latent, dst)))
            continue
        status = _wait(receiver.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), 60, f"room {room}")
        with mgr.failure_lock:
            reason = mgr.failure_records.get(room)
        receiver.clear()
        used.update(int(d) for d in dst)
        wrong = []
        if status == KVPoll.Success:
            for k, (logical, page) in enumerate(zip(req["pages"], dst)):
                for layer in range(len(latent)):
                    if not torch.equal(latent[layer][page], expected_latent(logical, layer)):
                        wrong.append(("latent", k, layer))
                    if not torch.equal(index[layer][page], _pattern(logical, layer, 1, INDEX_PAGE_BYTES)):
                        wrong.append(("index", k, layer))
        untouched = [p for p in range(DECODE_PAGES) if p not in used]
        stray = [p for p in untouched for t in (latent + index) if not bool((t[p] == SENTINEL).all())]
        results.append(
            (
                "room",
                name,
                room,
                {
                    "status": _status_name(status),
                    "reason": reason,
                    "wrong": wrong,
                    "stray": stray,
                    "seconds": round(time.monotonic() - t_room, 2),
                    **fuzzed,
                },
            )
        )
    return results


def _abort_and_wait_for_drain(mgr, receiver, req, latent, dst):
    """The decode gives up on a room while a prefill rank's write is still coming (what its
    scheduler does on a timeout or an abort: `ensure_abort_notified`, then it holds the pages
    until `is_abort_release_safe`). Report when release became safe and whether every page had
    landed by then: SGLang's deferred release is what keeps a late write out of reused pages."""
    time.sleep(req["abort_after_s"])
    receiver.abort()
    unsafe_polls, required = 0, len(receiver.bootstrap_infos)
    while not mgr.is_abort_release_safe(req["room"], required):
        unsafe_polls += 1
        assert unsafe_polls < 3000, "no drain ack within 30 s"
        time.sleep(0.01)
    safe_at = time.monotonic()
    landed = all(torch.equal(latent[0][page], _pattern(logical, 0, 0, KV_PAGE_BYTES))
                 for logical, page in zip(req["pages"], dst) if logical % req["cp_size"] == req["slow_rank"])  # fmt: skip
    mgr.clear_deferred_abort_state(req["room"])
    receiver.clear()
    return {"status": "Aborted", "safe_at": safe_at, "landed_when_safe": landed, "unsafe_polls": unsafe_polls}


# ---- the harness --------------------------------------------------------------------------------------
def _attn_cp_group(rank, world_size, cp_size):
    """SGLang's attention-CP `GroupCoordinator` over the prefill ranks 0..N-1 (gloo): the shard
    group of their pools. Creating a group is collective, so every process builds it; a decode
    gets a group of its own. The pool's PyNccl history gather becomes a gloo all-gather
    (`GlooAllGather`, the CPU stand-in), installed before any pool is built."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.mem_cache import page_interleave_pool

    from helpers.sglang_cpu_stand_ins import GlooAllGather

    page_interleave_pool.PyNcclCommunicator = GlooAllGather
    ranks = [list(range(cp_size))] + [[r] for r in range(cp_size, world_size)]
    off = dict(use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
               use_hpu_communicator=False, use_xpu_communicator=False)  # fmt: skip
    group = GroupCoordinator(ranks, local_rank=rank, torch_distributed_backend="gloo", group_name="attn_cp", **off)
    assert group.world_size == (cp_size if rank < cp_size else 1), (rank, group.ranks)
    return group


def _role(rank, world_size, group, cp_size, decodes, prefill_requests, faults, bootstrap_port, draft, kv) -> list:
    """One process of a PD run (`run_ranks`): ranks 0..N-1 are the prefill CP ranks, the others
    the decodes, in `decodes` order. Each serves until every role is done (the barrier: a prefill
    rank's bootstrap server and transfer threads must outlive the decodes' last poll)."""
    shard_group = _attn_cp_group(rank, world_size, cp_size)
    if rank < cp_size:
        out = _prefill_rank(rank, cp_size, shard_group, bootstrap_port, prefill_requests, faults, draft, kv)
    else:
        name, (plugin, requests) = list(decodes.items())[rank - cp_size]
        out = _decode(name, plugin, bootstrap_port, requests, draft, kv)
    torch.distributed.barrier(group)
    return out


def _run(cp_size, decodes, prefill_requests, faults, timeout_s=240, draft=False, kv="bfloat16"):
    """Start N prefill ranks and the decodes; return their reports. decodes: {name: (plugin, requests)};
    draft: every side also registers an MTP draft pool (EAGLE); kv: --kv-cache-dtype."""
    args = (cp_size, decodes, prefill_requests, faults, free_port(), draft, kv)
    reports = {"ready": {}, "room": {}}
    for messages in run_ranks(_role, cp_size + len(decodes), args=args, timeout_s=timeout_s):
        for kind, who, *rest in messages:
            if kind == "ready":
                reports["ready"][who] = rest[0]
            elif kind == "room":
                reports["room"][(who, rest[0])] = rest[1]
    return reports


def _request(room, pages, dst, chunks=None, **extra):
    return dict(room=room, pages=list(pages), dst=list(dst), aux=room % 16, chunks=chunks or [len(pages)], **extra)


def _allocator_pages(cp_size, num_pages):
    """Logical pages of requests of `num_pages` pages each, taken in turn from SGLang's
    owner-rotating allocator over the prefill group's pages (`PageInterleavePoolAllocator`, what a
    server builds under KV sharding; `RotatedPagedRequests` drives it)."""
    from helpers.paged_requests import RotatedPagedRequests

    table = torch.zeros((len(num_pages), max(num_pages) * PAGE), dtype=torch.int32)
    requests = RotatedPagedRequests(table, PREFILL_PAGES // cp_size - 1, PAGE, cp_size)
    out = []
    for i, n in enumerate(num_pages):
        _, _, loc = requests.extend([(i, n * PAGE)])
        out.append((loc[::PAGE] // PAGE).tolist())
    return out


def _owned(pages, rank, cp_size):
    return [k for k, p in enumerate(pages) if p % cp_size == rank]


def _check_committed(reports, decode, req, cp_size, info, runs=None):
    got = reports["room"][(decode, req["room"])]
    assert got["status"] == "Success", f"room {req['room']}: {got}"
    assert got["wrong"] == [] and got["stray"] == [], f"room {req['room']}: {got}"
    for rank in range(cp_size):
        sent = reports["room"][(rank, req["room"])]
        assert sent["status"] == "Success", f"rank {rank}, room {req['room']}: {sent}"
        owned = len(_owned(req["pages"], rank, cp_size))
        page_bytes = owned * (sum(info["kv_item_lens"]) + sum(info["state_item_lens"][0]))
        assert sent["stats"]["pages"][0] == page_bytes, (
            f"rank {rank}, room {req['room']}: {sent['stats']} vs {owned} pages"
        )
        assert sent["stats"]["aux"][0] == info["aux_bytes"]
        if runs is not None:  # batch entries: runs x (kv + index) x layers
            assert sent["stats"]["pages"][1] == runs[rank] * 2 * LAYERS, f"rank {rank}: {sent['stats']}"


def _check_failed(reports, decode, room, *needles):
    got = reports["room"][(decode, room)]
    assert got["status"] == "Failed", f"room {room} committed: {got}"
    for needle in needles:
        assert needle in (got["reason"] or ""), f"room {room}: {needle!r} not in {got['reason']!r}"


def test_four_ranks_send_owned_pages_and_faults_fail_cleanly():
    """N = 4, a decode with the plugin: pages land at their positions; a request whose pages come
    from SGLang's owner-rotating allocator, its decode pages grouped by owner, is one run per rank;
    a silent rank, a dropped page (self-check) and a dropped page with the self-check bypassed
    (decode manifest check) each fail their request with the reason; the request after each
    commits."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import owner_grouped_pages

    n = 4
    rng = np.random.default_rng(4)
    dst = iter(range(1, DECODE_PAGES))
    reqs = []

    def add(pages, grouped_dst=False, **kw):
        pages_dst = [next(dst) for _ in pages]
        if grouped_dst:  # dealt out grouped by owner, as the plugin's decode hook allocates them
            pages_dst = owner_grouped_pages(pages_dst, n).tolist()
        reqs.append(_request(100 + len(reqs), pages, pages_dst, **kw))
        return reqs[-1]

    mixed = add(rng.choice(np.arange(n, PREFILL_PAGES), 11, replace=False).tolist(), chunks=[4, 4, 3])
    # SGLang's allocator: the k-th page on rank (b + k) % N, each rank's local pages consecutive;
    # with owner-grouped decode pages every rank's positions are one run (b = 1 here)
    rotated = _allocator_pages(n, [5, 12])[1]
    assert rotated[0] % n == 1, rotated
    grouped = add(rotated, grouped_dst=True)
    silent = add(rng.choice(np.arange(n, PREFILL_PAGES), 8, replace=False).tolist(), silent=[2])
    after_silent = add(list(range(20, 29)), chunks=[5, 4])
    dropped = add(list(range(30, 39)))
    after_dropped = add(list(range(5, 12)))
    bypassed = add(list(range(4, 12)), chunks=[4, 4])
    last = add(rng.choice(np.arange(n, PREFILL_PAGES), 6, replace=False).tolist())
    faults = {("drop", 1): {dropped["room"]}, ("drop", 3): {bypassed["room"]}, ("bypass", 3): {bypassed["room"]}}

    reports = _run(n, {"plugin": (True, reqs)}, reqs, faults)
    info = reports["ready"][0]
    assert reports["ready"]["plugin"] == {"target_cp_ranks": [0, 1, 2, 3], "required": 4}
    _check_committed(reports, "plugin", mixed, n, info)
    _check_committed(reports, "plugin", grouped, n, info, runs=[1, 1, 1, 1])
    _check_failed(reports, "plugin", silent["room"], "timed out after 6", "no transfer status from prefill rank(s) [2]")
    _check_committed(reports, "plugin", after_silent, n, info)
    lost = _owned(dropped["pages"], 1, n)[0]
    _check_failed(reports, "plugin", dropped["room"], f"CP rank 1 of 4: owned KV pages not sent at positions [{lost}]")
    assert reports["room"][(1, dropped["room"])]["status"] == "Failed"
    _check_committed(reports, "plugin", after_dropped, n, info)
    lost = _owned(bypassed["pages"], 3, n)[0]
    _check_failed(reports, "plugin", bypassed["room"], f"KV pages: missing positions [{lost}]")
    assert reports["room"][(3, bypassed["room"])]["status"] == "Success"  # the rank itself did not notice
    _check_committed(reports, "plugin", last, n, info)


def test_two_ranks_serve_a_plugin_decode_and_a_stock_decode():
    """N = 2, one prefill group serving two decodes: one with the plugin, one stock SGLang 0.5.23.
    The stock decode pulls from both CP ranks (the advertised sharding) and commits correct pages;
    a dropped page fails its request with the rank's reason (the status message's reason frame),
    a silent rank with SGLang's timeout; the next request commits."""
    n = 2
    p_dst, s_dst = iter(range(1, DECODE_PAGES)), iter(range(1, DECODE_PAGES))
    p_reqs = [
        _request(200, [7], [next(p_dst)]),  # one page: rank 0 owns none, sends an empty manifest
        _request(201, list(range(10, 22)), [next(p_dst) for _ in range(12)], chunks=[6, 6]),
        _request(202, list(range(30, 36)), [next(p_dst) for _ in range(6)], abort_after_s=1.0, cp_size=2, slow_rank=1),
    ]
    s_reqs = [
        _request(300, [3, 9, 4, 17, 30, 11, 2], [next(s_dst) for _ in range(7)], chunks=[3, 4]),
        _request(301, list(range(24, 32)), [next(s_dst) for _ in range(8)], chunks=[8]),
        _request(302, list(range(40, 46)), [next(s_dst) for _ in range(6)], silent=[1]),
        _request(303, [5, 6, 7, 8, 9], [next(s_dst) for _ in range(5)]),
    ]
    faults = {("drop", 1): {301}, ("slow", 1): {202: 2.5}}
    reports = _run(n, {"plugin": (True, p_reqs), "stock": (False, s_reqs)}, p_reqs + s_reqs, faults)
    info = reports["ready"][0]
    # Finding: a slow rank's write landed after its room was given up and its pages reused. Here
    # the decode gives up after 1 s, rank 1 writes at 2.5 s: release becomes safe only after that.
    late, aborted = reports["room"][(1, 202)], reports["room"][("plugin", 202)]
    assert late["write_end"] is not None and aborted["unsafe_polls"] > 50, (late, aborted)
    assert aborted["safe_at"] >= late["write_end"] and aborted["landed_when_safe"], (late, aborted)
    for name in ("plugin", "stock"):
        assert reports["ready"][name] == {"target_cp_ranks": [0, 1], "required": 2}
    _check_committed(reports, "plugin", p_reqs[0], n, info)
    _check_committed(reports, "plugin", p_reqs[1], n, info)
    _check_committed(reports, "stock", s_reqs[0], n, info)
    _check_failed(reports, "stock", 301, "CP rank 1 of 2: owned KV pages not sent at positions [1]")
    _check_failed(reports, "stock", 302, "timed out")
    _check_committed(reports, "stock", s_reqs[3], n, info)


# ---- the bookkeeping and the hooks' pass-through, in process ---------------------------------------------
def test_mtp_draft_pages_ride_the_owned_page_transfer():
    """EAGLE (docs/speculative.md): the MTP layer's sharded pool (the target's size, spec and
    shard group, as SGLang's `_build_mtp_kv_shard_pool` builds it) registered as SGLang's draft KV
    pool on the prefill ranks, a stock `DSATokenToKVPool` draft pool on each decode. N = 2,
    a plugin decode and a stock decode: the draft's latent and index-K pages land at the decode's
    draft pages of their positions next to the target's, each rank sending the draft pages it owns
    (bytes = owned pages x (target + draft) page bytes); a page a rank drops fails the request with
    the rank's reason (the draft's entries share the target's page list: a lost position is lost for
    both, and the same all-or-nothing commit covers them); the next request commits."""
    n = 2
    p_dst, s_dst = iter(range(1, DECODE_PAGES)), iter(range(1, DECODE_PAGES))
    p_reqs = [
        _request(400, list(range(10, 21)), [next(p_dst) for _ in range(11)], chunks=[6, 5]),
        _request(401, [3, 8, 13, 22, 31], [next(p_dst) for _ in range(5)]),
    ]
    s_reqs = [
        _request(500, [30, 5, 17, 2, 44, 9], [next(s_dst) for _ in range(6)], chunks=[2, 4]),
        _request(501, list(range(24, 31)), [next(s_dst) for _ in range(7)]),
        _request(502, [40, 41, 42], [next(s_dst) for _ in range(3)]),
    ]
    faults = {("drop", 0): {501}}
    reports = _run(n, {"plugin": (True, p_reqs), "stock": (False, s_reqs)}, p_reqs + s_reqs, faults, draft=True)
    info = reports["ready"][0]
    # SGLang appends the draft's buffers after the target's: one more latent and one more index-K entry
    assert info["kv_item_lens"] == [KV_PAGE_BYTES] * (LAYERS + 1), info
    assert info["state_item_lens"][0] == [INDEX_PAGE_BYTES] * (LAYERS + 1), info
    for req in p_reqs:
        _check_committed(reports, "plugin", req, n, info)
    _check_committed(reports, "stock", s_reqs[0], n, info)
    lost = _owned(s_reqs[1]["pages"], 0, n)[0]
    _check_failed(reports, "stock", 501, f"CP rank 0 of 2: owned KV pages not sent at positions [{lost}]")
    _check_committed(reports, "stock", s_reqs[2], n, info)


def test_fp8_pages_reach_the_decode_byte_equal_to_a_replicated_prefill():
    """--kv-cache-dtype fp8_e4m3, N = 2, a plugin decode and a stock one: each prefill rank's shard
    holds the 656-byte FlashMLA rows its pool quantized on write (SGLang's quantizer, owned rows
    only); the decode pages of every position are byte-equal to what SGLang's own fp8 pool of a
    replicated prefill holds for the same latent, and each rank sends only its owned fp8 pages."""
    n = 2
    pages = [3, 9, 4, 13, 6, 2, 11]  # logical pages >= N: 0..N-1 are SGLang's padding pages
    p_req = _request(400, pages, list(range(1, 8)), chunks=[3, 4])
    s_req = _request(500, pages[::-1], list(range(20, 27)))
    reports = _run(n, {"plugin": (True, [p_req]), "stock": (False, [s_req])}, [p_req, s_req], {}, kv="fp8_e4m3")
    info = reports["ready"][0]
    assert info["kv_item_lens"] == [KV_FORMATS["fp8_e4m3"][2]] * LAYERS, info
    _check_committed(reports, "plugin", p_req, n, info)
    _check_committed(reports, "stock", s_req, n, info)


def _ledger_with(queued, index=True):
    """N = 2, pages [10..15] sent in chunks of 4 and 2; rank 0 queues `queued` (position -> local)."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import OwnedPageLedger

    ledger = OwnedPageLedger(0, 2)
    ledger.expect_kv(7, 0, [10, 11, 12, 13], total=6)
    ledger.expect_kv(7, 4, [14, 15], total=6)
    for position, local in queued:
        ledger.queue_kv(7, [position], [local])
    ledger.expect_index(7)
    if index:
        ledger.record_index(7, 6, [0, 2, 4], [10, 12, 14])
    return ledger


def test_rank_self_check_names_what_it_did_not_send():
    from sglang_nsa_cp.disagg import PageClaims
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RankClaims

    manifest, problem = _ledger_with([(0, 5), (2, 6), (4, 7)]).finish(7)
    assert problem is None
    sent = PageClaims(rank=0, cp_size=2, num_pages=6, positions=(0, 2, 4), logical_pages=(10, 12, 14))
    assert manifest == RankClaims(kv=sent, index=sent), manifest
    cases = {
        "owned KV pages not sent at positions [4]": [(0, 5), (2, 6)],
        "KV pages sent at positions it does not own [1]": [(0, 5), (1, 5), (2, 6), (4, 7)],
        "KV pages sent twice at positions [2]": [(0, 5), (2, 6), (2, 6), (4, 7)],
        "KV pages sent from the wrong local page at positions [4]": [(0, 5), (2, 6), (4, 8)],
    }
    for expected, queued in cases.items():
        _, problem = _ledger_with(queued).finish(7)
        assert problem is not None and expected in problem and "CP rank 0 of 2" in problem, (expected, problem)
    _, problem = _ledger_with([(0, 5), (2, 6), (4, 7)], index=False).finish(7)
    assert "its index-K pages were not sent" in problem
    ledger = _ledger_with([(0, 5), (2, 6), (4, 7)])
    ledger.expect_kv(7, 8, [16], total=6)  # a chunk past the request's pages
    assert "its chunks [(0, 4), (4, 2), (8, 1)] do not cover the request's 6 pages" in ledger.finish(7)[1]
    ledger = _ledger_with([(0, 5)])
    ledger.drop(7)
    assert "no record" in ledger.finish(7)[1]


def _manifest(rank, positions, pages, total=4, cp=2, index=True):
    """One CP rank's claims, as its ledger concludes them (the same pages for KV and index-K)."""
    from sglang_nsa_cp.disagg import PageClaims
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RankClaims

    kv = PageClaims(rank, cp, total, tuple(positions), tuple(pages))
    return RankClaims(kv=kv, index=kv if index else None)


SECRET = b"plugin-test-secret-0123456789abc"


def test_decode_commit_rule_over_the_manifests():
    """Checked against what the decode asked for (4 KV and 4 index-K pages from 2 CP ranks),
    never against what a prefill claims."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import (
        RoomExpectation,
        decode_manifest,
        encode_manifest,
        verify_manifests,
    )

    asked = RoomExpectation(kv_pages=4, index_pages=4, cp_size=2)
    good = {0: _manifest(0, [0, 2], [10, 12]), 1: _manifest(1, [1, 3], [11, 13])}
    for secret in (None, SECRET):
        wire = {r: decode_manifest(encode_manifest(m, 9, r, secret), room=9, prefill_rank=r, secret=secret, max_pages=4)
                for r, m in good.items()}  # fmt: skip
        assert verify_manifests(9, wire, [0, 1], asked) is None
    cases = [
        ({0: good[0], 1: _manifest(1, [1], [11])}, [0, 1], "KV pages: missing positions [3]"),
        ({0: good[0], 1: _manifest(1, [1, 2, 3], [11, 13, 13])}, [0, 1], "duplicated positions [2 (ranks [0, 1])]"),
        ({0: good[0], 1: _manifest(1, [1, 3], [11, 14])}, [0, 1], "positions from the wrong owner [3]"),
        ({0: good[0]}, [0, 1], "prefill rank(s) [1] reported success without an owned-page manifest"),
        ({0: good[0]}, [0], "no manifest from CP rank(s) [1] of 2"),
        ({0: good[0], 1: "manifest is not JSON"}, [0, 1], "malformed manifest from prefill rank 1"),
        ({0: good[0], 1: _manifest(1, [1, 3], [11, 13], index=False)}, [0, 1], "index-K pages reported by CP ranks [0] only"),
        ({0: good[0], 1: _manifest(1, [1, 3], [11, 13], total=5)}, [0, 1], "KV page counts {1: 5} (by CP rank) differ from the 4 the decode asked for"),
        ({0: good[0], 2: _manifest(1, [1, 3], [11, 13])}, [0, 2], "prefill rank 2 sent a manifest for CP rank 1"),
        # Both ranks claim a smaller request, consistently: the decode's own count catches it.
        ({0: _manifest(0, [0], [10], total=2), 1: _manifest(1, [1], [11], total=2)}, [0, 1], "differ from the 4"),
        ({0: good[0], 1: _manifest(1, [1, 3], [11, 13], cp=20_000_000)}, [0, 1], "claims a CP group of 20000000; the decode targets 2"),
    ]  # fmt: skip
    for manifests, responders, needle in cases:
        start = time.monotonic()
        reason = verify_manifests(9, manifests, responders, asked)
        assert reason is not None and needle in reason, (needle, reason)
        assert time.monotonic() - start < 0.1, (needle, "slow")
    no_index = RoomExpectation(kv_pages=4, index_pages=None, cp_size=2)
    assert "the decode asked for none" in verify_manifests(9, good, [0, 1], no_index)


def _hostile_manifest_frames():
    """Frames a decode must turn into a reason, never an exception (issue 17's findings first)."""
    import msgspec

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import MANIFEST_TAG, RankClaims, encode_manifest

    good = encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, SECRET)
    unkeyed = MANIFEST_TAG + b"\x00"
    return {
        "nested": unkeyed + b"\x91" * 5000 + b"\x00",
        "oversized": unkeyed + b"\x00" * 10_000_000,
        "5000-digit int": MANIFEST_TAG + b"\x00" + b'{"rank": ' + b"9" * 5000 + b"}",
        "type is a list": unkeyed + msgspec.msgpack.encode({"room": 9, "kv": {"rank": [1], "cp_size": 2}}),
        "2e7 CP ranks": unkeyed
        + msgspec.msgpack.encode(
            {
                "room": 9,
                "kv": {"rank": 1, "cp_size": 20_000_000, "num_pages": 20_000_000, "positions": [], "logical_pages": []},
            }
        ),  # fmt: skip
        "positions and pages differ": unkeyed
        + msgspec.msgpack.encode(
            {"room": 9, "kv": {"rank": 1, "cp_size": 2, "num_pages": 4, "positions": [1, 3], "logical_pages": [11]}}
        ),
        "index-K of another rank": encode_manifest(
            RankClaims(kv=_manifest(1, [1, 3], [11, 13]).kv, index=_manifest(0, [0, 2], [10, 12]).kv), 9, 1, SECRET
        ),
        "not signed": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, None),
        "signed with another key": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, b"x" * 32),
        "replayed from another room": encode_manifest(_manifest(1, [1, 3], [11, 13]), 8, 1, SECRET),
        "replayed from another rank": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 0, SECRET),
        "MAC cut short": MANIFEST_TAG + bytes([7]) + good[len(MANIFEST_TAG) + 1 :],
        "empty": MANIFEST_TAG,
    }


def test_hostile_manifest_frames_never_raise_in_the_decode_thread():
    """Finding: a nested or oversized manifest frame raised out of the manifest reader in SGLang's
    decode thread; a manifest claiming 2e7 CP ranks or pages kept it busy for seconds. Now each
    becomes the room's failure reason, within milliseconds."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import decode_manifest

    for name, frame in _hostile_manifest_frames().items():
        start = time.monotonic()
        with pytest.raises(ValueError) as err:
            decode_manifest(frame, room=9, prefill_rank=1, secret=SECRET, max_pages=4)
        assert time.monotonic() - start < 0.1 and len(str(err.value)) <= 300, (name, str(err.value)[:200])


def test_without_the_flag_the_prefill_manager_is_sglangs(monkeypatch):
    """SGLang builds the plugin's Mooncake classes (`get_kv_class`); without the flag a prefill
    manager keeps no ledger and concludes as SGLang concludes; a decode manager is built with its
    status-frame limit in force and the PD secret (none here)."""
    _load_plugin()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    import sglang_nsa_cp.sglang_ext.disaggregation.common.conn as frames
    import sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn as conn
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import max_manifest_bytes

    assert [get_kv_class(TransferBackend.MOONCAKE, t) for t in (KVClassType.MANAGER, KVClassType.SENDER,
            KVClassType.RECEIVER)] == [conn.OwnedPageKVManager, conn.OwnedPageKVSender, conn.OwnedPageKVReceiver]  # fmt: skip
    calls = []
    monkeypatch.setattr(
        MooncakeKVManager, "__init__", lambda self, *a: calls.append(getattr(frames._STATUS_FRAME_LIMIT, "bytes", None))
    )
    monkeypatch.setattr(MooncakeKVManager, "conclude_transfer", lambda self, **k: calls.append(k))
    monkeypatch.setattr(conn, "is_enabled", lambda: False)
    monkeypatch.delenv("SGLANG_NSA_CP_PD_SECRET", raising=False)
    kv_args = SimpleNamespace(kv_data_lens=[64 * 1024], kv_item_lens=[1024])
    mgr = conn.OwnedPageKVManager(kv_args, DisaggregationMode.PREFILL, "server_args")
    assert mgr.owned_pages_ledger is None and "kv_status_msg_carries_reason" not in vars(mgr) and calls == [None]
    mgr.conclude_transfer(bootstrap_room=7, status=KVPoll.Success)
    assert calls[-1] == {"bootstrap_room": 7, "status": KVPoll.Success} and not mgr.outgoing_manifests
    decode = conn.OwnedPageKVManager(kv_args, DisaggregationMode.DECODE, "server_args")
    assert decode.pd_secret is None and calls[-1] == (1 << 20) + max_manifest_bytes(64)
    assert getattr(frames._STATUS_FRAME_LIMIT, "bytes", None) is None


def test_status_socket_refuses_frames_past_its_limit():
    """The decode's status socket, made by SGLang's own `get_zmq_socket_on_host` while the hook's
    limit is set: a frame past the limit closes its connection unread; the limit is gone after."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket_on_host

    import sglang_nsa_cp.sglang_ext.disaggregation.common.conn as hooks

    ctx = zmq.Context()
    with hooks.limited_status_frames(4096):
        port, pull = hooks.limit_status_frames(get_zmq_socket_on_host, ctx, zmq.PULL, host="127.0.0.1")
    _, unlimited = hooks.limit_status_frames(get_zmq_socket_on_host, ctx, zmq.PULL, host="127.0.0.1")
    assert pull.getsockopt(zmq.MAXMSGSIZE) == 4096 and unlimited.getsockopt(zmq.MAXMSGSIZE) == -1
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send(b"x" * 5000)
    assert not pull.poll(500), "an oversized frame was delivered"
    small = ctx.socket(zmq.PUSH)
    small.connect(f"tcp://127.0.0.1:{port}")
    small.send(b"status")
    assert pull.poll(2000) and pull.recv() == b"status"
    for sock in (push, small, pull, unlimited):
        sock.close(linger=0)
    ctx.term()


def _decode_manager(secret):
    """A decode manager of the plugin with only the state `parse_kv_status_message` and
    `apply_prefill_status` use (SGLang's and the plugin's)."""
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import OwnedPageKVManager
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog

    mgr = object.__new__(OwnedPageKVManager)
    mgr.__dict__.update(
        request_status={}, prefill_response_tracker={}, required_prefill_response_num_table={}, failure_records={},
        failure_lock=threading.Lock(), enable_staging=False, _staging_handler=None, defer_decode_allocation=False,
        deferred_bootstrap=None, _deferred_ack_targets={}, _deferred_ack_poisoned_rooms=set(), _staging_outstanding={},
        owned_pages_ledger=None, outgoing_manifests={}, manifest_inbox={}, room_manifests={}, room_expectations={},
        pd_secret=secret, destination_nonces={}, room_nonces={}, room_aux_indices={}, dropped_messages=DropLog(),
    )  # fmt: skip
    return mgr


def _deliver(mgr, room, rank, frame):
    """One status message, as SGLang's decode thread handles it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    msg = [str(room).encode(), str(KVPoll.Success).encode(), str(rank).encode(), b""] + ([frame] if frame else [])
    parsed = mgr.parse_kv_status_message(msg)
    mgr.apply_prefill_status(bootstrap_room=parsed[0], status=parsed[1], prefill_rank=parsed[2],
                             failure_reason=parsed[3])  # fmt: skip


def _expect(mgr, room, kv_pages=4):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RoomExpectation

    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.prefill_response_tracker[room] = set()
    mgr.required_prefill_response_num_table[room] = 2
    mgr.room_expectations[room] = RoomExpectation(kv_pages, kv_pages, 2)


def test_decode_manager_commits_only_full_coverage():
    """The decode manager's `parse_kv_status_message` and `apply_prefill_status` (SGLang's, with
    the plugin's checks), fed status messages as the decode thread receives them."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    mgr = _decode_manager(secret=None)
    good = {0: _manifest(0, [0, 2], [10, 12]), 1: _manifest(1, [1, 3], [11, 13])}
    for room, sends in {1: good, 2: {0: good[0], 1: _manifest(1, [1], [11])}, 3: {0: None, 1: None},
                        4: {0: good[0], 1: None}}.items():  # fmt: skip
        _expect(mgr, room)
        for rank, manifest in sends.items():
            _deliver(mgr, room, rank, manifest and encode_manifest(manifest, room, rank, None))
    assert mgr.request_status[1] == KVPoll.Success and 1 not in mgr.failure_records
    assert mgr.request_status[2] == KVPoll.Failed and "KV pages: missing positions [3]" in mgr.failure_records[2]
    assert mgr.request_status[3] == KVPoll.Success  # no manifests, no secret: a stock prefill, SGLang's rule
    assert mgr.request_status[4] == KVPoll.Failed and "[1] reported success without" in mgr.failure_records[4]
    _deliver(mgr, 1, 1, encode_manifest(_manifest(1, [1], [11]), 1, 1, None))  # a late repeat cannot undo a commit
    assert mgr.request_status[1] == KVPoll.Success
    assert not mgr.room_manifests and not mgr.manifest_inbox


def test_decode_thread_survives_hostile_manifest_frames_keyed_or_not():
    """Findings: anyone who reaches the decode could forge a commit; a hostile frame raised in the
    decode thread. With the secret, a Success whose manifest is missing or not keyed to its room
    and rank is dropped as if it never came: a forged one neither commits nor fails the room, the
    real one still commits it. Without the secret, a hostile frame fails its room with a bounded
    reason. Either way the next room commits and nothing raises."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    good = {0: _manifest(0, [0, 2], [10, 12]), 1: _manifest(1, [1, 3], [11, 13])}
    for secret in (SECRET, None):
        mgr = _decode_manager(secret=secret)
        hostile = dict(_hostile_manifest_frames(), **{"no manifest frame": None})
        for i, (name, frame) in enumerate(hostile.items()):
            room = 10 + i
            _expect(mgr, room)
            _deliver(mgr, room, 0, encode_manifest(good[0], room, 0, secret))
            start = time.monotonic()
            _deliver(mgr, room, 1, frame)  # forged, as rank 1
            assert time.monotonic() - start < 0.2, name
            if secret is None and frame is None:
                assert (
                    mgr.request_status[room] == KVPoll.Failed
                    and "without an owned-page manifest" in mgr.failure_records[room]
                )
                continue
            if secret is None:  # every one of them is malformed for room 10 + i (they name room 9)
                assert mgr.request_status[room] == KVPoll.Failed, name
                assert "malformed manifest from prefill rank 1" in mgr.failure_records[room], (
                    name,
                    mgr.failure_records[room],
                )
                continue
            assert mgr.request_status[room] == KVPoll.WaitingForInput, (name, mgr.failure_records.get(room))
            _deliver(mgr, room, 1, encode_manifest(good[1], room, 1, secret))  # the real rank 1
            assert mgr.request_status[room] == KVPoll.Success, (name, mgr.failure_records.get(room))
        _expect(mgr, 99)
        for rank, m in good.items():
            _deliver(mgr, 99, rank, encode_manifest(m, 99, rank, secret))
        assert mgr.request_status[99] == KVPoll.Success


def test_a_replayed_manifest_of_an_earlier_use_does_not_commit_a_reused_room():
    """Finding: with the secret, the captured manifests of an earlier use of room 4 committed a
    new use of room 4 with nothing transferred (SGLang reuses room ids). Each use now has its
    decode's nonce (sent with its request metadata) inside the manifests' MAC: an earlier use's
    manifests are dropped as if never sent, with or without the secret; this use's commit."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    good = {0: _manifest(0, [0, 2], [10, 12]), 1: _manifest(1, [1, 3], [11, 13])}
    earlier, now, other_decode = b"e" * 16, b"n" * 16, b"o" * 16
    for secret in (SECRET, None):
        mgr = _decode_manager(secret=secret)
        _expect(mgr, 4)
        mgr.room_nonces[4] = now
        for rank, m in good.items():  # replayed: the manifests of the earlier use
            _deliver(mgr, 4, rank, encode_manifest(m, 4, rank, secret, uses=[earlier]))
        assert mgr.request_status[4] == KVPoll.WaitingForInput and 4 not in mgr.failure_records, secret
        for rank, m in good.items():  # this use's transfer (a room may have several destinations)
            _deliver(mgr, 4, rank, encode_manifest(m, 4, rank, secret, uses=[other_decode, now]))
        assert mgr.request_status[4] == KVPoll.Success, (secret, mgr.failure_records.get(4))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
