"""CPU (three runs of 4 processes): long prompts at once
through SGLang 0.5.23's Mooncake PD transfer with the plugin's owned pages (issue #32), thousands
of pages per room, in the owned-page PD harness (`helpers/sglang_pd_harness.py`): its prefill CP ranks (SGLang's sharded
pool filled with a byte pattern of (page, layer, kind), the KV manager from SGLang's own
`PrefillBootstrapQueue._init_kv_manager`, each request served in its own thread by a
`MooncakeKVSender` sending chunk after chunk), over Mooncake's TCP transport on 127.0.0.1, the
PD secret set. No model forward: the real servers (test/system/test_sglang_server_pd.py, three
prompts at once) reach only a few pages a prompt on 2 cores; the transfer itself is not the slow part.

Two prefill CP ranks serve two decodes at once (SGLang's `DecodePreallocQueue._init_kv_manager`;
each sends the metadata of all its rooms before it polls any, as a decode pre-allocates the rooms
it admits, so the prefill's threads send their chunks concurrently):

- `grouped`, with the plugin: three rooms of 2048 pages (131072 tokens) each, from SGLang's
  owner-rotating allocator, sent in chunks of 256 pages, decode pages dealt out grouped by owner
  as the plugin's decode hook deals them (`owner_grouped_pages`). Each rank writes one run per
  chunk: a batch is 2 entries (the layers) per chunk, 2 more for the index-K at the last chunk.
- `in_order`, with the plugin: one room of 3072 pages (196608 tokens) in chunks of 256, decode
  pages in request order (as SGLang's decode allocator hands them out; a stock decode is refused
  by a shared-KV prefill, test_sglang_ext_pd.py). A rank's positions are
  every other page there, so each owned page is its own entry per layer: 256 entries per chunk,
  and at the last chunk the request's whole index-K, 1536 owned pages x 2 layers = 3072 entries
  in one batch.

Mooncake's TCP transport (0.3.13.post1) takes about 2048 entries in flight per (engine, peer)
under its defaults (docs/sglang_cpu_server.md, benchmark/bench_mooncake_tcp_queue.py).
With the defaults in the prefill processes (nothing MC_TCP_* set: this harness does not run the
plugin's start-up, which raises the limit), the grouped rooms commit and the in-order room's
index-K batch is rejected: the room fails on the decode with SGLang's reason ("Failed to send
state components of <room>"), each rank's sender ends Failed (SGLang's prefill scheduler then
frees the request's pages; the decode's, after the ranks' drain acks or its release timeout: a
rank whose batch failed never acks, SGLang's guard against a write still landing), nothing
outside the room's decode pages is written, and the other decode's rooms, on another Mooncake
peer, still commit. With MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 in
the prefill processes (what `parallel_hook.validate` sets in the launcher environment when the
operator did not), the same traffic commits, the in-order room included.

Checked for a committed room (`_check_committed`): every latent and index-K page of every layer at
its decode page, nothing else in the decode pool changed, each rank's bytes = its owned pages x
page bytes + the metadata; and the batch entries each rank's writes took. Memory (peak RSS, in
`_run`'s reports with each process's seconds): ~1.3 GB per prefill rank (4609 local pages of
164 KB: 2 layers of latent and index-K), ~1.75 GB the grouped decode (6169 pages), ~1.2 GB the
in-order one; ~5.6 GB in all.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import sglang_pd_harness as pd  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.distributed import free_port, run_ranks  # noqa: E402

register_cpu_ci(est_time=40, suite="nsa-cp-test-cpu")

CP = 2
PAGE, LAYERS = pd.PAGE, pd.LAYERS
GROUPED_ROOMS, GROUPED_PAGES = 3, 2048
IN_ORDER_PAGES = 3072  # its index-K batch: 1536 owned pages x 2 layers, 1.5 x Mooncake's ~2048
CHUNK = 256  # pages per chunk, as SGLang's chunked prefill sends them
GAP = 8  # free decode pages after each room's: a write past a room's pages lands there
WAITING_TIMEOUT_S = 60
QUEUE_LIMIT = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
BATCH_INDICES = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"  # SGLang's split of one transfer's pages


def _pattern_table(kind: int, nbytes: int) -> torch.Tensor:
    """Row b: `pd.pattern`'s bytes of a page whose base is b (a page's bytes depend on its page,
    layer and kind only through base = (logical * 131 + layer * 17 + kind * 7) % 251)."""
    row = (torch.arange(nbytes, dtype=torch.int32) * (2 * kind + 3)) % 251
    return ((row.unsqueeze(0) + torch.arange(251, dtype=torch.int32).unsqueeze(1)) % 251).to(torch.uint8)


def _wrong_positions(buf, dst, logicals, layer, kind, table, step=512) -> list[int]:
    """Positions k whose decode page `buf[dst[k]]` is not `pd.pattern(logicals[k], layer, kind)`."""
    wrong = []
    for start in range(0, len(dst), step):
        bases = (logicals[start : start + step] * 131 + layer * 17 + kind * 7) % 251
        equal = (buf[dst[start : start + step]] == table[bases]).all(dim=1)
        wrong += (start + torch.nonzero(~equal).flatten()).tolist()
    return wrong


def _concurrent_decode(name, plugin, bootstrap_port, requests, decode_pages) -> list:
    """A decode that sends the metadata of all its rooms before it polls any, then polls them
    until each is Success or Failed (a failed room notifies the prefill ranks as SGLang's decode
    scheduler does: `ensure_abort_notified(force_arm=True)`). Then every page is checked: a
    committed room's latent and index-K at its decode pages, every page outside the rooms still
    the sentinel."""
    results = []
    pd.env(waiting_timeout=WAITING_TIMEOUT_S)
    if plugin:
        pd.load_plugin()
    server_args = pd.publish("decode", 1, 0, bootstrap_port, opted_in=plugin)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    assert plugin or not HookRegistry._patched, "the stock decode must run without the plugin"
    with get_parallel().override(attn_dcp_size=1, dcp_enabled=False):
        pool = DSATokenToKVPool(**pd.pool_kwargs((decode_pages - 1) * PAGE))
    latent = [pool.kv_buffer[i].view(torch.uint8).view(-1, pd.KV_PAGE_BYTES) for i in range(LAYERS)]
    index = [pool.index_key_cache.buffer[i] for i in range(LAYERS)]
    for t in latent + index:
        t.fill_(pd.SENTINEL)
    queue_stub = SimpleNamespace(
        transfer_backend=TransferBackend.MOONCAKE, tp_rank=0, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=None, is_mla_backend=True, metadata_buffers=pd.metadata_buffers(),
        enable_staging=False, scheduler=pd.scheduler_stub(server_args),
    )  # fmt: skip
    mgr = DecodePreallocQueue._init_kv_manager(queue_stub)
    addr = f"127.0.0.1:{bootstrap_port}"
    pd.wait(lambda: mgr.try_ensure_parallel_info(addr), bool, 90, "prefill bootstrap", interval_s=0.5)
    results.append(("ready", name, {"required": mgr.prefill_info_table[addr].required_prefill_response_num}))

    start, receivers, done = time.monotonic(), {}, {}
    for req in requests:
        receivers[req["room"]] = receiver = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)(
            mgr, addr, req["room"]
        )
        receiver.init(prefill_dp_rank=0)
        dst = np.asarray(req["dst"], dtype=np.int32)
        receiver.send_metadata(dst, req["aux"], [dst.copy()])
    while len(done) < len(receivers):
        for room, receiver in receivers.items():
            if room not in done and (status := receiver.poll()) in (KVPoll.Success, KVPoll.Failed):
                with mgr.failure_lock:
                    reason = mgr.failure_records.get(room)
                done[room] = {"status": pd.status_name(status), "reason": reason,
                              "seconds": round(time.monotonic() - start, 2)}  # fmt: skip
        assert time.monotonic() - start < WAITING_TIMEOUT_S + 30, (
            f"{name}: rooms in flight {set(receivers) - set(done)}"
        )
        time.sleep(0.02)
    for room, receiver in receivers.items():
        if done[room]["status"] == "Failed":
            receiver.ensure_abort_notified(force_arm=True)
            mgr.clear_deferred_abort_state(room)
        receiver.clear()

    untouched = torch.ones(decode_pages, dtype=torch.bool)
    for req in requests:
        untouched[req["dst"]] = False
    pages = torch.nonzero(untouched).flatten()
    stray = sorted({int(p) for t in latent + index for p in pages[~(t[pages] == pd.SENTINEL).all(dim=1)]})
    tables = [_pattern_table(0, pd.KV_PAGE_BYTES), _pattern_table(1, pd.INDEX_PAGE_BYTES)]
    for req in requests:
        wrong = []
        if done[req["room"]]["status"] == "Success":
            dst, logicals = torch.tensor(req["dst"]), torch.tensor(req["pages"])
            for layer in range(LAYERS):
                for kind, buf in enumerate((latent[layer], index[layer])):
                    hits = _wrong_positions(buf, dst, logicals, layer, kind, tables[kind])
                    wrong += [(("latent", "index")[kind], k, layer) for k in hits]
        results.append(("room", name, req["room"], dict(done[req["room"]], wrong=wrong, stray=stray)))
    return results


def _role(rank, world_size, group, decodes, prefill_requests, prefill_pages, bootstrap_port, settings) -> list:
    """Ranks 0..CP-1: the prefill CP ranks (the harness's), with `settings` (environment variables:
    Mooncake's MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, SGLang's batch bound; unset: the defaults)
    in place before their Mooncake engine and KV manager start; then the decodes in order."""
    started = time.monotonic()
    shard_group = pd.attn_cp_group(rank, world_size, CP)
    if rank < CP:
        who = rank
        for name in (QUEUE_LIMIT, BATCH_INDICES):
            os.environ.pop(name, None)
        os.environ.update(settings)
        out = pd.prefill_rank(rank, CP, shard_group, bootstrap_port, prefill_requests, {}, prefill_pages=prefill_pages)
    else:
        who, (plugin, requests) = list(decodes.items())[rank - CP]
        decode_pages = max(d for req in requests for d in req["dst"]) + GAP + 1
        out = _concurrent_decode(who, plugin, bootstrap_port, requests, decode_pages)
    torch.distributed.barrier(group)
    out.append(("rss_mb", who, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
    out.append(("seconds", who, round(time.monotonic() - started, 1)))
    return out


def _run(decodes, prefill_pages, settings, timeout_s=400):
    """The prefill CP ranks serving every decode's requests, and the decodes; their reports."""
    prefill_requests = [req for _, reqs in decodes.values() for req in reqs]
    args = (decodes, prefill_requests, prefill_pages, free_port(), settings)
    reports = {"ready": {}, "room": {}, "rss_mb": {}, "seconds": {}}
    for messages in run_ranks(_role, CP + len(decodes), args=args, timeout_s=timeout_s):
        for kind, who, *rest in messages:
            if kind == "room":
                reports["room"][(who, rest[0])] = rest[1]
            else:
                reports[kind][who] = rest[0]
    return reports


def _traffic(grouped_rooms=GROUPED_ROOMS):
    """({decode: (plugin, requests)}, the prefill group's logical pages): the grouped rooms and
    the in-order room, their logical pages taken in turn from SGLang's allocator over a prefill
    pool that holds them all."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import owner_grouped_pages

    sizes = [GROUPED_PAGES] * grouped_rooms + [IN_ORDER_PAGES]
    prefill_pages = CP * (sum(sizes) // CP + 1)
    *logical, in_order_pages = pd.allocator_pages(CP, sizes, prefill_pages)
    grouped, first = [], 1
    for i, pages in enumerate(logical):
        dst = owner_grouped_pages(np.arange(first, first + GROUPED_PAGES), CP)
        grouped.append(pd.request(700 + i, pages, dst.tolist(), chunks=_chunks(GROUPED_PAGES)))
        first += GROUPED_PAGES + GAP
    in_order = pd.request(800, in_order_pages, range(1, 1 + IN_ORDER_PAGES), chunks=_chunks(IN_ORDER_PAGES))
    return {"grouped": (True, grouped), "in_order": (True, [in_order])}, prefill_pages


def _chunks(pages):
    return [CHUNK] * (pages // CHUNK) + ([pages % CHUNK] if pages % CHUNK else [])


def _check_grouped_rooms_committed(reports, decodes, batch_indices=None):
    """`batch_indices`: SGLang's bound on the pages of one batch, which splits the index-K's run."""
    info = reports["ready"][0]
    index_batches = -(-(GROUPED_PAGES // CP) // batch_indices) if batch_indices else 1
    for req in decodes["grouped"][1]:
        pd.check_committed(reports, "grouped", req, CP, info)
        for rank in range(CP):  # one run per chunk, then the index-K's; an entry per layer each
            sent = reports["room"][(rank, req["room"])]
            want = LAYERS * (len(req["chunks"]) + index_batches)
            assert sent["stats"]["pages"][1] == want, (rank, req["room"], sent)


def test_the_page_check_names_each_wrong_page():
    """The decodes' check, in process, against the harness's `_pattern`: pages where they belong
    pass (across a step boundary); a flipped byte and two swapped pages are named, latent and
    index-K alike."""
    logicals, dst = torch.tensor([5, 9, 12, 7, 30]), torch.tensor([3, 0, 4, 1, 2])
    for kind, nbytes in ((0, pd.KV_PAGE_BYTES), (1, pd.INDEX_PAGE_BYTES)):
        buf = torch.full((5, nbytes), pd.SENTINEL, dtype=torch.uint8)
        for k in range(5):
            buf[dst[k]] = pd.pattern(int(logicals[k]), 1, kind, nbytes)
        table = _pattern_table(kind, nbytes)
        assert _wrong_positions(buf, dst, logicals, 1, kind, table, step=3) == []
        buf[dst[2], 100] ^= 1
        swap = [int(dst[0]), int(dst[3])]
        buf[swap] = buf[swap[::-1]]
        assert _wrong_positions(buf, dst, logicals, 1, kind, table, step=3) == [0, 2, 3], kind


def test_many_pages_at_once_under_mooncakes_default_tcp_limits():
    """Defaults: the three grouped rooms (6144 pages) commit byte exact at once, 2 entries per
    batch; the in-order room's 3072-entry index-K batch is rejected: the room fails with SGLang's
    reason on the decode and on the rank that sent it, every rank's sender ends Failed, nothing
    is written outside the room's pages."""
    decodes, prefill_pages = _traffic()
    reports = _run(decodes, prefill_pages, settings={})
    _check_grouped_rooms_committed(reports, decodes)
    rejected = "Failed to send state components of 800"
    pd.check_failed(reports, "in_order", 800, rejected)
    assert reports["room"][("in_order", 800)]["stray"] == [], reports["room"][("in_order", 800)]
    sent = [reports["room"][(rank, 800)] for rank in range(CP)]
    assert all(s["status"] == "Failed" for s in sent) and any(rejected in (s["reason"] or "") for s in sent), sent


def _check_in_order_room_committed(reports, decodes):
    (req,) = decodes["in_order"][1]
    pd.check_committed(reports, "in_order", req, CP, reports["ready"][0])
    owned = IN_ORDER_PAGES // CP
    for rank in range(CP):  # an entry per owned page per layer, in the chunks and again for the index-K
        sent = reports["room"][(rank, 800)]
        assert sent["stats"]["pages"][1] == LAYERS * (owned + owned), (rank, sent)


@pytest.mark.parametrize(
    "settings",
    [{QUEUE_LIMIT: "65535"}, {BATCH_INDICES: "512"}],
    ids=["mooncake-queue-65535", "sglang-batches-of-512-pages"],
)
def test_a_raised_queue_or_bounded_batches_commit_the_in_order_room_too(settings):
    """The in-order room beside one grouped room (the three at once are the default's case) with
    Mooncake's per-peer queue at its maximum (what the flag sets unless the operator did), or with
    SGLang's own batch bound (what the flag sets from the model's layers, at Mooncake's default
    queue): both rooms commit byte exact, the in-order room's ranks taking 6144 entries each (12
    chunks x 128 owned pages x 2 layers, then 1536 x 2 for the index-K)."""
    decodes, prefill_pages = _traffic(grouped_rooms=1)
    reports = _run(decodes, prefill_pages, settings=settings)
    _check_grouped_rooms_committed(reports, decodes, int(settings.get(BATCH_INDICES, 0)))
    _check_in_order_room_committed(reports, decodes)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
