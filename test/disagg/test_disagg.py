"""Owned-page transfer (the disagg/ core, the pd/ transport) on CPU: Mooncake over TCP, prefill
ranks as spawned processes.

CPU only, about 30 s on 2 cores. The unit tests at the top need no process; the rest share a
pool of 4 prefill-rank processes (`comm.launch.RankPool`, kept alive across tests; each keeps its
Mooncake engine and sender between calls) that a decode receiver in this process serves. Each
rank builds its shard from a seed, so the test rebuilds every shard here to know what the decode
must hold: at each request position k, the bytes of logical page p = pages[k] from rank p % N,
local page p // N, in every layer, kv and index.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.comm import RankFailure, RankPool
from sglang_nsa_cp.disagg import (
    CHECKSUM_MODULUS,
    KVBuffers,
    PageClaims,
    check_coverage,
    coalesce_runs,
    page_checksums,
    plan_owned_pages,
)
from sglang_nsa_cp.kernels.formats import INDEX_ROW_BYTES
from sglang_nsa_cp.layout import OutOfPages, OwnerClassedAllocator
from sglang_nsa_cp.pd import (
    Committed,
    EngineConfig,
    Failed,
    MooncakeEngine,
    OwnedPageReceiver,
    OwnedPageSender,
    build_transfer_batch,
    new_nonce,
)

register_cpu_ci(est_time=50, suite="nsa-cp-test-cpu")

pytestmark = pytest.mark.timeout(120)

KV_ROW = {"bf16": (torch.bfloat16, 576), "fp8": (torch.uint8, 656)}  # dtype, values per row
SENTINEL = 0xAB  # decode pool fill: a page nobody wrote still reads as this
SECRET = b"test-disagg-secret-0123456789abcdef"  # keys every message here (auth.py)


# ---- shards and pools ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    cp_size: int
    row: str  # "bf16" (576 x bf16 = 1152 B) or "fp8" (FlashMLA 656 B)
    num_layers: int = 3
    local_pages: int = 12
    page_size: int = 64
    seed: int = 0


def make_pool(case: Case, num_pages: int, seed: int | None) -> KVBuffers:
    """Random pages (seed) or the sentinel (seed None), case's layout."""
    dtype, width = KV_ROW[case.row]
    gen = torch.Generator().manual_seed(seed or 0)

    def fill(nbytes: int) -> torch.Tensor:
        if seed is None:
            return torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)

    row_bytes = width * dtype.itemsize
    rows = num_pages * case.page_size
    kv = [fill(rows * row_bytes).view(dtype).view(rows, width) for _ in range(case.num_layers)]
    index = [fill(num_pages * case.page_size * INDEX_ROW_BYTES).view(num_pages, -1) for _ in range(case.num_layers)]
    return KVBuffers(kv, index, case.page_size)


def make_shard(case: Case, rank: int) -> KVBuffers:
    return make_pool(case, case.local_pages, seed=1000 * case.seed + rank + 1)


def page_bytes(buffers: KVBuffers, kind: str, layer: int, page: int) -> torch.Tensor:
    t = (buffers.kv if kind == "kv" else buffers.index)[layer]
    rows = buffers.page_size if kind == "kv" else 1
    return t[page * rows : (page + 1) * rows].contiguous().view(-1).view(torch.uint8)


def assert_decode_holds(case: Case, decode: KVBuffers, pages: list[int], dst: list[int]) -> None:
    """Each position's decode page equals its owner's shard page, for every layer and kind."""
    shards = [make_shard(case, r) for r in range(case.cp_size)]
    for k, (p, q) in enumerate(zip(pages, dst)):
        owner, local = p % case.cp_size, p // case.cp_size
        for layer in range(case.num_layers):
            for kind in ("kv", "index"):
                got = page_bytes(decode, kind, layer, q)
                want = page_bytes(shards[owner], kind, layer, local)
                assert torch.equal(got, want), (
                    f"{case=}, position {k}: {kind}[{layer}] of decode page {q} differs from "
                    f"rank {owner}'s local page {local} (logical page {p}) in "
                    f"{int((got != want).sum())} of {got.numel()} bytes"
                )


def assert_untouched(decode: KVBuffers, pages) -> None:
    rows = torch.tensor(sorted(pages), dtype=torch.long)
    for buf in decode.flat():
        by_page = buf.tensor.view(-1).view(torch.uint8).view(buf.num_pages, -1)
        written = (by_page[rows] != SENTINEL).any(dim=1)
        assert not bool(written.any()), f"{buf.name}: pages {rows[written].tolist()} were written"


# ---- the prefill-rank processes ------------------------------------------------------------


def _send_with_fault(sender: OwnedPageSender, address: str, request_id, nonce, pages, fault):
    """sender.send() step by step, with one fault injected between the steps."""
    if fault is None:
        return sender.send(address, request_id, pages, nonce=nonce)
    owned = sender.plan(pages)
    peer = sender.connect(address)
    dst = sender.fetch_destination(peer, request_id, nonce, owned)
    if fault == "die_after_fetch":
        os._exit(3)  # killed with the destinations in hand: its writes might still come
    if fault == "duplicate":  # also claim the first position some other rank owns
        stolen = next(k for k in range(len(pages)) if k not in owned.positions)
        owned = dataclasses.replace(
            owned,
            positions=owned.positions + (stolen,),
            logical_pages=owned.logical_pages + owned.logical_pages[:1],
            local_pages=owned.local_pages + owned.local_pages[:1],
        )
    checksums = sender.checksum(owned)
    flat = sender.buffers.kv[-1].view(-1).view(torch.uint8)
    spot = owned.local_pages[0] * sender.buffers.kv_page_bytes + 100
    if fault == "corrupt_after_checksum":
        flat[spot] ^= 0xFF
    if fault == "bad_checksum":
        checksums[0] = (checksums[0] + 1) % CHECKSUM_MODULUS
    result = sender.write(peer, request_id, nonce, owned, dst)
    if fault == "corrupt_after_checksum":
        flat[spot] ^= 0xFF  # restore, so later requests see the seeded shard again
    if fault == "omit":  # wrote every page, but the manifest forgets the last one
        owned = dataclasses.replace(
            owned,
            positions=owned.positions[:-1],
            logical_pages=owned.logical_pages[:-1],
            local_pages=owned.local_pages[:-1],
        )
        checksums = checksums[:-1]
    sender.send_manifest(peer, request_id, nonce, owned, checksums, result)
    return result


_RANK = {}  # in each rank process: its Mooncake engine, and its sender with the case it serves


def _sender(case: Case, rank: int) -> OwnedPageSender:
    """This rank's sender for `case`, built on first use (the process keeps it between calls)."""
    if "engine" not in _RANK:
        _RANK["engine"] = MooncakeEngine(EngineConfig())
    if _RANK.get("case") != case:
        if "sender" in _RANK:
            _RANK["sender"].close()
        _RANK["sender"] = OwnedPageSender(
            make_shard(case, rank), rank, case.cp_size, engine=_RANK["engine"], timeout_s=10, secret=SECRET
        )
        _RANK["case"] = case
    return _RANK["sender"]


def _prepare(rank, world_size, group, case: Case) -> None:
    """Build the senders of `case` now, so that no rank is still starting when a request's
    transfer deadline runs (after a restart, say)."""
    if rank < case.cp_size:
        _sender(case, rank)


def _send(rank, world_size, group, case: Case, address: str, request_id, nonce, pages, faults):
    """One call on every pool rank: the ranks of `case` send the request (rank r with fault
    faults.get(r); "silent" sends nothing); the pool's other ranks have nothing to do."""
    if rank >= case.cp_size or faults.get(rank) == "silent":
        return None
    return _send_with_fault(_sender(case, rank), address, request_id, nonce, pages, faults.get(rank))


@pytest.fixture(scope="module")
def ranks():
    with RankPool(4, backend=None, timeout_s=90) as pool:
        yield pool


@pytest.fixture(scope="module")
def decode_engine():
    return MooncakeEngine(EngineConfig())


@pytest.fixture(scope="module")
def prefill_engine():
    """For senders in this process; small batches, to exercise the split of batched writes."""
    return MooncakeEngine(EngineConfig(max_batch_entries=3))


def make_receiver(case: Case, engine, num_pages: int = 64, **kwargs) -> OwnedPageReceiver:
    return OwnedPageReceiver(make_pool(case, num_pages, seed=None), engine=engine, secret=SECRET, **kwargs)


def send(ranks: RankPool, rx: OwnedPageReceiver, case: Case, request_id, nonce, pages, faults=None) -> dict:
    """Every rank of `case` sends the request (with its fault); rank -> its SendResult."""
    results = ranks.run(_send, args=(case, rx.address, request_id, nonce, pages, faults or {}))
    return {r: res for r, res in enumerate(results) if res is not None}


def transfer(ranks: RankPool, rx: OwnedPageReceiver, case: Case, request_id, pages, faults=None):
    """Expect the request, let every rank send (with its fault), return (dst, results, status)."""
    nonce = new_nonce()
    dst = rx.expect(request_id, len(pages), case.cp_size, nonce=nonce)
    results = send(ranks, rx, case, request_id, nonce, pages, faults)
    return dst, results, rx.wait(request_id, timeout_s=15)


def interleaved_pages(start: int, count: int) -> list[int]:
    return list(range(start, start + count))  # owners rotate: single-page runs


def compute_owner_pages(cp_size: int, owners_and_counts: list[tuple[int, int]]) -> list[int]:
    """Consecutive local pages per owner, as compute-owner allocation hands them out."""
    next_local = [1] * cp_size
    pages = []
    for owner, count in owners_and_counts:
        pages += [(next_local[owner] + j) * cp_size + owner for j in range(count)]
        next_local[owner] += count
    return pages


def fragment(allocator: OwnerClassedAllocator) -> list[int]:
    """Leave holes at the low end, so the next request's decode pages are not all consecutive."""
    taken = allocator.alloc([0] * 10)
    allocator.free([taken[i] for i in (1, 2, 5)])
    return [taken[i] for i in range(10) if i not in (1, 2, 5)]


# ---- one process: pure pieces --------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_plan_owned_pages_partitions_positions(cp_size):
    rng = random.Random(cp_size)
    for num_pages in (1, 2, 7, 33):
        pages = rng.sample(range(200), num_pages)
        plans = [plan_owned_pages(pages, r, cp_size) for r in range(cp_size)]
        claimed = sorted(k for plan in plans for k in plan.positions)
        assert claimed == list(range(num_pages)), f"{cp_size=}, {pages=}: {claimed=}"
        for plan in plans:
            for k, p, q in zip(plan.positions, plan.logical_pages, plan.local_pages):
                assert (pages[k], p % cp_size, q) == (p, plan.rank, p // cp_size), (
                    f"{cp_size=}, rank={plan.rank}, position {k}: page {p}, local {q}"
                )


def test_plan_owned_pages_rejects_bad_input():
    with pytest.raises(ValueError, match="rank < cp_size"):
        plan_owned_pages([0, 1], rank=2, cp_size=2)
    with pytest.raises(ValueError, match="distinct"):
        plan_owned_pages([4, 4], rank=0, cp_size=2)


def test_coalesce_runs():
    assert coalesce_runs([], []) == []
    assert coalesce_runs([3, 4, 5], [40, 41, 42]) == [(3, 40, 3)]
    assert coalesce_runs([3, 4, 5], [40, 42, 43]) == [(3, 40, 1), (4, 42, 2)]
    assert coalesce_runs([3, 5, 6, 7], [9, 10, 11, 12]) == [(3, 9, 1), (5, 10, 3)]
    assert coalesce_runs([1, 2], [8, 7]) == [(1, 8, 1), (2, 7, 1)]
    with pytest.raises(ValueError, match="2 source pages but 1"):
        coalesce_runs([1, 2], [3])


def test_build_transfer_batch_addresses():
    case = Case(cp_size=2, row="fp8", num_layers=2, local_pages=4, page_size=4)
    shard = make_pool(case, case.local_pages, seed=1)
    dst_ptrs = [1 << 40, 2 << 40, 3 << 40, 4 << 40]
    batch = build_transfer_batch(shard, dst_ptrs, [(1, 5, 2)])
    kv_bytes, ix_bytes = 4 * 656, 4 * 132
    assert batch.lengths == [2 * kv_bytes, 2 * ix_bytes] * 2
    assert batch.src_ptrs[0] == shard.kv[0].data_ptr() + kv_bytes
    assert batch.dst_ptrs[:2] == [dst_ptrs[0] + 5 * kv_bytes, dst_ptrs[1] + 5 * ix_bytes]


def _checksum_by_hand(buffers: KVBuffers, page: int) -> int:
    total = 0
    for b, buf in enumerate(buffers.flat()):
        words = buf.page_words()[page].tolist()
        s = sum((i + 1) * w for i, w in enumerate(words))  # Python ints: no overflow
        total = (total + (b + 1) * (s % CHECKSUM_MODULUS)) % CHECKSUM_MODULUS
    return total


def test_checksum_matches_formula_and_catches_changes():
    case = Case(cp_size=1, row="bf16", num_layers=2, local_pages=5, page_size=4)
    pool = make_pool(case, case.local_pages, seed=3)
    sums = page_checksums(pool, [4, 0, 2])
    assert sums.dtype == torch.int64
    assert sums.tolist() == [_checksum_by_hand(pool, p) for p in (4, 0, 2)]
    # Extreme words at the largest page the checksum allows: still exact, no int64 overflow.
    big = KVBuffers(
        [torch.full((2, 1 << 16), -(1 << 31), dtype=torch.int32)],
        [torch.full((2, 4), 0x7F, dtype=torch.uint8)],
        page_size=1,
    )
    assert page_checksums(big, [1]).tolist() == [_checksum_by_hand(big, 1)]
    before = page_checksums(pool, range(5))
    pool.kv[1].view(-1).view(torch.uint8)[2 * pool.kv_page_bytes + 7] ^= 1  # one bit, page 2
    after = page_checksums(pool, range(5))
    assert (before != after).nonzero().flatten().tolist() == [2], f"{before=}, {after=}"
    swapped = pool.kv[0].view(-1).view(torch.int32).view(5, -1)[3].clone()
    pool.kv[0].view(-1).view(torch.int32).view(5, -1)[3] = swapped.roll(1)  # same words, moved
    assert page_checksums(pool, [3]).item() != after[3].item()


def test_check_coverage_names_every_problem():
    def manifest(rank, positions, pages):
        return PageClaims(rank, 2, 6, tuple(positions), tuple(pages), (0,) * len(pages))

    good = {0: manifest(0, [0, 2, 4], [10, 12, 14]), 1: manifest(1, [1, 3, 5], [11, 13, 15])}
    assert check_coverage(6, 2, good).ok
    bad = {0: manifest(0, [0, 2, 3], [10, 12, 14]), 1: manifest(1, [1, 3, 9], [11, 12, 15])}
    report = check_coverage(6, 2, bad)
    assert (report.missing, report.duplicated, report.wrong_owner, report.out_of_range) == ((4, 5), (3,), (3,), (9,)), (
        report
    )
    assert "duplicated positions [3 (ranks [0, 1])]" in report.describe(), report.describe()
    assert check_coverage(6, 2, {1: good[1]}).silent_ranks == (0,)


def test_kv_buffers_reject_bad_shapes():
    kv = torch.zeros(128, 576, dtype=torch.bfloat16)
    ix = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    assert KVBuffers([kv], [ix], 64).num_pages == 2
    with pytest.raises(ValueError, match="one kv and one index buffer per layer"):
        KVBuffers([kv, kv], [ix], 64)
    with pytest.raises(ValueError, match="not a multiple of 64 rows"):
        KVBuffers([kv[:100]], [ix], 64)
    with pytest.raises(ValueError, match="contiguous"):
        KVBuffers([kv.t()], [ix], 64)
    with pytest.raises(ValueError, match="kv page sizes differ"):
        KVBuffers([kv, torch.zeros(128, 656, dtype=torch.uint8)], [ix, ix], 64)
    with pytest.raises(ValueError, match="multiple of 4 B"):
        KVBuffers([kv], [torch.zeros(2, 3, dtype=torch.uint8)], 64)


def test_decode_allocator_lowest_first_and_rejects_double_free():
    """The decode's allocator: the owner-classed one with one class (the decode has no CP)."""
    alloc = OwnerClassedAllocator(8, cp_size=1)
    first = alloc.alloc([0] * 3)
    assert first == [0, 1, 2] and alloc.free_pages() == 5
    alloc.free([1])
    assert alloc.alloc([0]) == [1]
    with pytest.raises(ValueError, match="listed twice"):
        alloc.free([2, 2])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([7])
    with pytest.raises(OutOfPages, match="asked for 9 pages but only 5 are free"):
        alloc.alloc([0] * 9)
    with pytest.raises(ValueError, match="no CP: use OwnerClassedAllocator"):
        OwnedPageReceiver(make_pool(Case(1, "bf16"), 8, seed=None), allocator=OwnerClassedAllocator(8, 2))


def test_one_rank_in_process_with_split_batches(decode_engine, prefill_engine):
    case = Case(cp_size=1, row="fp8", num_layers=2, local_pages=8)
    rx = make_receiver(case, decode_engine, num_pages=16, timeout_s=20)
    sender = OwnedPageSender(make_shard(case, 0), 0, 1, engine=prefill_engine, secret=SECRET)
    try:
        pages = [5, 6, 7, 1, 3]  # runs (5,6,7), (1), (3) x 4 buffers = 12 entries
        nonce = new_nonce()
        dst = rx.expect(1234, len(pages), 1, nonce=nonce)  # an int id, like SGLang's bootstrap_room
        result = sender.send(rx.address, 1234, pages, nonce=nonce)
        assert (result.num_transfers, result.num_batches) == (12, 4), result
        assert rx.wait(1234) == Committed(1234, tuple(dst))
        assert_decode_holds(case, rx.buffers, pages, dst)
    finally:
        sender.close()
        rx.close()


def test_sender_rejects_bad_input_before_any_transfer(decode_engine, prefill_engine):
    case = Case(cp_size=2, row="bf16", num_layers=2, local_pages=4)
    rx = make_receiver(case, decode_engine, num_pages=16, timeout_s=20)
    sender = OwnedPageSender(make_shard(case, 1), 1, 2, engine=prefill_engine, secret=SECRET)
    try:
        with pytest.raises(ValueError, match="map past this shard's 4 local pages"):
            sender.plan([0, 9])  # page 9 -> local page 4 of rank 1
        peer = sender.connect(rx.address)
        owned = sender.plan([0, 1, 2, 3])
        nonce = new_nonce()
        rx.expect("short", 4, 2, nonce=nonce)
        with pytest.raises(ValueError, match="3 destination pages for a request of 4"):
            sender.write(peer, "short", nonce, owned, [0, 1, 2])
        with pytest.raises(ValueError, match=r"outside the decode pool of 16"):
            sender.write(peer, "short", nonce, owned, [0, 1, 2, 99])
        assert sender.stats.nbytes == 0
        assert_untouched(rx.buffers, set(range(16)))
        other = Case(cp_size=2, row="fp8", num_layers=2, local_pages=4)
        wrong = OwnedPageSender(make_shard(other, 0), 0, 2, engine=sender.engine, secret=SECRET)
        with pytest.raises(ValueError, match="kv_page_bytes: prefill 41984 vs decode 73728"):
            wrong.connect(rx.address)
        wrong.close()
    finally:
        sender.close()
        rx.close()


# ---- prefill ranks as processes ------------------------------------------------------------

TRANSFER_CASES = [Case(2, "bf16"), Case(2, "fp8", seed=1), Case(4, "bf16", seed=2), Case(4, "fp8", seed=3)]


@pytest.mark.parametrize("case", TRANSFER_CASES, ids=lambda c: f"N{c.cp_size}-{c.row}")
def test_transfer_lands_the_logical_view(ranks, decode_engine, case):
    """Two requests pending at once: rotating owners, then compute-owner runs."""
    n = case.cp_size
    rx = make_receiver(case, decode_engine, timeout_s=20)
    try:
        busy = fragment(rx.allocator)
        requests = {
            "rotating": interleaved_pages(3, 2 * n + 3),
            "runs": compute_owner_pages(n, [(1, 3), (0, 2), (n - 1, 4), (0, 1), (1, 2)]),
        }
        nonces = {rid: new_nonce() for rid in requests}
        dst = {rid: rx.expect(rid, len(pages), n, nonce=nonces[rid]) for rid, pages in requests.items()}
        assert dst["rotating"][:3] != list(range(dst["rotating"][0], dst["rotating"][0] + 3))
        for rid, pages in requests.items():
            send(ranks, rx, case, rid, nonces[rid], pages)
        for rid, pages in requests.items():
            status = rx.wait(rid, timeout_s=15)
            assert status == Committed(rid, tuple(dst[rid])), f"{case=}, {rid}: {status}"
            assert_decode_holds(case, rx.buffers, pages, dst[rid])
        written = set(busy) | {q for pages in dst.values() for q in pages}
        assert_untouched(rx.buffers, set(range(rx.buffers.num_pages)) - written)
        for rid in requests:
            rx.release(rid)
        assert rx.allocator.free_pages() == rx.buffers.num_pages - len(busy)
    finally:
        rx.close()


def test_each_rank_sends_a_1_over_n_share(ranks, decode_engine):
    """Bytes per rank against CP rank 0 sending every page, as SGLang 0.5.23 does by default."""
    case = Case(4, "bf16", seed=4)
    rx = make_receiver(case, decode_engine, timeout_s=20)
    bytes_per_page = rx.buffers.bytes_per_page()  # all layers, kv + index
    buffers = 2 * case.num_layers
    rows = []
    try:
        requests = {
            "rotating": interleaved_pages(0, 16),
            "runs": compute_owner_pages(4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
        }
        for rid, pages in requests.items():
            dst, results, status = transfer(ranks, rx, case, rid, pages)
            assert isinstance(status, Committed), status
            rank0_alone = len(pages) * bytes_per_page
            for r, res in results.items():
                rows.append((rid, r, res.nbytes, res.nbytes / rank0_alone, res.num_transfers))
                assert res.nbytes == 4 * bytes_per_page == rank0_alone // 4, (rid, r, res)
                runs = 4 if rid == "rotating" else 1  # dst pages are consecutive here
                assert (res.num_transfers, res.num_batches) == (runs * buffers, 1), (rid, r, res)
            rx.release(rid)
        assert sum(s.nbytes for s in rx.stats.per_rank.values()) == 2 * 16 * bytes_per_page
    finally:
        rx.close()
    print("\nrequest  rank  bytes  share_of_rank0_alone  transfers")
    for row in rows:
        print("{:8} {:5} {:8} {:20.3f} {:10}".format(*row))


def test_killed_or_silent_rank_fails_the_request_after_the_timeout(ranks, decode_engine):
    case = Case(2, "bf16", seed=5)
    rx = make_receiver(case, decode_engine, timeout_s=1.5)
    pages = interleaved_pages(0, 6)
    free_before = rx.allocator.free_pages()
    try:
        # Rank 1 never sends: nothing can be in flight, so the pages are free at once.
        dst, _, status = transfer(ranks, rx, case, "silent", pages, faults={1: "silent"})
        assert isinstance(status, Failed), status
        assert status.reason == ("timed out after 1.5 s: no manifest from rank(s) [1]; missing positions [1, 3, 5]"), (
            status.reason
        )
        assert rx.allocator.free_pages() == free_before and rx.num_fenced_pages == 0
        # Rank 0 sends; rank 1 dies holding the destinations: its pages stay fenced until the
        # decode finds its connection closed (the cancel it sends cannot be routed), never on a
        # timer. The pool names the dead rank; its next call starts a fresh rank 1.
        rx.release("silent")
        nonce = new_nonce()
        dst = rx.expect("killed", len(pages), 2, nonce=nonce)
        assert send(ranks, rx, case, "killed", nonce, pages, faults={1: "silent"})[0].num_pages == 3
        with pytest.raises(RankFailure, match=r"rank 1/4 failed:\nprocess exited with code 3"):
            send(ranks, rx, case, "killed", nonce, pages, faults={0: "silent", 1: "die_after_fetch"})
        status = rx.wait("killed", timeout_s=10)
        assert isinstance(status, Failed), status
        assert "no manifest from rank(s) [1]" in status.reason, status.reason
        deadline = time.monotonic() + 5
        while rx.num_fenced_pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rx.num_fenced_pages == 0 and rx.allocator.free_pages() == free_before
        # The receiver keeps serving: a restarted rank 1 and the next request commit.
        ranks.run(_prepare, args=(case,))
        dst, _, status = transfer(ranks, rx, case, "after", pages)
        assert isinstance(status, Committed), status
        assert_decode_holds(case, rx.buffers, pages, dst)
    finally:
        rx.close()


FAULTS = [  # (fault of rank 1, cp_size, which report field names the bad positions)
    ("omit", 2, "missing"),
    ("corrupt_after_checksum", 2, "corrupt"),
    ("bad_checksum", 2, "corrupt"),
    ("duplicate", 4, "duplicated"),
]


@pytest.mark.parametrize("fault,cp_size,field", FAULTS, ids=[f[0] for f in FAULTS])
def test_bad_manifest_fails_cleanly_and_the_next_request_commits(ranks, decode_engine, fault, cp_size, field):
    case = Case(cp_size, "fp8", seed=6)
    rx = make_receiver(case, decode_engine, timeout_s=10)
    pages = interleaved_pages(2, 3 * cp_size)
    owned_by_1 = [k for k, p in enumerate(pages) if p % cp_size == 1]
    expected = {
        "missing": [owned_by_1[-1]],
        "corrupt": [owned_by_1[0]],
        "duplicated": [next(k for k, p in enumerate(pages) if p % cp_size != 1)],
    }[field]
    free_before = rx.allocator.free_pages()
    try:
        _, _, status = transfer(ranks, rx, case, "bad", pages, faults={1: fault})
        assert isinstance(status, Failed), f"{fault=}: {status}"
        assert list(getattr(status.report, field)) == expected, f"{fault=}: {status.reason}"
        assert f"{field} positions" in status.reason, status.reason
        print(f"\n{fault}: {status.reason}")
        assert rx.allocator.free_pages() == free_before, f"{fault=}: pages not freed"
        dst, _, status = transfer(ranks, rx, case, "good", pages)
        assert isinstance(status, Committed), f"after {fault=}: {status}"
        assert_decode_holds(case, rx.buffers, pages, dst)
        assert (rx.stats.committed, rx.stats.failed) == (1, 1)
    finally:
        rx.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
