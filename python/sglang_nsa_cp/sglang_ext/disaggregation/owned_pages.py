"""Owned-page bookkeeping for SGLang's Mooncake transfer: what a prefill CP rank owes and sent,
the manifest that rides on its status message, and the decode side's commit check.

Used by the hooks in `common/conn.py` and `mooncake/conn.py` (this package). No SGLang import:
the commit rule is `sglang_nsa_cp.disagg.commit.check_coverage`, the same as the standalone
owned-page protocol's (docs/disagg.md).

N = 2, a request whose page list (SGLang's `kv_to_page_indices`, logical page ids) is
[10, 11, 12, 13, 14, 15], sent in two chunks of 4 and 2 pages::

    position k         0   1   2   3   4   5
    logical page      10  11  12  13  14  15
    owner (p % 2)      0   1   0   1   0   1

    rank 0  expects   {0, 2, 4}   (from the unfiltered chunks, `expect_kv`)
            queues    {0, 2, 4}   local pages 5, 6, 7 (`queue_kv`, what reaches Mooncake's queue)
            index-K   {0, 2, 4}   of 6 state pages (`record_index`)
    finish(room) -> manifest {rank 0, cp 2, kv {total 6, positions [0,2,4], pages [10,12,14]},
                              index {total 6, positions [0,2,4], pages [10,12,14]}}, no problem

A rank that expects a page it did not queue (or queues one twice, or one of another owner)
reports Failed with the difference instead of Success (`finish` returns the problem). The decode
checks the union of all N manifests (`verify_manifests`): every position exactly once, each from
its owner, for the KV pages and for the index-K pages.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import numpy as np

from sglang_nsa_cp.disagg.commit import check_coverage
from sglang_nsa_cp.disagg.protocol import Manifest

# Frame appended to the prefill's Success status message (after the reason frame). A stock
# SGLang 0.5.23 decode reads frames [room, status, rank, reason] and ignores the rest.
MANIFEST_TAG = b"nsa-cp-owned-pages/1 "
_SHOWN = 16


def _show(items: Iterable) -> str:
    items = list(items)
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"[{', '.join(str(i) for i in items[:_SHOWN])}]{more}"


@dataclass
class _Pages:
    """Positions and logical page ids of one buffer kind (KV latent or index-K) of one request."""

    total: Optional[int] = None  # pages in the whole request, as this rank saw it
    positions: list = field(default_factory=list)
    pages: list = field(default_factory=list)

    def add(self, positions, pages) -> None:
        self.positions.extend(int(p) for p in positions)
        self.pages.extend(int(p) for p in pages)

    def as_dict(self) -> dict:
        return {"total": self.total, "positions": list(self.positions), "pages": list(self.pages)}


@dataclass
class _Room:
    expected_kv: _Pages = field(default_factory=_Pages)  # owned positions of the unfiltered chunks
    chunks: list = field(default_factory=list)  # (start, length) of every unfiltered chunk
    queued_kv: _Pages = field(default_factory=_Pages)  # what was handed to the transfer queue
    index_expected: bool = False  # the last chunk carried DSA state pages
    index: Optional[_Pages] = None  # owned index-K pages handed to the transfer (positions, pages)


class OwnedPageLedger:
    """Per prefill KV manager (one CP rank): per room, the pages this rank owes and sent.

    Written by the scheduler thread (`expect_kv`, `queue_kv`, `expect_index`) and the transfer
    worker threads (`record_index`, `finish`); a lock keeps them apart.
    """

    def __init__(self, rank: int, cp_size: int):
        if cp_size < 2 or not 0 <= rank < cp_size:
            raise ValueError(f"owned-page transfer needs 0 <= rank < cp_size and cp_size > 1, got {rank}/{cp_size}")
        self.rank, self.cp_size = rank, cp_size
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()

    def owned(self, logical_pages) -> np.ndarray:
        return np.asarray(logical_pages, dtype=np.int64) % self.cp_size == self.rank

    def expect_kv(self, room: int, start: int, logical_pages, total: int) -> None:
        """One unfiltered chunk: request positions start.. hold `logical_pages`."""
        pages = np.asarray(logical_pages, dtype=np.int64)
        mine = self.owned(pages)
        with self._lock:
            entry = self._rooms.setdefault(room, _Room())
            entry.expected_kv.total = int(total)
            entry.expected_kv.add(np.nonzero(mine)[0] + start, pages[mine])
            entry.chunks.append((int(start), len(pages)))

    def queue_kv(self, room: int, positions, local_pages) -> None:
        """Pages handed to the transfer queue: request positions and this rank's local page ids."""
        local = np.asarray(local_pages, dtype=np.int64)
        with self._lock:
            entry = self._rooms.setdefault(room, _Room())
            entry.queued_kv.add(np.asarray(positions, dtype=np.int64), local * self.cp_size + self.rank)

    def expect_index(self, room: int) -> None:
        with self._lock:
            self._rooms.setdefault(room, _Room()).index_expected = True

    def record_index(self, room: int, total: int, positions, logical_pages) -> None:
        """The owned index-K (DSA state) pages sent for the request. Idempotent: the same pages go
        to every decode destination of the request."""
        pages = _Pages(total=int(total))
        pages.add(positions, logical_pages)
        with self._lock:
            self._rooms.setdefault(room, _Room()).index = pages

    def drop(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def finish(self, room: int) -> tuple[Optional[dict], Optional[str]]:
        """Forget the room; return (manifest, problem). A problem means this rank must not report
        Success: it did not hand every page it owns to the transfer, exactly once."""
        with self._lock:
            entry = self._rooms.pop(room, None)
        if entry is None:
            return None, f"CP rank {self.rank} has no record of the pages it sent for room {room}"
        problems = []
        expected = dict(zip(entry.expected_kv.positions, entry.expected_kv.pages))
        queued: dict[int, int] = {}
        twice, foreign = [], []
        for position, page in zip(entry.queued_kv.positions, entry.queued_kv.pages):
            if position in queued:
                twice.append(position)
            queued[position] = page
            if page % self.cp_size != self.rank:
                foreign.append(position)
        missing = sorted(set(expected) - set(queued))
        extra = sorted(set(queued) - set(expected))
        moved = sorted(k for k in set(expected) & set(queued) if expected[k] != queued[k])
        if missing:
            problems.append(f"owned KV pages not sent at positions {_show(missing)}")
        if extra:
            problems.append(f"KV pages sent at positions it does not own {_show(extra)}")
        if twice:
            problems.append(f"KV pages sent twice at positions {_show(sorted(set(twice)))}")
        if moved or foreign:
            wrong = _show(sorted(set(moved + foreign)))
            problems.append(f"KV pages sent from the wrong local page at positions {wrong}")
        seen = sorted(entry.chunks)
        covered = seen[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(seen, seen[1:])) if seen else False
        if not covered or (seen and seen[-1][0] + seen[-1][1] != entry.expected_kv.total):
            problems.append(f"its chunks {seen} do not cover the request's {entry.expected_kv.total} pages")
        if entry.index_expected and entry.index is None:
            problems.append("its index-K pages were not sent")
        manifest = {
            "rank": self.rank,
            "cp_size": self.cp_size,
            "kv": {
                "total": entry.expected_kv.total,
                "positions": sorted(queued),
                "pages": [queued[k] for k in sorted(queued)],
            },
            "index": entry.index.as_dict() if entry.index is not None else None,
        }
        problem = None
        if problems:
            who = f"owned-page transfer of room {room}: CP rank {self.rank} of {self.cp_size}"
            problem = f"{who}: " + "; ".join(problems)
        return manifest, problem


# ---- the manifest on the wire ---------------------------------------------------------------------
def encode_manifest(manifest: dict) -> bytes:
    return MANIFEST_TAG + json.dumps(manifest, separators=(",", ":")).encode()


def _int_list(value, what) -> list:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what} must be a list of ints")
    return value


def _int(value, what) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return value


def _pages(value, what) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object")
    positions = _int_list(value.get("positions"), f"{what}.positions")
    pages = _int_list(value.get("pages"), f"{what}.pages")
    if len(positions) != len(pages):
        raise ValueError(f"{what} has {len(positions)} positions but {len(pages)} pages")
    return {"total": _int(value.get("total"), f"{what}.total"), "positions": positions, "pages": pages}


def decode_manifest(frame: bytes) -> dict:
    """Parse a manifest frame; ValueError names what is malformed."""
    if not frame.startswith(MANIFEST_TAG):
        raise ValueError("not an owned-page manifest frame")
    try:
        raw = json.loads(frame[len(MANIFEST_TAG) :])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"manifest is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("manifest must be a JSON object")
    manifest = {
        "rank": _int(raw.get("rank"), "rank"),
        "cp_size": _int(raw.get("cp_size"), "cp_size"),
        "kv": _pages(raw.get("kv"), "kv"),
        "index": _pages(raw.get("index"), "index"),
    }
    if manifest["kv"] is None:
        raise ValueError("manifest has no kv pages")
    return manifest


# ---- the decode side's commit check ---------------------------------------------------------------
def _coverage(kind: str, room: int, cp_size: int, by_rank: Mapping[int, dict]) -> list[str]:
    totals = {m[kind]["total"] for m in by_rank.values()}
    if len(totals) != 1:
        return [f"{kind} page counts differ between ranks {sorted(totals)}"]
    (total,) = totals
    manifests = {
        rank: Manifest(
            request_id=room,
            rank=rank,
            cp_size=cp_size,
            num_pages=total,
            positions=tuple(m[kind]["positions"]),
            logical_pages=tuple(m[kind]["pages"]),
            checksums=(),
            nbytes=0,
            num_transfers=0,
        )
        for rank, m in by_rank.items()
    }
    # Silent CP ranks are reported once by the caller, not per buffer kind.
    report = dataclasses.replace(check_coverage(total, cp_size, manifests), silent_ranks=())
    return [] if report.ok else [f"{'KV' if kind == 'kv' else 'index-K'} pages: {report.describe()}"]


def verify_manifests(room: int, manifests: Mapping[int, object], responders: Iterable[int]) -> Optional[str]:
    """The commit rule over every Success of a room (`manifests`: prefill unique rank -> decoded
    manifest, or the ValueError text of a malformed one). Returns the failure reason, or None.

    Checked: every responder sent a well-formed manifest; one manifest per CP rank, all CP ranks
    present and agreeing on cp_size and page counts; for the KV pages and (when sent) the index-K
    pages, every position exactly once, each from its owner (logical page % N == CP rank).
    """
    problems = []
    responders = sorted(set(responders))
    without = [r for r in responders if r not in manifests]
    if without:
        problems.append(f"prefill rank(s) {without} reported success without an owned-page manifest")
    by_rank: dict[int, dict] = {}
    for sender, manifest in sorted(manifests.items()):
        if isinstance(manifest, str):
            problems.append(f"malformed manifest from prefill rank {sender}: {manifest}")
            continue
        cp_rank = manifest["rank"]
        if manifest["cp_size"] > 0 and sender % manifest["cp_size"] != cp_rank:
            problems.append(f"prefill rank {sender} sent a manifest for CP rank {cp_rank}")
        if cp_rank in by_rank:
            problems.append(f"two manifests for CP rank {cp_rank}")
            continue
        by_rank[cp_rank] = manifest
    if by_rank:
        sizes = {m["cp_size"] for m in by_rank.values()}
        if len(sizes) != 1:
            problems.append(f"manifests disagree on the CP size {sorted(sizes)}")
        else:
            (cp_size,) = sizes
            silent = [r for r in range(cp_size) if r not in by_rank]
            if silent:
                problems.append(f"no manifest from CP rank(s) {silent} of {cp_size}")
            problems += _coverage("kv", room, cp_size, by_rank)
            with_index = [r for r, m in by_rank.items() if m["index"] is not None]
            if with_index and len(with_index) != len(by_rank):
                problems.append(f"index-K pages reported by CP ranks {sorted(with_index)} only")
            elif with_index:
                problems += _coverage("index", room, cp_size, by_rank)
    if not problems:
        return None
    return f"owned-page transfer of room {room} is incomplete: " + "; ".join(problems)
