"""CPU (runs of 5, 4, 4 and 4 processes): the
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
  (`try_ensure_parallel_info`, `init`, `send_metadata` with its destination pages, `poll`). A
  decode loads the plugin and opts in (the flag's decision on the decode); one is stock SGLang
  (plugin not loaded), which the shared-KV prefill refuses.
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
problem, and the next request commits; a stock decode's rooms fail at the prefill before a page
is sent, naming the flag it needs. Every process has SGLANG_NSA_CP_PD_SECRET, so manifests are keyed. With fp8 KV (656-byte FlashMLA rows written by the pools' own
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
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_pd_harness as PD  # noqa: E402
from helpers.status_guard_decode import NOW, idle_manager  # noqa: E402

register_cpu_ci(est_time=35, suite="nsa-cp-test-cpu")


def test_four_ranks_send_owned_pages_and_faults_fail_cleanly():
    """N = 4, a decode with the plugin: pages land at their positions; a request whose pages come
    from SGLang's owner-rotating allocator, its decode pages grouped by owner, is one run per rank;
    a silent rank, a dropped page (self-check) and a dropped page with the self-check bypassed
    (decode manifest check) each fail their request with the reason; the request after each
    commits."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import owner_grouped_pages

    n = 4
    rng = np.random.default_rng(4)
    dst = iter(range(1, PD.DECODE_PAGES))
    reqs = []

    def add(pages, grouped_dst=False, **kw):
        pages_dst = [next(dst) for _ in pages]
        if grouped_dst:  # dealt out grouped by owner, as the plugin's decode hook allocates them
            pages_dst = owner_grouped_pages(pages_dst, n).tolist()
        reqs.append(PD.request(100 + len(reqs), pages, pages_dst, **kw))
        return reqs[-1]

    mixed = add(rng.choice(np.arange(n, PD.PREFILL_PAGES), 11, replace=False).tolist(), chunks=[4, 4, 3])
    # SGLang's allocator: the k-th page on rank (b + k) % N, each rank's local pages consecutive;
    # with owner-grouped decode pages every rank's positions are one run (b = 1 here)
    rotated = PD.allocator_pages(n, [5, 12])[1]
    assert rotated[0] % n == 1, rotated
    grouped = add(rotated, grouped_dst=True)
    silent = add(rng.choice(np.arange(n, PD.PREFILL_PAGES), 8, replace=False).tolist(), silent=[2])
    after_silent = add(list(range(20, 29)), chunks=[5, 4])
    dropped = add(list(range(30, 39)))
    after_dropped = add(list(range(5, 12)))
    bypassed = add(list(range(4, 12)), chunks=[4, 4])
    last = add(rng.choice(np.arange(n, PD.PREFILL_PAGES), 6, replace=False).tolist())
    faults = {("drop", 1): {dropped["room"]}, ("drop", 3): {bypassed["room"]}, ("bypass", 3): {bypassed["room"]}}

    reports = PD.run(n, {"plugin": (True, reqs)}, reqs, faults)
    info = reports["ready"][0]
    assert reports["ready"]["plugin"] == {"target_cp_ranks": [0, 1, 2, 3], "required": 4}
    PD.check_committed(reports, "plugin", mixed, n, info)
    PD.check_committed(reports, "plugin", grouped, n, info, runs=[1, 1, 1, 1])
    PD.check_failed(
        reports, "plugin", silent["room"], "timed out after 6", "no accepted transfer status from prefill rank(s) [2]"
    )
    PD.check_committed(reports, "plugin", after_silent, n, info)
    lost = PD.owned(dropped["pages"], 1, n)[0]
    PD.check_failed(
        reports, "plugin", dropped["room"], f"CP rank 1 of 4: owned KV pages not sent at positions [{lost}]"
    )
    assert reports["room"][(1, dropped["room"])]["status"] == "Failed"
    PD.check_committed(reports, "plugin", after_dropped, n, info)
    lost = PD.owned(bypassed["pages"], 3, n)[0]
    PD.check_failed(reports, "plugin", bypassed["room"], f"KV pages: missing positions [{lost}]")
    assert reports["room"][(3, bypassed["room"])]["status"] == "Success"  # the rank itself did not notice
    PD.check_committed(reports, "plugin", last, n, info)


def test_two_ranks_serve_a_plugin_decode_and_refuse_a_stock_decode():
    """N = 2, one prefill group serving two decodes at once: one with the plugin and the flag's
    opt-in, one stock SGLang 0.5.23 (what a decode without the flag runs). Every room of the stock
    decode fails at the prefill ranks before a page is sent, with a reason naming the flag that
    decode needs, which reaches it in SGLang's reason frame; the plugin decode's rooms commit
    meanwhile, a one-page request (a rank owning none of it) included, and a rank writing after the
    plugin decode gave up on a room is drained before the release."""
    n = 2
    p_dst, s_dst = iter(range(1, PD.DECODE_PAGES)), iter(range(1, PD.DECODE_PAGES))
    p_reqs = [
        PD.request(200, [7], [next(p_dst)]),  # one page: rank 0 owns none, sends an empty manifest
        PD.request(201, list(range(10, 22)), [next(p_dst) for _ in range(12)], chunks=[6, 6]),
        PD.request(
            202, list(range(30, 36)), [next(p_dst) for _ in range(6)], abort_after_s=1.0, cp_size=2, slow_rank=1
        ),
    ]
    s_reqs = [
        PD.request(300, [3, 9, 4, 17, 30, 11, 2], [next(s_dst) for _ in range(7)], chunks=[3, 4]),
        PD.request(303, [5, 6, 7, 8, 9], [next(s_dst) for _ in range(5)]),
    ]
    faults = {("slow", 1): {202: 2.5}}
    reports = PD.run(n, {"plugin": (True, p_reqs), "stock": (False, s_reqs)}, p_reqs + s_reqs, faults)
    info = reports["ready"][0]
    # Finding: a slow rank's write landed after its room was given up and its pages reused. Here
    # the decode gives up after 1 s, rank 1 writes at 2.5 s: release becomes safe only after that.
    late, aborted = reports["room"][(1, 202)], reports["room"][("plugin", 202)]
    assert late["write_end"] is not None and aborted["unsafe_polls"] > 50, (late, aborted)
    assert aborted["safe_at"] >= late["write_end"] and aborted["landed_when_safe"], (late, aborted)
    for name in ("plugin", "stock"):
        assert reports["ready"][name] == {"target_cp_ranks": [0, 1], "required": 2}
    PD.check_committed(reports, "plugin", p_reqs[0], n, info)
    PD.check_committed(reports, "plugin", p_reqs[1], n, info)
    for req in s_reqs:
        PD.check_failed(reports, "stock", req["room"], "has not opted in to shared-KV prefills",
                        "start that decode with --enable-nsa-prefill-cp-shared-kv")  # fmt: skip
        assert reports["room"][("stock", req["room"])]["written"] == [], "a refused room's pages were written"
        for rank in range(n):
            assert reports["room"][(rank, req["room"])]["status"] == "Failed", (rank, req["room"])


# ---- the bookkeeping and the hooks' pass-through, in process ---------------------------------------------
def test_mtp_draft_pages_ride_the_owned_page_transfer():
    """EAGLE (docs/speculative.md): the MTP layer's sharded pool (the target's size, spec and
    shard group, as SGLang's `_build_mtp_kv_shard_pool` builds it) registered as SGLang's draft KV
    pool on the prefill ranks, a stock `DSATokenToKVPool` draft pool on each decode. N = 2,
    two plugin decodes: the draft's latent and index-K pages land at the decode's
    draft pages of their positions next to the target's, each rank sending the draft pages it owns
    (bytes = owned pages x (target + draft) page bytes); a page a rank drops fails the request with
    the rank's reason (the draft's entries share the target's page list: a lost position is lost for
    both, and the same all-or-nothing commit covers them); the next request commits."""
    n = 2
    p_dst, s_dst = iter(range(1, PD.DECODE_PAGES)), iter(range(1, PD.DECODE_PAGES))
    p_reqs = [
        PD.request(400, list(range(10, 21)), [next(p_dst) for _ in range(11)], chunks=[6, 5]),
        PD.request(401, [3, 8, 13, 22, 31], [next(p_dst) for _ in range(5)]),
    ]
    s_reqs = [
        PD.request(500, [30, 5, 17, 2, 44, 9], [next(s_dst) for _ in range(6)], chunks=[2, 4]),
        PD.request(501, list(range(24, 31)), [next(s_dst) for _ in range(7)]),
        PD.request(502, [40, 41, 42], [next(s_dst) for _ in range(3)]),
    ]
    faults = {("drop", 0): {501}}
    reports = PD.run(n, {"plugin": (True, p_reqs), "second": (True, s_reqs)}, p_reqs + s_reqs, faults, draft=True)
    info = reports["ready"][0]
    # SGLang appends the draft's buffers after the target's: one more latent and one more index-K entry
    assert info["kv_item_lens"] == [PD.KV_PAGE_BYTES] * (PD.LAYERS + 1), info
    assert info["state_item_lens"][0] == [PD.INDEX_PAGE_BYTES] * (PD.LAYERS + 1), info
    for req in p_reqs:
        PD.check_committed(reports, "plugin", req, n, info)
    PD.check_committed(reports, "second", s_reqs[0], n, info)
    lost = PD.owned(s_reqs[1]["pages"], 0, n)[0]
    PD.check_failed(reports, "second", 501, f"CP rank 0 of 2: owned KV pages not sent at positions [{lost}]")
    PD.check_committed(reports, "second", s_reqs[2], n, info)


def test_fp8_pages_reach_the_decode_byte_equal_to_a_replicated_prefill():
    """--kv-cache-dtype fp8_e4m3, N = 2, two plugin decodes: each prefill rank's shard
    holds the 656-byte FlashMLA rows its pool quantized on write (SGLang's quantizer, owned rows
    only); the decode pages of every position are byte-equal to what SGLang's own fp8 pool of a
    replicated prefill holds for the same latent, and each rank sends only its owned fp8 pages."""
    n = 2
    pages = [3, 9, 4, 13, 6, 2, 11]  # logical pages >= N: 0..N-1 are SGLang's padding pages
    p_req = PD.request(400, pages, list(range(1, 8)), chunks=[3, 4])
    s_req = PD.request(500, pages[::-1], list(range(20, 27)))
    reports = PD.run(n, {"plugin": (True, [p_req]), "second": (True, [s_req])}, [p_req, s_req], {}, kv="fp8_e4m3")
    info = reports["ready"][0]
    assert info["kv_item_lens"] == [PD.KV_FORMATS["fp8_e4m3"][2]] * PD.LAYERS, info
    PD.check_committed(reports, "plugin", p_req, n, info)
    PD.check_committed(reports, "second", s_req, n, info)


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
    for secret in (None, PD.SECRET):
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

    good = encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, PD.SECRET)
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
            RankClaims(kv=_manifest(1, [1, 3], [11, 13]).kv, index=_manifest(0, [0, 2], [10, 12]).kv), 9, 1, PD.SECRET
        ),
        "not signed": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, None),
        "signed with another key": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 1, b"x" * 32),
        "replayed from another room": encode_manifest(_manifest(1, [1, 3], [11, 13]), 8, 1, PD.SECRET),
        "replayed from another rank": encode_manifest(_manifest(1, [1, 3], [11, 13]), 9, 0, PD.SECRET),
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
            decode_manifest(frame, room=9, prefill_rank=1, secret=PD.SECRET, max_pages=4)
        assert time.monotonic() - start < 0.1 and len(str(err.value)) <= 300, (name, str(err.value)[:200])


def test_the_plugin_managers_frame_limit_and_wire_format(monkeypatch):
    """The plugin's Mooncake classes, as SGLang gets them on an opted-in decode (the decision
    published): a prefill manager that is not a shared-KV prefill keeps no ledger and concludes as
    SGLang concludes; the 4th status frame (the reason) is this class's, never SGLang's manager's;
    a decode manager is built with its status-frame limit in force and the PD secret (none here)."""
    PD.load_plugin()
    from sglang.srt import runtime_context
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    import sglang_nsa_cp.sglang_ext.disaggregation.common.conn as frames
    import sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn as conn
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import MAX_USES, max_manifest_bytes
    from sglang_nsa_cp.sglang_ext.server_args import DECODE_ATTR

    monkeypatch.setattr(runtime_context, "get_server_args", lambda: SimpleNamespace(**{DECODE_ATTR: True}))
    assert [get_kv_class(TransferBackend.MOONCAKE, t) for t in (KVClassType.MANAGER, KVClassType.SENDER,
            KVClassType.RECEIVER)] == [conn.OwnedPageKVManager, conn.OwnedPageKVSender, conn.OwnedPageKVReceiver]  # fmt: skip
    assert (
        MooncakeKVManager.kv_status_msg_carries_reason is False and conn.OwnedPageKVManager.kv_status_msg_carries_reason
    )
    calls = []
    monkeypatch.setattr(
        MooncakeKVManager, "__init__", lambda self, *a: calls.append(getattr(frames._STATUS_FRAME_LIMIT, "bytes", None))
    )
    monkeypatch.setattr(MooncakeKVManager, "conclude_transfer", lambda self, **k: calls.append(k))
    monkeypatch.delenv("SGLANG_NSA_CP_PD_SECRET", raising=False)
    kv_args = SimpleNamespace(kv_data_lens=[64 * 1024], kv_item_lens=[1024])
    mgr = conn.OwnedPageKVManager(kv_args, DisaggregationMode.PREFILL, "server_args")
    assert mgr.owned_pages_ledger is None and calls == [None]
    mgr.conclude_transfer(bootstrap_room=7, status=KVPoll.Success)
    assert calls[-1] == {"bootstrap_room": 7, "status": KVPoll.Success} and not mgr.outgoing_manifests
    decode = conn.OwnedPageKVManager(kv_args, DisaggregationMode.DECODE, "server_args")
    assert decode.pd_secret is None and calls[-1] == (1 << 20) + max_manifest_bytes(64, MAX_USES)
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


def test_the_frame_limit_is_on_the_status_socket_alone():
    """Issue 47: the limit was set on SGLang's shared ZMQ context while the status socket was made,
    so a socket another thread made from that context in the window inherited it. Now it is set
    on the one socket: a socket made from the same context meanwhile (here: inside SGLang's call)
    and the context's defaults keep SGLang's options."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket_on_host

    import sglang_nsa_cp.sglang_ext.disaggregation.common.conn as hooks

    ctx = zmq.Context()
    meanwhile = []

    def sglangs_call(context, socket_type, **kwargs):
        meanwhile.append(ctx.socket(zmq.PUSH))  # another thread's socket, made in the window
        return get_zmq_socket_on_host(context, socket_type, **kwargs)

    with hooks.limited_status_frames(4096):
        _, pull = hooks.limit_status_frames(sglangs_call, ctx, zmq.PULL, host="127.0.0.1")
    assert pull.getsockopt(zmq.MAXMSGSIZE) == 4096 and pull.getsockopt(zmq.RCVHWM) == hooks.STATUS_RCVHWM
    assert meanwhile[0].getsockopt(zmq.MAXMSGSIZE) == -1, "a socket made meanwhile inherited the limit"
    assert zmq.MAXMSGSIZE not in ctx.sockopts
    for sock in (pull, *meanwhile):
        sock.close(linger=0)
    ctx.term()


def _deliver(mgr, room, rank, frame):
    """One status message, as SGLang's decode thread handles it (a message the plugin's parse
    screens out, None, is skipped)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    msg = [str(room).encode(), str(KVPoll.Success).encode(), str(rank).encode(), b""] + ([frame] if frame else [])
    parsed = mgr.parse_kv_status_message(msg)
    if parsed is None:
        return
    mgr.apply_prefill_status(bootstrap_room=parsed[0], status=parsed[1], prefill_rank=parsed[2],
                             failure_reason=parsed[3])  # fmt: skip


def _expect(mgr, room, kv_pages=4):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RoomExpectation

    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.prefill_response_tracker[room] = set()
    mgr.required_prefill_response_num_table[room] = 2
    mgr.room_expectations[room] = RoomExpectation(kv_pages, kv_pages, 2)
    mgr.room_nonces[room] = NOW  # this use of the room (its receiver draws it)


def test_decode_manager_commits_only_full_coverage():
    """The decode manager's `parse_kv_status_message` and `apply_prefill_status` (SGLang's, with
    the plugin's checks), fed status messages as the decode thread receives them."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    mgr = idle_manager(secret=None)
    good = {0: _manifest(0, [0, 2], [10, 12]), 1: _manifest(1, [1, 3], [11, 13])}
    for room, sends in {1: good, 2: {0: good[0], 1: _manifest(1, [1], [11])}, 3: {0: None, 1: None},
                        4: {0: good[0], 1: None}}.items():  # fmt: skip
        _expect(mgr, room)
        for rank, manifest in sends.items():
            _deliver(mgr, room, rank, manifest and encode_manifest(manifest, room, rank, None, uses=[NOW]))
    assert mgr.request_status[1] == KVPoll.Success and 1 not in mgr.failure_records
    assert mgr.request_status[2] == KVPoll.Failed and "KV pages: missing positions [3]" in mgr.failure_records[2]
    assert mgr.request_status[3] == KVPoll.Success  # no manifests, no secret: a stock prefill, SGLang's rule
    assert mgr.request_status[4] == KVPoll.Failed and "[1] reported success without" in mgr.failure_records[4]
    _deliver(
        mgr, 1, 1, encode_manifest(_manifest(1, [1], [11]), 1, 1, None, uses=[NOW])
    )  # a late repeat cannot undo a commit
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
    for secret in (PD.SECRET, None):
        mgr = idle_manager(secret=secret)
        hostile = dict(_hostile_manifest_frames(), **{"no manifest frame": None})
        for i, (name, frame) in enumerate(hostile.items()):
            room = 10 + i
            _expect(mgr, room)
            _deliver(mgr, room, 0, encode_manifest(good[0], room, 0, secret, uses=[NOW]))
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
            _deliver(mgr, room, 1, encode_manifest(good[1], room, 1, secret, uses=[NOW]))  # the real rank 1
            assert mgr.request_status[room] == KVPoll.Success, (name, mgr.failure_records.get(room))
        _expect(mgr, 99)
        for rank, m in good.items():
            _deliver(mgr, 99, rank, encode_manifest(m, 99, rank, secret, uses=[NOW]))
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
    for secret in (PD.SECRET, None):
        mgr = idle_manager(secret=secret)
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
