"""What receiver.poll() returns, and the decode side's transfer counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_nsa_cp.disagg.commit import CoverageReport


@dataclass(frozen=True)
class Pending:
    request_id: int | str
    waiting_for_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Committed:
    request_id: int | str
    dst_pages: tuple[int, ...]  # decode page of each request position


@dataclass(frozen=True)
class Failed:
    request_id: int | str
    reason: str
    report: CoverageReport = CoverageReport()


@dataclass
class RankStats:
    requests: int = 0
    pages: int = 0
    nbytes: int = 0
    transfers: int = 0


@dataclass
class ReceiverStats:
    committed: int = 0
    failed: int = 0
    dropped: int = 0  # messages that did not decode, were not keyed right, or came unauthenticated
    per_rank: dict[int, RankStats] = field(default_factory=dict)  # from committed manifests
