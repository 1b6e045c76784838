"""What SGLang's decode thread may see: every message on a decode's status socket is checked
before SGLang parses it (`guard_recv`, installed by `OwnedPageKVManager._make_worker_recv`), and
the status signature a keyed shared-KV prefill adds. SGLang dispatches on frame 0 and trusts the
rest (docs/upstream.md, item 7)::

    frame 0        SGLang's handler                what an unchecked peer could do
    AUX_DATA       _handle_aux_data                write at any aux index; a non-number ends the thread
    CHUNK_READY    handle_chunk_ready              (staging) scatter any page range
    STAGING_REQ    _handle_staging_req             no staging: an assert ends the thread
    ABORT_ACK      handle_abort_ack_message        (parsed safely)
    anything else  parse_kv_status_message         [room, status, rank, reason?, manifest?, signature?]

A message with a problem is dropped as if never sent and logged at most once per 10 s
(`DropLog`; a late status of a room no longer waiting only at debug level, as SGLang does; the
last drop of a waiting room goes into its timeout's reason). A status is parsed once, here, and
a Success's manifest decoded (its MAC checked) once: the result rides on the message
(`CheckedStatus`) to the plugin's `parse_kv_status_message`. Only the guard's own problems
(`MessageProblem`) drop a message; any other exception is a fault of the guard: counted
(`DropLog.faults`), logged once per room, and the message handed to SGLang unchecked
(`Unchecked`), as SGLang would handle it. A status counts only for a waiting
room, from a prefill rank the room targeted, and only if SGLang acts on it (Success, Failed, and
WaitingForInput under deferred allocation; the rest it would only log). With
SGLANG_NSA_CP_PD_SECRET, in a room whose prefill is owner-sharded at CP > 1 (`keyed_room`), a
Success must carry a valid manifest and any other status a valid `sign_status` signature, both
bound to this use of the room; a room of a replicated or non-CP prefill is SGLang's, unsigned. Not authenticated (shape and bounds
only): ABORT_ACK, AUX_DATA at its own room's slot, and with staging CHUNK_READY and STAGING_REQ.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import deque
from dataclasses import dataclass

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.manifest import cut
from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import (
    MANIFEST_TAG,
    MAX_USES,
    NO_USE_HELD,
    USE_NONCE_BYTES,
    ManifestOfAnotherUse,
    ManifestWithoutUse,
    UnauthenticatedManifest,
    decode_manifest,
    pool_pages,
)

logger = logging.getLogger(__name__)

# Frame 0 of the messages SGLang's decode thread handles before statuses (its constants:
# MooncakeKVManager.AUX_DATA_HEADER, common.conn.ABORT_ACK_TAG, the staging literals).
AUX_DATA, CHUNK_READY, STAGING_REQ, ABORT_ACK = b"AUX_DATA", b"CHUNK_READY", b"STAGING_REQ", b"ABORT_ACK"
# Last frame of a keyed non-Success status: TAG | MAC | the use nonces it answers.
STATUS_SIGNATURE_TAG = b"nsa-cp-status/1 "

ROOMS = 1 << 63  # SGLang's bootstrap rooms are 63-bit
PREFILL_RANKS = 1 << 16  # unique ranks (tp x pp x cp) of one prefill instance, with room to spare
MAX_DIGITS = 20
MAX_ID_BYTES = 256  # a staging writer or session id
MAX_REASON_BYTES = 16 << 10  # SGLang's and the plugin's reasons are a few hundred bytes
STATUS_NAMES = {getattr(KVPoll, name): name for name in vars(KVPoll) if not name.startswith("_")}
SUCCESS, FAILED, WAITING = KVPoll.Success, KVPoll.Failed, KVPoll.WaitingForInput


class _Drop(Exception):
    """Why a message must not reach SGLang (raised by the checks below)."""

    def __init__(self, reason: str, late: bool = False):
        super().__init__(reason)
        self.late = late


class LateStatus(str):
    """The problem of a status for a room not waiting on this decode: also what a real rank's
    status looks like after its room failed or was cleared, so it is logged at debug level only,
    as SGLang logs it."""


SHOWN_BYTES = 8  # of a frame that is not a short decimal: its size and this many leading bytes in hex


def _show(frame) -> str:
    """A frame as the guard's texts name it: a short decimal as itself, anything else by its size
    and first SHOWN_BYTES bytes in hex, never as text: these texts reach the log and, through
    the room's last drop, the reason a timed-out room returns to its client, and the peer is not
    authenticated. Only the shown bytes are read (a repr of a 1 MiB frame cost ~10 ms)."""
    if isinstance(frame, bytes) and len(frame) <= MAX_DIGITS and frame.isdigit():
        return frame.decode()
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        return f"<a {type(frame).__name__}>"
    more = "..." if len(frame) > SHOWN_BYTES else ""
    return f"<{len(frame)} B {bytes(frame[:SHOWN_BYTES]).hex()}{more}>"


def _frames(msg, what: str, low: int, high: int) -> None:
    if not low <= len(msg) <= high:
        want = low if low == high else f"{low} to {high}"
        raise _Drop(f"{what} of {len(msg)} frames ({want} expected)")


def _number(frame: bytes, what: str, below: int) -> int:
    """A decimal in 0..below-1: ASCII digits only (`int` would take '-1', ' 7', '1_0', '٣'). The
    length is checked first: a digit scan of a 1 MiB frame cost the decode thread ~0.9 ms."""
    if len(frame) > MAX_DIGITS:
        raise _Drop(f"{what} of {len(frame)} bytes (at most {MAX_DIGITS} digits)")
    if not frame.isdigit():
        raise _Drop(f"{what} {_show(frame)} is not a decimal number")
    value = int(frame)
    if value >= below:
        raise _Drop(f"{what} {value} is out of range (0..{below - 1})")
    return value


def _short_text(frame: bytes, what: str) -> None:
    if not (len(frame) <= MAX_ID_BYTES and frame.isascii()):
        raise _Drop(f"{what} {_show(frame)} is not short ASCII text")


# ---- the kinds SGLang's decode thread dispatches ---------------------------------------------------
def _aux_data(mgr, msg) -> None:
    """[AUX_DATA, room, buffer index, aux index, >I length, data] (`send_aux_data_to_endpoint`),
    which SGLang writes at aux_data_ptrs[buffer] + aux_item_lens[buffer] * aux index."""
    _frames(msg, "AUX_DATA", 6, 6)
    args = mgr.kv_args
    room = _number(msg[1], "room", ROOMS)
    buffer = _number(msg[2], "aux buffer index", len(args.aux_data_ptrs))
    item_len = args.aux_item_lens[buffer]
    slot = _number(msg[3], "aux index", args.aux_data_lens[buffer] // max(item_len, 1))
    if len(msg[4]) != 4:
        raise _Drop(f"a data length frame of {len(msg[4])} bytes (4 expected)")
    (declared,) = struct.unpack(">I", msg[4])
    if declared != len(msg[5]):
        raise _Drop(f"{len(msg[5])} data bytes, {declared} declared")
    if len(msg[5]) > item_len:
        raise _Drop(f"{len(msg[5])} data bytes for an aux slot of {item_len}")
    given = mgr.room_aux_indices.get(room)
    if given is None:
        raise _Drop(f"AUX_DATA for room {room}, which this decode gave no aux index")
    if slot != given:
        raise _Drop(f"aux index {slot}; this decode gave room {room} aux index {given}")


def _room_pages(mgr, room: int) -> int:
    """Pages the decode asked for in `room`, else (no record) pages of its pool."""
    expected = mgr.room_expectations.get(room)
    return expected.kv_pages if expected is not None else pool_pages(mgr.kv_args)


def _staging_on(mgr, what: str) -> None:
    if not mgr.enable_staging:
        raise _Drop(f"{what} on a decode without staging")
    if mgr._staging_handler is None:
        raise _Drop(f"{what} before this decode's staging handler exists")  # SGLang asserts


def _staging_room(mgr, msg, what: str) -> tuple[int, int]:
    room = _number(msg[1], "room", ROOMS)
    if room not in mgr.request_status:
        raise _Drop(f"{what} for room {room}, which is not waiting on this decode")
    return room, _room_pages(mgr, room)


def _chunk_ready(mgr, msg) -> None:
    """[CHUNK_READY, room, chunk, page start, pages, writer id, prefill rank] (`send_chunk_ready`)."""
    _staging_on(mgr, "CHUNK_READY")
    _frames(msg, "CHUNK_READY", 7, 7)
    room, pages = _staging_room(mgr, msg, "CHUNK_READY")
    _number(msg[2], "chunk index", max(pages, 1))
    start = _number(msg[3], "page start", max(pages, 1))
    count = _number(msg[4], "page count", pages + 1)
    if start + count > pages:
        raise _Drop(f"pages {start}..{start + count - 1} of room {room}, which has {pages}")
    _short_text(msg[5], "writer id")
    _number(msg[6], "prefill rank", PREFILL_RANKS)


def _staging_req(mgr, msg) -> None:
    """[STAGING_REQ, room, chunk, pages, session id, pp rank?] (`prefetch_staging_reqs`)."""
    _staging_on(mgr, "STAGING_REQ")
    _frames(msg, "STAGING_REQ", 5, 6)
    room, pages = _staging_room(mgr, msg, "STAGING_REQ")
    _number(msg[2], "chunk index", max(pages, 1))
    _number(msg[3], "page count", pages + 1)
    _short_text(msg[4], "session id")
    if len(msg) > 5:
        _number(msg[5], "pp rank", PREFILL_RANKS)


def _abort_ack(mgr, msg) -> None:
    """[ABORT_ACK, room, prefill rank, generation?] (`AbortAck.to_zmq`), which SGLang counts only
    for the generation of a room it holds for an abort (`note_abort_ack`)."""
    _frames(msg, "ABORT_ACK", 3, 4)
    room = _number(msg[1], "room", ROOMS)
    _number(msg[2], "prefill rank", PREFILL_RANKS)
    generation = _number(msg[3], "generation", 1 << 63) if len(msg) > 3 else None
    held = mgr._deferred_abort_ack_tracker.get(room)
    if held is None or generation != held.generation:
        # also what a real rank's ack looks like after SGLang released the room: debug level only
        raise _Drop(f"ABORT_ACK of generation {generation} for room {room}, which this decode does not hold for "
                    "that abort", late=True)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Status:
    """The guard's one parse of a status message that may reach SGLang, handed on to
    `parse_kv_status_message` (`CheckedStatus`). `manifest`: for a Success in a room this decode
    asked for, the manifest decoded once (`RankClaims`), or the text of what is wrong with it
    (the room's failure reason later); None without a manifest frame."""

    room: int
    status: int
    prefill_rank: int
    reason: bytes
    manifest: object = None

    def sglang_tuple(self) -> tuple[int, int, int, str | None]:
        """What SGLang's `parse_kv_status_message` returns for the message (its reason decoding)."""
        reason = self.reason.decode("utf-8", errors="replace") if self.reason else None
        return self.room, self.status, self.prefill_rank, reason


def _status(mgr, msg) -> Status:
    """[room, status, prefill rank, reason?, manifest?, status signature?]."""
    body = msg
    if mgr.kv_status_msg_tag is not None:
        if msg[0] != mgr.kv_status_msg_tag:
            raise _Drop("an untagged message")
        body = msg[1:]
    _frames(body, "a status", 3, 6)
    room = _number(body[0], "room", ROOMS)
    status = _number(body[1], "status", 1 << 8)
    if status not in STATUS_NAMES:
        raise _Drop(f"status {status} is not a KVPoll value")
    rank = _number(body[2], "prefill rank", PREFILL_RANKS)
    reason = body[3] if len(body) > 3 else b""
    if len(reason) > MAX_REASON_BYTES:
        raise _Drop(f"a failure reason of {len(reason)} bytes (at most {MAX_REASON_BYTES})")
    extra = list(body[4:])
    manifest = extra.pop(0) if extra and extra[0].startswith(MANIFEST_TAG) else None
    signature = extra.pop() if extra and extra[-1].startswith(STATUS_SIGNATURE_TAG) else None
    if extra:
        raise _Drop(f"a status frame {_show(extra[0])} that is neither a manifest nor a status signature")
    name = STATUS_NAMES[status]
    if manifest is not None and status != SUCCESS:
        raise _Drop(f"a manifest on a {name} status")
    if room not in mgr.request_status:
        raise _Drop(f"a {name} status for room {room}, which is not waiting on this decode", late=True)
    if status not in (SUCCESS, FAILED) and not (status == WAITING and mgr.defer_decode_allocation):
        raise _Drop(f"a {name} status, which SGLang's decode would only log (it acts on Success and Failed)")
    expected = mgr.room_expectations.get(room)
    if expected is not None and expected.prefill_ranks is not None and rank not in expected.prefill_ranks:
        raise _Drop(
            f"a {name} status from prefill rank {rank}; room {room} targets prefill ranks {list(expected.prefill_ranks)}"
        )
    keyed = keyed_room(mgr, room)
    if keyed:
        _authenticate(mgr, room, status, rank, reason, manifest, signature)
    claims = None
    if manifest is not None and expected is not None:
        claims = _decoded_manifest(mgr, room, rank, manifest, expected, keyed)
    return Status(room, status, rank, reason, claims)


def _decoded_manifest(mgr, room, rank, frame, expected, keyed):
    """The one decode (and MAC check) of a Success's manifest frame: its claims, or the text of
    what is wrong with it. Dropped: a manifest of another use (a replay, with or without the
    secret), and with the secret one that did not authenticate."""
    try:
        return decode_manifest(
            frame,
            room=room,
            prefill_rank=rank,
            secret=mgr.pd_secret,
            max_pages=expected.max_pages,
            use=mgr.room_nonces.get(room),
            max_uses=expected.uses,
        )
    except ManifestWithoutUse as e:  # not a replay: the prefill had no nonce to put in it
        raise _Drop(str(e)) from None
    except ManifestOfAnotherUse as e:
        raise _Drop(f"a replay: {e}") from None
    except UnauthenticatedManifest as e:
        if keyed:
            raise _Drop(cut(str(e), 300)) from None
        return cut(str(e), 300)
    except ValueError as e:  # keyed by that rank (or no secret), but malformed: the room's failure reason
        return cut(str(e), 300)


def keyed_room(mgr, room: int) -> bool:
    """Whether `room`'s statuses must be signed: the decode has the secret and the room's prefill
    advertises owner-sharded pages at CP > 1, as a shared-KV prefill does (or the decode has no
    record of the room yet: fail closed). A replicated or non-CP prefill sends SGLang's statuses."""
    if mgr.pd_secret is None:
        return False
    expected = mgr.room_expectations.get(room)
    return expected is None or expected.owner_sharded


# What a keyed room's drop of an unkeyed peer says (it ends in the room's timeout reason).
_KEYED_PEERS = (
    f" (with {auth.SGLANG_NSA_CP_PD_SECRET.name} set here, every owner-sharded prefill must run the plugin "
    "with shared KV and the same secret)"
)


def _authenticate(mgr, room, status, rank, reason, manifest, signature) -> None:
    """With the secret: a Success by its manifest (decoded and its MAC checked by
    `_decoded_manifest`), anything else by its status signature, each bound to this use of the
    room (its receiver drew the nonce before the room started waiting)."""
    use = mgr.room_nonces.get(room)
    if use is None:
        raise _Drop(f"a {STATUS_NAMES[status]} status for room {room}, of which this decode knows no use")
    if status != SUCCESS:
        if signature is None:
            raise _Drop(f"an unsigned {STATUS_NAMES[status]} status{_KEYED_PEERS}")
        problem = status_signature_problem(signature, mgr.pd_secret, room, rank, status, reason, use)
        if problem is not None:
            raise _Drop(problem)
        return
    if mgr.room_expectations.get(room) is None:
        raise _Drop(f"a Success for room {room}, whose pages this decode did not ask for")
    if manifest is None:
        raise _Drop(f"a Success without an owned-page manifest{_KEYED_PEERS}")


_CHECKS = {AUX_DATA: _aux_data, CHUNK_READY: _chunk_ready, STAGING_REQ: _staging_req, ABORT_ACK: _abort_ack}
# (room frame, prefill rank frame) of each kind, for the log line
_ORIGIN = {AUX_DATA: (1, None), CHUNK_READY: (1, 6), STAGING_REQ: (1, None), ABORT_ACK: (1, 2)}
_MAX_KIND = max(map(len, _CHECKS))


def _kind(frame) -> bytes | None:
    """Frame 0 if it names one of SGLang's message kinds, looked up only when short (hashing a
    1 MiB frame to look it up cost ~0.4 ms)."""
    return frame if len(frame) <= _MAX_KIND and frame in _CHECKS else None


def check_message(mgr, msg):
    """What SGLang's decode thread may see of `msg` (a multipart message from the decode manager
    `mgr`'s status socket): the message itself, or for a status a `CheckedStatus` carrying the
    guard's parse. Raises `MessageProblem` (why it must not reach SGLang) for a malformed or
    unauthenticated message, and nothing else on purpose: any other exception is a fault of the
    guard (`guard_recv` surfaces it)."""
    if not msg:
        raise _Drop("an empty message")
    if not all(isinstance(frame, bytes) for frame in msg):
        raise _Drop("a frame that is not bytes")
    check = _CHECKS.get(_kind(msg[0]))
    if check is not None:
        check(mgr, msg)
        return msg
    return CheckedStatus(msg, _status(mgr, msg))


def decode_message_problem(mgr, msg) -> str | None:
    """Why SGLang's decode thread must not see `msg`, or None (`check_message`'s verdict)."""
    try:
        check_message(mgr, msg)
    except _Drop as drop:
        return LateStatus(drop) if drop.late else str(drop)
    return None


MessageProblem = _Drop


class CheckedStatus(list):
    """A status message that passed the guard, with its parse (`status`), which the plugin's
    `parse_kv_status_message` hands on instead of parsing the frames again."""

    def __init__(self, msg, status: Status):
        super().__init__(msg)
        self.status = status


class Unchecked(list):
    """A message the guard failed on (a fault of the guard, not of the message): SGLang's decode
    thread handles it as it would without the plugin (SGLang's own status parse)."""


def claimed_origin(msg) -> str:
    """What a message says it is and where it comes from. A PULL socket cannot name the sending
    address, so this is the message's own claim (room, prefill rank), not proof."""
    try:
        kind = _kind(msg[0]) or b""
        room_at, rank_at = _ORIGIN.get(kind, (0, 2))
        room = _show(msg[room_at]) if room_at < len(msg) else "?"
        rank = f" from prefill rank {_show(msg[rank_at])}" if rank_at is not None and rank_at < len(msg) else ""
        return f"{kind.decode() or 'a status'} claiming room {room}{rank}"
    except (IndexError, TypeError, AttributeError):
        return "an unreadable message"


def claimed_room(msg) -> int | None:
    """The room a message names, if it names one as a decimal, else None (not proof either)."""
    try:
        kind = (_kind(msg[0]) if msg else None) or b""
    except TypeError:  # an unhashable frame (only the guard's fault path sees one)
        return None
    at = _ORIGIN.get(kind, (0, 2))[0]
    frame = msg[at] if at < len(msg) else b""
    if isinstance(frame, bytes) and len(frame) <= MAX_DIGITS and frame.isdigit():
        return int(frame)
    return None


class DropLog:
    """The messages a decode's guard dropped: a count, the last few (origin, reason), the last
    one of each room still waiting (for its timeout's reason), and at most one warning line per
    `interval_s` however many come (a `LateStatus` only at debug level). Also the guard's own
    faults (`note_fault`): counted in `faults`, logged once per room."""

    MAX_FAULT_ROOMS = 1024  # rooms whose fault was logged; past it, at most one line per interval_s

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic, where: str = "the decode's status socket"):
        self.where = where
        self.count = 0
        self.recent = deque(maxlen=64)
        self.last_by_room = {}  # room waiting on the decode -> "origin: reason"; its receiver forgets it
        self.interval_s, self._clock, self._last_line = interval_s, clock, None
        self.faults = 0  # messages the guard failed on, handed to SGLang unchecked
        self._fault_rooms, self._last_fault_line = set(), None

    def note(self, origin: str, reason: str, room: int | None = None) -> None:
        """`room`: a room waiting on the decode whose message this was (None: none or unknown)."""
        self.count += 1
        self.recent.append((origin, reason))
        if room is not None:
            self.last_by_room[room] = f"{origin}: {reason}"
        if isinstance(reason, LateStatus):
            logger.debug("dropped %s: %s", origin, reason)
            return
        now = self._clock()
        if self._last_line is None or now - self._last_line >= self.interval_s:
            self._last_line = now
            logger.warning(
                "dropped a message on %s (%d so far), %s: %s (the sender's "
                "address is unknown: a ZMQ PULL socket does not name it)",
                self.where,
                self.count,
                origin,
                reason,
            )

    def note_fault(self, origin: str, room: int | None, error: BaseException) -> None:
        """The guard raised `error` (not a `MessageProblem`) on a message claiming `room`."""
        self.faults += 1
        now = self._clock()
        if room not in self._fault_rooms and len(self._fault_rooms) < self.MAX_FAULT_ROOMS:
            self._fault_rooms.add(room)
        elif self._last_fault_line is not None and now - self._last_fault_line < self.interval_s:
            return
        self._last_fault_line = now
        logger.error(
            "the status guard failed on %s (room %s; %d such message(s) so far): %s: %s; the message goes to "
            "SGLang's decode thread unchecked, as SGLang would handle it. This is a bug of the plugin: report it",
            origin,
            room,
            self.faults,
            type(error).__name__,
            cut(str(error), 300),
            exc_info=error,
        )


def guard_recv(mgr, recv, drops: DropLog):
    """SGLang's decode-thread receive `recv`, returning None (which the thread skips) for a
    message with a problem, a status with the guard's parse (`CheckedStatus`), and a message the
    guard failed on `Unchecked` (surfaced in `drops.note_fault`)."""

    def recv_checked():
        msg = recv()
        if msg is None:
            return None
        return screen(mgr, msg, drops)

    return recv_checked


def screen(mgr, msg, drops: DropLog):
    """`check_message`, a problem noted in `drops` (None returned), a fault of the guard surfaced."""
    try:
        return check_message(mgr, msg)
    except _Drop as drop:
        room = claimed_room(msg)
        problem = LateStatus(drop) if drop.late else str(drop)
        drops.note(claimed_origin(msg), problem, room if room in mgr.request_status else None)
        return None
    except Exception as error:  # a gap in the checks: surfaced, and the message is SGLang's
        drops.note_fault(claimed_origin(msg), claimed_room(msg), error)
        return Unchecked(msg)


# ---- the prefill's bootstrap socket ----------------------------------------------------------------
# Frame 0 of the messages SGLang's prefill bootstrap thread (`MooncakeKVManager.start_prefill_thread`)
# handles before a room's metadata ("None": a decode's KV layout registration).
WATERMARK, STAGING_RSP, ABORT, REGISTRATION = b"WATERMARK", b"STAGING_RSP", b"ABORT", b"None"


def bootstrap_message_problem(mgr, msg) -> str | None:
    """Why SGLang's prefill bootstrap thread must not see `msg`, or None. That thread decodes frame
    0 as ASCII and parses the rest with SGLang's own parsers, none guarded: one message they raise on
    (a non-ASCII byte, a missing frame, a non-number) ends the thread, and every later room of the
    prefill waits until it times out. Each kind is parsed here first with SGLang's own parser
    (`TransferInfo.from_zmq`, `KVArgsRegisterInfo.from_zmq`, its staging fields) and dropped if that
    raises; an abort notification SGLang parses safely itself."""
    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, TransferInfo

    if not msg or not all(isinstance(frame, bytes) for frame in msg):
        return "an empty message or a frame that is not bytes"
    head = msg[0]
    if len(head) > MAX_ID_BYTES or not head.isascii():
        return f"frame 0 {_show(head)} is not short ASCII text"
    if head == ABORT:
        return None
    staging = head in (WATERMARK, STAGING_RSP)
    if staging and not mgr.enable_staging:
        return f"{head.decode()} on a prefill without staging"
    try:
        if staging:  # SGLang's handle_watermark_msg / handle_staging_rsp fields
            numbers, text = ((1, 2), 3) if head == WATERMARK else ((1, 2, 3, 4, 5), 6)
            [int(msg[i].decode("ascii")) for i in numbers]
            if head == STAGING_RSP or len(msg) > text:
                msg[text].decode("ascii")
        else:
            msg[3].decode("ascii")  # the session id, which the thread reads first
            if head == REGISTRATION:
                KVArgsRegisterInfo.from_zmq(msg)
            else:
                int(msg[7].decode("ascii")), int(head), TransferInfo.from_zmq(msg)
    except Exception as error:  # SGLang's own parse raised: its thread would have ended
        kind = f"a {head.decode()} message" if staging else "a KV layout registration" if head == REGISTRATION else "a room's metadata"  # fmt: skip
        return f"{kind} of {len(msg)} frames that SGLang's parser raises {type(error).__name__} on"
    return None


def bootstrap_origin(msg) -> str:
    """What a bootstrap message claims to be (its room, if a short decimal; not proof)."""
    head = msg[0] if msg and isinstance(msg[0], bytes) else b""
    return f"a message claiming room {_show(head)}" if head.isdigit() else f"a message whose frame 0 is {_show(head)}"


# ---- the status signature --------------------------------------------------------------------------
def _status_mac_input(room: int, prefill_rank: int, status: int, reason: bytes, uses: bytes) -> tuple[bytes, bytes]:
    label = f"nsa-cp-status|{room}|{prefill_rank}|{status}".encode()
    return label, b"%d|" % (len(uses) // USE_NONCE_BYTES) + uses + reason


def sign_status(secret: bytes, room: int, prefill_rank: int, status: int, reason: bytes, uses) -> bytes:
    """TAG | HMAC(secret, room, rank, status, uses, reason) | the uses (nonces the room's decode
    destinations sent), appended by a keyed shared-KV prefill to each status without a manifest."""
    joined = b"".join(sorted(uses))
    label, body = _status_mac_input(room, prefill_rank, status, reason, joined)
    return STATUS_SIGNATURE_TAG + auth.sign(secret, label, body) + joined


def status_signature_problem(frame, secret, room, prefill_rank, status, reason, use) -> str | None:
    """None if `frame` signs this status for `use` (this decode's nonce of the room; None: any)."""
    rest = frame[len(STATUS_SIGNATURE_TAG) :]
    mac, uses = rest[: auth.MAC_BYTES], rest[auth.MAC_BYTES :]
    if len(mac) != auth.MAC_BYTES or len(uses) % USE_NONCE_BYTES or len(uses) > MAX_USES * USE_NONCE_BYTES:
        return f"a malformed status signature of {len(frame)} bytes"
    label, body = _status_mac_input(room, prefill_rank, status, reason, uses)
    if (problem := auth.verify(secret, label, body, mac)) is not None:
        return f"status signature: {problem}"
    if use is not None and not uses:  # signed, but for no use: dropped (an earlier such status would match too)
        said = cut(reason.decode("utf-8", errors="replace"), 200)  # keyed: the prefill's own words
        return f"a {STATUS_NAMES[status]} status of room {room} signed for no use of the room: {NO_USE_HELD}; its reason: {said}"  # fmt: skip
    if use is not None and use not in {uses[i : i + USE_NONCE_BYTES] for i in range(0, len(uses), USE_NONCE_BYTES)}:
        return f"a replay: a {STATUS_NAMES[status]} status of room {room} that answers another use of the room"
    return None
