"""The decode receiver's bookkeeping of transfers, without sockets or threads (receiver.py holds the
lock around every call and sends what `outbox` collects).

One *use* of a request id is (request_id, nonce). Its life, N = 2::

    expect(r, nonce, 4 pages)      Pending, pages 40..43 taken; the ready deadline runs
    want from rank 0 (r, nonce)    "ready": the transfer deadline starts (timeout_s)
                                   -> dest [40..43] to rank 0; rank 0 is *given* the pages
    want from rank 1               -> dest to rank 1
    manifest 0, manifest 1         all N in: coverage (commit.py), then checksums off the lock
                                   -> Committed, or Failed with the reason

Messages of a use nobody expected yet wait in `early` (bounded, keyed by use, one want and one
report per rank) and are replayed by expect(); an earlier use of the same id has another nonce, so
its messages never touch this one. A failed use's pages are *fenced*: they go back to the
allocator only when every rank that was given them has reported (manifest, or an abort saying
nothing is in flight) or is declared dead (its connection closed: receiver.py probes it with the
`cancel` it resends), never on a timer::

    fail(r)   given {0, 1}, reported {0}   fence {1}; cancel -> rank 1
    abort from rank 1 (drained)            fence empty -> pages 40..43 free
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from sglang_nsa_cp.disagg.commit import CoverageReport, check_coverage, find_corrupt
from sglang_nsa_cp.layout.ownership import OutOfPages, OwnerClassedAllocator
from sglang_nsa_cp.pd import protocol
from sglang_nsa_cp.pd.protocol import Abort, Cancel, Dest, Manifest, Reject, Want
from sglang_nsa_cp.pd.status import Committed, Failed, Pending, RankStats, ReceiverStats

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Use:
    request_id: int | str
    nonce: int
    num_pages: int
    cp_size: int
    dst_pages: list[int]
    expected_at: float
    status: Pending | Committed | Failed
    deadline: float | None = None  # transfer deadline, from the first ready message
    verifying: bool = False
    manifests: dict = field(default_factory=dict)  # rank -> Manifest
    given: dict = field(default_factory=dict)  # rank -> identity, ranks handed the pages
    reported: set = field(default_factory=set)  # ranks with nothing in flight any more

    def claims(self) -> dict:
        """rank -> the PageClaims of its manifest: what the commit rule judges."""
        return {rank: m.claims for rank, m in self.manifests.items()}


@dataclass(eq=False)
class Early:
    since: float
    messages: dict = field(default_factory=dict)  # (rank, "want" | "report") -> (identity, msg)


@dataclass(eq=False)
class Fence:
    pages: list[int]
    waiting: dict  # rank -> identity, given the pages and not reported
    reason: str
    undrained: set = field(default_factory=set)  # aborted with a write maybe in flight: death only


class TransferTable:
    def __init__(
        self,
        allocator: OwnerClassedAllocator,
        stats: ReceiverStats,
        *,
        timeout_s: float,
        ready_timeout_s: float,
        max_early: int,
        epoch: int,
    ):
        self.allocator, self.stats = allocator, stats
        self.timeout_s, self.ready_timeout_s, self.max_early, self.epoch = (
            timeout_s,
            ready_timeout_s,
            max_early,
            epoch,
        )
        self.uses: dict[int | str, Use] = {}
        self.early: OrderedDict[tuple, Early] = OrderedDict()
        self.fences: dict[tuple, Fence] = {}
        self.outbox: list[tuple[bytes, protocol._Msg]] = []
        self.to_verify: list[Use] = []
        self._early_full = False

    @property
    def num_fenced_pages(self) -> int:
        return sum(len(f.pages) for f in self.fences.values())

    # ---- the decode's calls ---------------------------------------------------------------------

    def expect(self, request_id, nonce: int, num_pages: int, cp_size: int, now: float) -> list[int]:
        if request_id in self.uses:
            raise ValueError(f"request {request_id!r} is already expected; release it first")
        try:
            dst_pages = self.allocator.alloc([0] * num_pages)  # one owner class: the decode has no CP
        except OutOfPages as e:
            raise OutOfPages(
                f"decode pool: {e}; {self.num_fenced_pages} more are fenced by {len(self.fences)} failed "
                "request(s) until their ranks acknowledge the cancel or their connections close"
            ) from None
        use = Use(request_id, nonce, num_pages, cp_size, dst_pages, now, Pending(request_id, tuple(range(cp_size))))
        self.uses[request_id] = use
        early = self.early.pop((request_id, nonce), None)
        for (rank, _), (identity, msg) in sorted(
            (early.messages if early else {}).items(), key=lambda kv: kv[0][1] != "want"
        ):
            if isinstance(msg, Want):
                self.on_want(identity, rank, msg, now)
            else:
                self.on_report(identity, rank, msg, now)
        return list(dst_pages)

    def release(self, request_id, now: float) -> None:
        use = self.uses.get(request_id)
        if use is None:
            raise KeyError(f"unknown request {request_id!r}: never expected, or released")
        if isinstance(use.status, Pending):
            self.fail(use, "cancelled by the decode side")
        elif isinstance(use.status, Committed):
            self.allocator.free(use.dst_pages)
        del self.uses[request_id]
        # Messages held for this id that came before this use are stale: drop them.
        for key in [
            k for k, e in self.early.items() if k[0] == request_id and (k[1] == use.nonce or e.since < use.expected_at)
        ]:
            self.early.pop(key)

    def status(self, request_id):
        use = self.uses.get(request_id)
        if use is None:
            raise KeyError(f"unknown request {request_id!r}: never expected, or released")
        if isinstance(use.status, Pending):
            use.status = Pending(request_id, tuple(r for r in range(use.cp_size) if r not in use.manifests))
        return use.status

    # ---- messages from authenticated prefill ranks ----------------------------------------------

    def on_want(self, identity: bytes, rank: int, want: Want, now: float) -> None:
        use = self._use_of(want)
        if use is None:
            key = (want.request_id, want.nonce)
            if key in self.fences:
                self._reject(identity, want, f"the request failed: {self.fences[key].reason}")
            else:
                self._hold(identity, rank, want, "want", now)
            return
        if not isinstance(use.status, Pending) or use.verifying:
            self._reject(identity, want, _status_text(use.status))
            return
        if (problem := _check_want(use, rank, want)) is not None:
            self.fail(use, problem)
            self._reject(identity, want, problem)
            return
        self._start(use, now)
        pages = use.dst_pages if want.num_owned else []
        if pages:
            use.given[rank] = identity
        self.outbox.append((identity, Dest(use.request_id, use.nonce, self.epoch, tuple(pages))))

    def on_report(self, identity: bytes, rank: int, msg: Manifest | Abort, now: float) -> None:
        key = (msg.request_id, msg.nonce)
        if isinstance(msg, Manifest) and msg.claims.rank != rank:
            logger.warning(
                "dropping a manifest for rank %d from the connection of rank %d (request %r)",
                msg.claims.rank,
                rank,
                msg.request_id,
            )
            return
        if key in self.fences:
            self._acknowledge(key, rank, msg)
            return
        use = self._use_of(msg)
        if use is None:
            self._hold(identity, rank, msg, "report", now)
            return
        if not isinstance(use.status, Pending):
            logger.info(
                "ignoring a %s for request %r: %s", type(msg).__name__.lower(), use.request_id, _status_text(use.status)
            )
            return
        self._start(use, now)
        if isinstance(msg, Abort):
            if msg.drained:
                use.reported.add(rank)
            self.fail(use, f"rank {rank} aborted: {msg.reason}", undrained={rank} - use.reported)
            return
        if (problem := _check_manifest(use, rank, msg)) is not None:
            self.fail(use, problem)
            return
        use.manifests[rank] = msg
        use.reported.add(rank)
        if len(use.manifests) == use.cp_size:
            report = check_coverage(use.num_pages, use.cp_size, use.claims())
            if not report.ok:
                self.fail(use, report.describe(), report=report)
            else:
                use.verifying = True  # checksums next, off the lock (receiver.py)
                self.to_verify.append(use)

    def finish_verify(self, use: Use, landed: list[int]) -> None:
        """The checksums of `use`'s destination pages, computed without the lock."""
        if self.uses.get(use.request_id) is not use or not use.verifying:
            return  # released or failed meanwhile
        use.verifying = False
        corrupt = find_corrupt(use.claims(), landed)
        if corrupt:
            report = CoverageReport(corrupt=corrupt)
            self.fail(use, report.describe(), report=report)
            return
        use.status = Committed(use.request_id, tuple(use.dst_pages))
        self.stats.committed += 1
        for rank, manifest in use.manifests.items():
            stats = self.stats.per_rank.setdefault(rank, RankStats())
            stats.requests += 1
            stats.pages += len(manifest.claims.positions)
            stats.nbytes += manifest.nbytes
            stats.transfers += manifest.num_transfers

    # ---- failure, fences, time ------------------------------------------------------------------

    def fail(self, use: Use, reason: str, report: CoverageReport = CoverageReport(), undrained=()) -> None:
        use.status = Failed(use.request_id, protocol.cut(reason), report)
        use.verifying = False
        self.stats.failed += 1
        waiting = {r: ident for r, ident in use.given.items() if r not in use.reported}
        logger.warning("request %r failed: %s", use.request_id, protocol.cut(reason, 500))
        if not waiting:
            self.allocator.free(use.dst_pages)
            return
        fence = Fence(use.dst_pages, waiting, protocol.cut(reason, 500), set(undrained))
        self.fences[(use.request_id, use.nonce)] = fence
        for identity in waiting.values():
            self.outbox.append((identity, Cancel(use.request_id, use.nonce, fence.reason)))

    def expire(self, now: float) -> None:
        for use in list(self.uses.values()):
            if not isinstance(use.status, Pending) or use.verifying:
                continue
            if use.deadline is not None and now >= use.deadline:
                report = check_coverage(use.num_pages, use.cp_size, use.claims())
                self.fail(use, f"timed out after {self.timeout_s} s: {report.describe()}", report=report)
            elif use.deadline is None and now >= use.expected_at + self.ready_timeout_s:
                self.fail(use, f"no prefill rank said it was ready within {self.ready_timeout_s} s of expect()")
        while self.early:
            key, early = next(iter(self.early.items()))
            if now - early.since < self.ready_timeout_s:
                break
            del self.early[key]
            for (_, kind), (identity, msg) in early.messages.items():
                if kind == "want":
                    self._reject(
                        identity, msg, f"the decode did not expect this request within {self.ready_timeout_s} s"
                    )

    def probes(self) -> list[tuple[bytes, Cancel, tuple, int]]:
        """A cancel for every rank a fence waits for; receiver.py declares a rank dead when its
        connection cannot be reached any more."""
        return [
            (identity, Cancel(key[0], key[1], fence.reason), key, rank)
            for key, fence in self.fences.items()
            for rank, identity in fence.waiting.items()
        ]

    def declare_dead(self, key: tuple, rank: int) -> None:
        fence = self.fences.get(key)
        if fence is None or fence.waiting.pop(rank, None) is None:
            return
        logger.warning(
            "rank %d of request %r is declared dead (its connection to the decode is "
            "closed); its %d fenced pages no longer wait for it",
            rank,
            key[0],
            len(fence.pages),
        )
        self._maybe_unfence(key)

    # ---- helpers -------------------------------------------------------------------------------

    def _use_of(self, msg) -> Use | None:
        use = self.uses.get(msg.request_id)
        return use if use is not None and use.nonce == msg.nonce else None

    def _start(self, use: Use, now: float) -> None:
        if use.deadline is None:
            use.deadline = now + self.timeout_s

    def _hold(self, identity: bytes, rank: int, msg, kind: str, now: float) -> None:
        key = (msg.request_id, msg.nonce)
        early = self.early.get(key)
        if early is None:
            if len(self.early) >= self.max_early:
                self.stats.dropped += 1
                if not self._early_full:  # once per episode: a flood must not flood the log too
                    self._early_full = True
                    logger.warning(
                        "dropping messages of requests the decode has not expected: %d already "
                        "wait for expect() (max_early); the first was a %s for request %r",
                        self.max_early,
                        kind,
                        msg.request_id,
                    )
                if kind == "want":
                    self._reject(
                        identity,
                        msg,
                        f"the decode holds {self.max_early} requests it has not expected yet; retry later",
                        code="busy",
                    )
                return
            early = self.early[key] = Early(now)
            self._early_full = False
        early.messages[(rank, kind)] = (identity, msg)  # a repeat replaces the earlier one

    def _acknowledge(self, key: tuple, rank: int, msg) -> None:
        fence = self.fences[key]
        if rank not in fence.waiting:
            return
        if isinstance(msg, Abort) and not msg.drained:
            fence.undrained.add(rank)  # only its death frees the pages now
            return
        if rank in fence.undrained:
            return
        del fence.waiting[rank]
        self._maybe_unfence(key)

    def _maybe_unfence(self, key: tuple) -> None:
        fence = self.fences[key]
        if not fence.waiting:
            del self.fences[key]
            self.allocator.free(fence.pages)

    def _reject(self, identity: bytes, msg, reason: str, code: str = "request") -> None:
        self.outbox.append((identity, Reject(code, protocol.cut(reason), msg.request_id, msg.nonce)))


def _check_want(use: Use, rank: int, want: Want) -> str | None:
    if want.cp_size != use.cp_size or want.num_pages != use.num_pages:
        return (
            f"rank {rank} asked for a request of {want.num_pages} pages from a CP group of "
            f"{want.cp_size}; the decode expected {use.num_pages} pages from {use.cp_size}"
        )
    if rank >= use.cp_size or want.num_owned > use.num_pages:
        return f"rank {rank} owning {want.num_owned} pages does not fit a CP group of {use.cp_size}"
    return None


def _check_manifest(use: Use, rank: int, manifest: Manifest) -> str | None:
    m = manifest.claims
    if m.cp_size != use.cp_size or m.num_pages != use.num_pages:
        return (
            f"rank {rank} reports a request of {m.num_pages} pages from a CP group of "
            f"{m.cp_size}; the decode expected {use.num_pages} pages from {use.cp_size}"
        )
    if rank >= use.cp_size:
        return f"manifest from rank {rank}, outside ranks 0..{use.cp_size - 1}"
    if rank in use.manifests:
        return f"rank {rank} sent two manifests"
    if (problem := m.shape_problem(with_checksums=True)) is not None:
        return f"manifest of rank {rank}: {problem}"
    return None


def _status_text(status) -> str:
    if isinstance(status, Failed):
        return f"the request already failed: {status.reason}"
    if isinstance(status, Committed):
        return "the request is already committed"
    return "the request is being verified"
