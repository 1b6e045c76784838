"""Owned-page bookkeeping for SGLang's Mooncake transfer: what a prefill CP rank owes and sent,
the manifest that rides on its status message, and the decode side's commit check.

Used by the hooks in `common/conn.py` and `mooncake/conn.py` (this package). No SGLang import:
the manifest is the core's `disagg.manifest.PageClaims` (one per buffer kind) and the commit rule
`disagg.commit.check_coverage`, the same as the standalone transport's (docs/disagg.md).

N = 2, a request whose page list (SGLang's `kv_to_page_indices`, logical page ids) is
[10, 11, 12, 13, 14, 15], sent in two chunks of 4 and 2 pages::

    position k         0   1   2   3   4   5
    logical page      10  11  12  13  14  15
    owner (p % 2)      0   1   0   1   0   1

    rank 0  expects   {0, 2, 4}   (from the unfiltered chunks, `expect_kv`)
            queues    {0, 2, 4}   local pages 5, 6, 7 (`queue_kv`, what reaches Mooncake's queue)
            index-K   {0, 2, 4}   of 6 state pages (`record_index`)
    finish(room) -> RankClaims(kv=PageClaims(rank 0, cp 2, 6 pages, positions (0, 2, 4),
                                             logical pages (10, 12, 14)),
                               index=the same for the index-K pages), no problem
    on the wire: RoomManifest(room, kv, index), keyed to the room and the sending rank

A rank that expects a page it did not queue (or queues one twice, or one of another owner)
reports Failed with the difference instead of Success (`finish` returns the problem). The decode
checks the union of all N manifests (`verify_manifests`): every position exactly once, each from
its owner, for the KV pages and for the index-K pages.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import msgspec
import numpy as np
from msgspec import Struct

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.commit import check_coverage
from sglang_nsa_cp.disagg.manifest import MAX_REQUEST_PAGES, Int64, PageClaims, cut

# Frame appended to the prefill's Success status message (after the reason frame). A stock
# SGLang 0.5.23 decode reads frames [room, status, rank, reason] and ignores the rest.
MANIFEST_TAG = b"nsa-cp-owned-pages/4 "
# Frame appended to the decode's request metadata: the nonce of this use of the room, which the
# prefill puts into its manifests (a stock SGLang 0.5.23 prefill reads frames 0-9 and ignores it).
USE_NONCE_TAG = b"nsa-cp-use/1 "
USE_NONCE_BYTES = 16
MAX_USES = 1024  # decode destinations of one room (SGLang's required_dst_info_num: decode TP / prefill TP)
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

    def claims(self, rank: int, cp_size: int) -> PageClaims:
        return PageClaims(rank, cp_size, self.total, tuple(self.positions), tuple(self.pages))


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

    def finish(self, room: int) -> tuple[Optional[RankClaims], Optional[str]]:
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
        positions = sorted(queued)
        manifest = RankClaims(
            kv=PageClaims(
                self.rank, self.cp_size, entry.expected_kv.total, tuple(positions), tuple(queued[k] for k in positions)
            ),
            index=entry.index.claims(self.rank, self.cp_size) if entry.index is not None else None,
        )
        problem = None
        if problems:
            who = f"owned-page transfer of room {room}: CP rank {self.rank} of {self.cp_size}"
            problem = f"{who}: " + "; ".join(problems)
        return manifest, problem


# ---- the manifest on the wire ---------------------------------------------------------------------
class RankClaims(Struct, frozen=True, forbid_unknown_fields=True):
    """One CP rank's claims for one room: its KV latent pages and, with DSA state, its index-K
    pages (the same rank and CP size in both)."""

    kv: PageClaims
    index: Optional[PageClaims] = None

    @property
    def rank(self) -> int:
        return self.kv.rank

    @property
    def cp_size(self) -> int:
        return self.kv.cp_size


class RoomManifest(Struct, frozen=True, forbid_unknown_fields=True):
    """The body of a manifest frame: the claims, bound to their room and to the uses of it they
    answer (the nonces the room's decode destinations sent with their request metadata)."""

    room: Int64
    kv: PageClaims
    index: Optional[PageClaims] = None
    uses: tuple[bytes, ...] = ()


_DECODER = msgspec.msgpack.Decoder(RoomManifest)


def _label(room: int, prefill_rank: int) -> bytes:
    # The MAC binds a manifest to its room and to the rank whose status message carries it.
    return f"nsa-cp-owned-pages|{room}|{prefill_rank}".encode()


def pool_pages(kv_args) -> int:
    """Pages of a manager's largest KV buffer (SGLang's `KVArgs`), the most any request can take."""
    return max((n // max(i, 1) for n, i in zip(kv_args.kv_data_lens, kv_args.kv_item_lens)), default=0)


def max_manifest_bytes(num_pages: int, uses: int = 1) -> int:
    """The largest frame a manifest of a `num_pages`-page request with `uses` decode destinations
    needs: 4 lists of at most `num_pages` ints (9 msgpack bytes each at most), a nonce of 18
    msgpack bytes per destination, the MAC and a few hundred bytes."""
    return 1024 + 36 * min(num_pages, MAX_REQUEST_PAGES) + (USE_NONCE_BYTES + 2) * min(uses, MAX_USES)


def encode_manifest(
    claims: RankClaims, room: int, prefill_rank: int, secret: Optional[bytes], uses: Iterable[bytes] = ()
) -> bytes:
    """TAG | MAC length (0 or 32) | MAC | msgpack(RoomManifest); the MAC keyed with `secret`."""
    manifest = RoomManifest(room=room, kv=claims.kv, index=claims.index, uses=tuple(sorted(uses)))
    body = msgspec.msgpack.encode(manifest)
    mac = auth.sign(secret, _label(room, prefill_rank), body)
    return MANIFEST_TAG + bytes([len(mac)]) + mac + body


class UnauthenticatedManifest(ValueError):
    """A manifest frame that did not get as far as a valid MAC (size, shape or key)."""


class ManifestOfAnotherUse(UnauthenticatedManifest):
    """A manifest that does not answer this use of the room (a replay, or a late status of an
    earlier use): not this room's business, dropped as if never sent."""


class ManifestWithoutUse(ManifestOfAnotherUse):
    """A manifest that answers no use at all: the prefill rank held no nonce from this decode for
    the room (not a replay: its metadata never reached that rank, or the rank's bound evicted it)."""


NO_USE_HELD = (
    "the prefill rank held no use nonce from this decode for the room (its request metadata did not reach "
    "that rank, or the rank's bound of noted rooms evicted it)"
)


def decode_manifest(
    frame: bytes,
    *,
    room: int,
    prefill_rank: int,
    secret: Optional[bytes],
    max_pages: int,
    use: Optional[bytes] = None,
    max_uses: int = 1,
) -> RankClaims:
    """The claims in `frame`; ValueError (bounded text) names what is wrong,
    UnauthenticatedManifest when the frame fails before its MAC checked out, ManifestOfAnotherUse
    when it does not list `use` (this decode's nonce for the room). The frame's size is checked
    against `max_pages` and `max_uses` (the decode's own request: its pages and destinations) and
    its MAC before anything parses it."""
    if not frame.startswith(MANIFEST_TAG):
        raise UnauthenticatedManifest("not an owned-page manifest frame")
    limit = max_manifest_bytes(max_pages, max_uses)
    if len(frame) > limit:
        raise UnauthenticatedManifest(
            f"a manifest frame of {len(frame)} B, more than the {limit} B a request of {max_pages} pages "
            f"and {max_uses} decode destination(s) needs"
        )
    head = len(MANIFEST_TAG)
    mac_len = frame[head] if len(frame) > head else -1
    if mac_len not in (0, auth.MAC_BYTES):
        raise UnauthenticatedManifest(
            f"a manifest frame whose MAC is {mac_len} B long (0 or {auth.MAC_BYTES} expected)"
        )
    mac, body = frame[head + 1 : head + 1 + mac_len], frame[head + 1 + mac_len :]
    if (problem := auth.verify(secret, _label(room, prefill_rank), body, mac)) is not None:
        raise UnauthenticatedManifest(f"manifest: {problem}")
    try:
        m = _DECODER.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(cut(f"malformed manifest: {e}", 300)) from None
    if m.room != room:
        raise ValueError(f"a manifest of room {m.room} in a status message of room {room}")
    if use is not None and not m.uses:
        raise ManifestWithoutUse(f"a manifest of room {room} that answers no use of the room: {NO_USE_HELD}")
    if use is not None and use not in m.uses:
        raise ManifestOfAnotherUse(f"a manifest of room {room} that answers another use of the room")
    for claims in (m.kv, m.index):
        if claims is not None and (problem := claims.shape_problem(with_checksums=False)) is not None:
            raise ValueError(f"a malformed manifest: {problem}")
    if m.index is not None and (m.index.rank, m.index.cp_size) != (m.kv.rank, m.kv.cp_size):
        raise ValueError(
            f"a manifest whose index-K pages come from CP rank {m.index.rank} of {m.index.cp_size}, "
            f"its KV pages from CP rank {m.kv.rank} of {m.kv.cp_size}"
        )
    return RankClaims(kv=m.kv, index=m.index)


# ---- the decode side's commit check ---------------------------------------------------------------
@dataclass(frozen=True)
class RoomExpectation:
    """What the decode itself asked for in a room (`send_metadata`), which bounds every claim."""

    kv_pages: int  # destination pages of the KV latent
    index_pages: Optional[int]  # destination pages of the index-K (DSA state); None if none sent
    cp_size: int  # the prefill CP size the decode targets
    prefill_ranks: Optional[tuple[int, ...]] = None  # unique ranks it sent its metadata to (None: unknown)
    uses: int = 1  # decode destinations of the room (SGLang's required_dst_info_num), each with a nonce
    owner_sharded: bool = True  # its prefill advertises owner-sharded pages at CP > 1 (a shared-KV prefill's)

    @property
    def max_pages(self) -> int:
        return max(self.kv_pages, self.index_pages or 0)


def _coverage(kind: str, total: int, cp_size: int, by_rank: Mapping[int, RankClaims]) -> list[str]:
    name = "KV" if kind == "kv" else "index-K"
    claims = {rank: getattr(m, kind) for rank, m in by_rank.items()}
    claimed = {rank: c.num_pages for rank, c in claims.items() if c.num_pages != total}
    if claimed:
        return [f"{name} page counts {claimed} (by CP rank) differ from the {total} the decode asked for"]
    # Silent CP ranks are reported once by the caller, not per buffer kind.
    report = dataclasses.replace(check_coverage(total, cp_size, claims), silent_ranks=())
    return [] if report.ok else [f"{name} pages: {report.describe()}"]


def verify_manifests(
    room: int, manifests: Mapping[int, object], responders: Iterable[int], expected: RoomExpectation
) -> Optional[str]:
    """The commit rule over every Success of a room (`manifests`: prefill unique rank -> decoded
    manifest, or the ValueError text of a malformed one). Returns the failure reason, or None.

    Checked against the decode's own request (`expected`), never against what a prefill claims:
    every responder sent a well-formed manifest; one manifest per CP rank of the CP size the
    decode targets, all present; for the KV pages and the index-K pages, page counts equal to the
    decode's destination counts and every position exactly once, each from its owner
    (logical page % N == CP rank).
    """
    problems = []
    responders = sorted(set(responders))
    without = [r for r in responders if r not in manifests]
    if without:
        problems.append(f"prefill rank(s) {without} reported success without an owned-page manifest")
    by_rank: dict[int, RankClaims] = {}
    cp_size = expected.cp_size
    for sender, manifest in sorted(manifests.items()):
        if isinstance(manifest, str):
            problems.append(f"malformed manifest from prefill rank {sender}: {manifest}")
            continue
        cp_rank = manifest.rank
        if manifest.cp_size != cp_size:
            problems.append(
                f"prefill rank {sender} claims a CP group of {manifest.cp_size}; the decode targets {cp_size}"
            )
            continue
        if sender % cp_size != cp_rank:
            problems.append(f"prefill rank {sender} sent a manifest for CP rank {cp_rank}")
        if cp_rank in by_rank:
            problems.append(f"two manifests for CP rank {cp_rank}")
            continue
        by_rank[cp_rank] = manifest
    if by_rank:
        silent = [r for r in range(cp_size) if r not in by_rank]
        if silent:
            problems.append(f"no manifest from CP rank(s) {_show(silent)} of {cp_size}")
        problems += _coverage("kv", expected.kv_pages, cp_size, by_rank)
        with_index = sorted(r for r, m in by_rank.items() if m.index is not None)
        if expected.index_pages is None and with_index:
            problems.append(f"index-K pages reported by CP ranks {_show(with_index)}; the decode asked for none")
        elif expected.index_pages is not None and len(with_index) != len(by_rank):
            problems.append(f"index-K pages reported by CP ranks {_show(with_index)} only")
        elif with_index:
            problems += _coverage("index", expected.index_pages, cp_size, by_rank)
    if not problems:
        return None
    return f"owned-page transfer of room {room} is incomplete: " + "; ".join(problems)
