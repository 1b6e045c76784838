"""The owned-page PD harness: SGLang 0.5.23's real Mooncake manager, sender and receiver (built by
SGLang's own `_init_kv_manager` calls, through the plugin's `get_kv_class`) in spawned processes,
prefill CP ranks and decodes over Mooncake's TCP transport on 127.0.0.1, pools filled with a byte
pattern of (page, layer, kind) instead of a model forward. `run` drives one scenario and returns
each role's reports; test_sglang_ext_pd.py's docstring describes what it checks."""

from __future__ import annotations

import os
import threading
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch

from helpers.distributed import free_port, run_ranks

PAGE = 64
SECRET = b"plugin-test-secret-0123456789abc"  # every process of a run has it: manifests are keyed
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


def env(waiting_timeout=None):
    os.environ.update(
        TRITON_INTERPRET="1", MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1", OMP_NUM_THREADS="1",
        SGLANG_DISAGGREGATION_THREAD_POOL_SIZE="2", SGLANG_DISAGGREGATION_QUEUE_SIZE="1",
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="60", SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="5",
    )  # fmt: skip
    os.environ["SGLANG_NSA_CP_PD_SECRET"] = SECRET.decode()  # keyed manifests; a stock decode ignores them
    if waiting_timeout is not None:
        os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(waiting_timeout)
    torch.set_num_threads(1)


def pattern(logical: int, layer: int, kind: int, nbytes: int) -> torch.Tensor:
    """The bytes of one page of one layer: kind 0 = MLA latent, 1 = index K/scale. The MTP draft's
    one layer is layer LAYERS."""
    base = (logical * 131 + layer * 17 + kind * 7) % 251
    return ((torch.arange(nbytes, dtype=torch.int64) * (2 * kind + 3) + base) % 251).to(torch.uint8)


def pool_kwargs(size, kv="bfloat16", layers=LAYERS):
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


def publish(mode, cp_size, cp_rank, bootstrap_port, shard_group=None, opted_in=False):
    """Publish the process's ServerArgs and ranks. shard_group: a shared-KV prefill CP rank's
    attention-CP group; then the plugin's flag and SGLang's `--enable-kv-cache-sharding` are on,
    as the plugin's start-up validation leaves them (`opted_in`: a decode's decision, the flag on
    the decode) (`CommonKVManager.__init__` reads the shard
    rank and size off that group, Mooncake's DSA state send filters by them)."""
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR

    shared_kv = shard_group is not None
    server_args = ServerArgs(
        model_path="dummy", device="cpu", host="127.0.0.1", port=free_port(), page_size=PAGE,
        disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port, tp_size=cp_size, attn_cp_size=cp_size,
        enable_prefill_cp=cp_size > 1, enable_kv_cache_sharding=shared_kv,
    )  # fmt: skip
    if shared_kv:
        setattr(server_args, ATTR, True)  # what the plugin's start-up validation writes
    if opted_in:
        setattr(server_args, DECODE_ATTR, True)
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


def load_plugin():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # entry-point discovery, register(), HookRegistry.apply_hooks()
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert "sglang.srt.disaggregation.utils.get_kv_class" in HookRegistry._patched


def scheduler_stub(server_args, kv="bfloat16", **extra):
    model_runner = SimpleNamespace(kv_cache_dtype_str=kv)
    return SimpleNamespace(
        rust_server=None, tp_worker=SimpleNamespace(model_runner=model_runner), enable_hisparse=False,
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(), num_hidden_layers=LAYERS),
        server_args=server_args, **extra,
    )  # fmt: skip


def metadata_buffers():
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(16, 16, torch.float32, 1, max_top_logprobs_num=1)


def wait(poll, done, deadline_s, what, interval_s=0.02):
    deadline = time.monotonic() + deadline_s
    while True:
        state = poll()
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still {state!r} after {deadline_s} s")
        time.sleep(interval_s)


def status_name(status):
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


def _fill_shard(pool, rank, cp_size, kv="bfloat16", latent_pages=(), first_layer=0, prefill_pages=PREFILL_PAGES):
    """bf16: byte patterns of (page, layer, kind) in every owned page. fp8: the index pages the
    same, the latent of `latent_pages` written by the pool from `_latent` (quantized on write).
    SGLang's sharded pool holds the rank's local pages: logical page p (p % N == rank, p >= N) at
    local page p // N; local page 0 is the padding pages'. first_layer: the pattern's layer of the
    pool's layer 0 (an MTP draft pool's one layer is LAYERS)."""
    page_bytes = KV_FORMATS[kv][2]
    local_pages = pool.size // PAGE + 1  # SGLang's pool: size + one page
    assert cp_size * local_pages == prefill_pages, (cp_size, local_pages)
    for layer in range(pool.layer_num):
        latent = pool.kv_buffer[layer].view(torch.uint8).view(local_pages, -1)
        index = pool.index_k_with_scale_buffer[layer]
        assert latent.shape[1] == page_bytes and index.shape == (local_pages, INDEX_PAGE_BYTES), index.shape
        for logical in range(cp_size + rank, prefill_pages, cp_size):
            if kv == "bfloat16":
                latent[logical // cp_size] = pattern(logical, first_layer + layer, 0, page_bytes)
            index[logical // cp_size] = pattern(logical, first_layer + layer, 1, INDEX_PAGE_BYTES)
    if kv != "bfloat16":
        _write_latent(pool, latent_pages)


def _sharded_pools(rank, cp_size, shard_group, kv, draft, prefill_pages=PREFILL_PAGES):
    """The rank's SGLang page-interleaved DSA pool (the plugin's subclass: the plugin is loaded),
    as SGLang's KV configurator builds it under KV sharding: `size` is per rank, the spec the
    plugin's `make_page_shard_spec` gives, the attention-CP group as shard group. With a draft,
    the MTP layer's pool as `_build_mtp_kv_shard_pool` builds it: the target's size, spec and
    group, its own buffers."""
    from sglang.srt.mem_cache import page_interleave_pool
    from sglang.srt.runtime_context import get_parallel

    from helpers.sglang_model_harness import as_sglang_builds, shard_spec

    import sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool as plugin_pool

    pool_class = page_interleave_pool.PageInterleaveDSATokenToKVPool  # SGLang's: the plugin replaces no class
    spec = shard_spec(rank, cp_size, context_len=4 * PAGE, chunk_tokens=4 * PAGE, contexts=1)
    size = (prefill_pages // cp_size - 1) * PAGE
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        pool = as_sglang_builds(pool_class(**pool_kwargs(size, kv), shard_spec=spec, shard_group=shard_group))
        draft_pool = None
        if draft:
            draft_pool = as_sglang_builds(pool_class(
                **pool_kwargs(pool.size, kv, layers=1), shard_spec=pool.shard_spec, shard_group=pool.shard_group
            ))  # fmt: skip
    assert type(pool) is plugin_pool.PageInterleaveDSATokenToKVPool, "the plugin's pool hook did not take"
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


def prefill_rank(
    rank,
    cp_size,
    shard_group,
    bootstrap_port,
    requests,
    faults,
    draft=False,
    kv="bfloat16",
    prefill_pages=PREFILL_PAGES,
) -> list:
    results = []
    env()
    load_plugin()
    server_args = publish("prefill", cp_size, rank, bootstrap_port, shard_group)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    if rank == 0:  # in SGLang the prefill's HTTP server process runs it
        MooncakeKVBootstrapServer("127.0.0.1", bootstrap_port)
    wait(lambda: _port_open(bootstrap_port), bool, 90, "bootstrap server", interval_s=0.2)
    pool, draft_pool = _sharded_pools(rank, cp_size, shard_group, kv, draft, prefill_pages)
    _fill_shard(
        pool, rank, cp_size, kv, sorted({p for req in requests for p in req["pages"]}), prefill_pages=prefill_pages
    )
    if draft_pool is not None:
        _fill_shard(draft_pool, rank, cp_size, first_layer=LAYERS, prefill_pages=prefill_pages)
    traffic = _Traffic()
    traffic.install()
    _install_faults(rank, faults, traffic)
    queue_stub = SimpleNamespace(
        transfer_backend=TransferBackend.MOONCAKE, tp_rank=rank, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft_pool, is_mla_backend=True, metadata_buffers=metadata_buffers(),
        scheduler=scheduler_stub(server_args, kv),
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
        wait(sender.poll, lambda s: s in (KVPoll.WaitingForInput, KVPoll.Failed), 60, f"room {room} bootstrap")
        pages = np.asarray(req["pages"], dtype=np.int32)
        sender.init(len(pages), aux_index=req["aux"])
        start = 0
        for i, size in enumerate(req["chunks"]):
            last = i == len(req["chunks"]) - 1
            sender.send(pages[start : start + size], [pages.copy()] if last else None)
            start += size
        status = wait(sender.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), 60, f"room {room} transfer")
        with mgr.failure_lock:
            reason = mgr.failure_records.get(room)
        sender.clear()  # as the scheduler does once the room failed, a slowed write still going
        wait(lambda: room not in traffic.slowed, lambda done: done, 30, f"room {room} late write")
        with traffic.lock:
            stats = traffic.rooms.get(room, {"pages": [0, 0], "aux": [0, 0]})
        return {
            "status": status_name(status),
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
    env(waiting_timeout=WAITING_TIMEOUT_S)
    if plugin:
        load_plugin()
    server_args = publish("decode", 1, 0, bootstrap_port, opted_in=plugin)
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
        pool = DSATokenToKVPool(**pool_kwargs((DECODE_PAGES - 1) * PAGE, kv))
        draft_pool = DSATokenToKVPool(**pool_kwargs((DECODE_PAGES - 1) * PAGE, kv, layers=1)) if draft else None
        replicated = None
        if kv != "bfloat16":  # what a replicated prefill (SGLang's own pool, every row) holds
            replicated = DSATokenToKVPool(**pool_kwargs((PREFILL_PAGES - 1) * PAGE, kv))
            _write_latent(replicated, sorted({p for req in requests for p in req["pages"]}))

    def expected_latent(logical, layer):
        if replicated is None:
            return pattern(logical, layer, 0, page_bytes)
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
        draft_token_to_kv_pool=draft_pool, is_mla_backend=True, metadata_buffers=metadata_buffers(),
        enable_staging=False, scheduler=scheduler_stub(server_args, kv),
    )  # fmt: skip
    mgr = DecodePreallocQueue._init_kv_manager(queue_stub)
    addr = f"127.0.0.1:{bootstrap_port}"
    wait(lambda: mgr.try_ensure_parallel_info(addr), bool, 90, "prefill bootstrap", interval_s=0.5)
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
        status = wait(receiver.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), 60, f"room {room}")
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
                    if not torch.equal(index[layer][page], pattern(logical, layer, 1, INDEX_PAGE_BYTES)):
                        wrong.append(("index", k, layer))
        untouched = [p for p in range(DECODE_PAGES) if p not in used]
        stray = [p for p in untouched for t in (latent + index) if not bool((t[p] == SENTINEL).all())]
        # positions of this room whose decode page holds anything but the sentinel
        written = [
            k for k, page in enumerate(dst) if any(not bool((t[page] == SENTINEL).all()) for t in latent + index)
        ]
        results.append(
            (
                "room",
                name,
                room,
                {
                    "status": status_name(status),
                    "reason": reason,
                    "wrong": wrong,
                    "stray": stray,
                    "written": written,
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
    landed = all(torch.equal(latent[0][page], pattern(logical, 0, 0, KV_PAGE_BYTES))
                 for logical, page in zip(req["pages"], dst) if logical % req["cp_size"] == req["slow_rank"])  # fmt: skip
    mgr.clear_deferred_abort_state(req["room"])
    receiver.clear()
    return {"status": "Aborted", "safe_at": safe_at, "landed_when_safe": landed, "unsafe_polls": unsafe_polls}


# ---- the harness --------------------------------------------------------------------------------------
def attn_cp_group(rank, world_size, cp_size):
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
    shard_group = attn_cp_group(rank, world_size, cp_size)
    if rank < cp_size:
        out = prefill_rank(rank, cp_size, shard_group, bootstrap_port, prefill_requests, faults, draft, kv)
    else:
        name, (plugin, requests) = list(decodes.items())[rank - cp_size]
        out = _decode(name, plugin, bootstrap_port, requests, draft, kv)
    torch.distributed.barrier(group)
    return out


def run(cp_size, decodes, prefill_requests, faults, timeout_s=240, draft=False, kv="bfloat16"):
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


def request(room, pages, dst, chunks=None, **extra):
    return dict(room=room, pages=list(pages), dst=list(dst), aux=room % 16, chunks=chunks or [len(pages)], **extra)


def allocator_pages(cp_size, num_pages, prefill_pages=PREFILL_PAGES):
    """Logical pages of requests of `num_pages` pages each, taken in turn from SGLang's
    owner-rotating allocator over the prefill group's pages (`PageInterleavePoolAllocator`, what a
    server builds under KV sharding; `RotatedPagedRequests` drives it)."""
    from helpers.paged_requests import RotatedPagedRequests

    table = torch.zeros((len(num_pages), max(num_pages) * PAGE), dtype=torch.int32)
    requests = RotatedPagedRequests(table, prefill_pages // cp_size - 1, PAGE, cp_size)
    out = []
    for i, n in enumerate(num_pages):
        _, _, loc = requests.extend([(i, n * PAGE)])
        out.append((loc[::PAGE] // PAGE).tolist())
    return out


def owned(pages, rank, cp_size):
    return [k for k, p in enumerate(pages) if p % cp_size == rank]


def check_committed(reports, decode, req, cp_size, info, runs=None):
    got = reports["room"][(decode, req["room"])]
    assert got["status"] == "Success", f"room {req['room']}: {got}"
    assert got["wrong"] == [] and got["stray"] == [], f"room {req['room']}: {got}"
    for rank in range(cp_size):
        sent = reports["room"][(rank, req["room"])]
        assert sent["status"] == "Success", f"rank {rank}, room {req['room']}: {sent}"
        owned_pages = len(owned(req["pages"], rank, cp_size))
        page_bytes = owned_pages * (sum(info["kv_item_lens"]) + sum(info["state_item_lens"][0]))
        assert sent["stats"]["pages"][0] == page_bytes, (
            f"rank {rank}, room {req['room']}: {sent['stats']} vs {owned} pages"
        )
        assert sent["stats"]["aux"][0] == info["aux_bytes"]
        if runs is not None:  # batch entries: runs x (kv + index) x layers
            assert sent["stats"]["pages"][1] == runs[rank] * 2 * LAYERS, f"rank {rank}: {sent['stats']}"


def check_failed(reports, decode, room, *needles):
    got = reports["room"][(decode, room)]
    assert got["status"] == "Failed", f"room {room} committed: {got}"
    for needle in needles:
        assert needle in (got["reason"] or ""), f"room {room}: {needle!r} not in {got['reason']!r}"
