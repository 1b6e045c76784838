"""Owned-page PD transfer as subclasses of SGLang's Mooncake classes. Mirrors
`sglang/srt/disaggregation/mooncake/conn.py`; the rules and the threat model are docs/disagg.md.

SGLang's sharded transfer already ships the pages each CP rank owns and makes the decode wait for
all N ranks. The plugin adds: each rank's self-check before Success (`OwnedPageLedger.finish`), a
manifest on its Success (keyed with SGLANG_NSA_CP_PD_SECRET, bound to this use of the room by the
decode's nonce), the decode's commit only on full coverage from the owners, the silent ranks named
on a timeout, and every message screened before SGLang's decode thread parses it
(`../status_guard.py`; with the secret every status must be signed).

SGLang builds these classes through `get_kv_class` (`../utils.py`) only on a shared-KV prefill
and on a decode started with the flag (its opt-in). Each override calls SGLang's method, and the
ledger fingerprints each one (`ledger.PatchPoint.overrides`). A shared-KV prefill fails a room,
naming the flag, when a decode destination did not opt in (its metadata carries no use nonce).
Decode-side overrides act on rooms whose Success carries a manifest and, with the secret, on
every room whose prefill is owner-sharded at CP > 1; a room of a replicated or non-CP prefill is
SGLang's (screened for shape only).
"""

from __future__ import annotations

import logging
import os

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll, StateType
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.manifest import cut
from sglang_nsa_cp.sglang_ext.disaggregation.common.conn import limited_status_frames
from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import (
    MAX_USES,
    USE_NONCE_BYTES,
    USE_NONCE_TAG,
    OwnedPageLedger,
    RoomExpectation,
    encode_manifest,
    max_manifest_bytes,
    pool_pages,
    verify_manifests,
)
from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import (
    MAX_DIGITS,
    CheckedStatus,
    DropLog,
    Unchecked,
    bootstrap_message_problem,
    bootstrap_origin,
    guard_recv,
    keyed_room,
    screen,
    sign_status,
)
from sglang_nsa_cp.sglang_ext.server_args import FLAG, is_enabled

logger = logging.getLogger(__name__)


def self_check(ledger: OwnedPageLedger, room: int):
    """(manifest, problem) of a room this rank concludes; module-level so a test can bypass it."""
    return ledger.finish(room)


def _positions(index_slice) -> np.ndarray:
    if isinstance(index_slice, slice):
        return np.arange(index_slice.start or 0, index_slice.stop, dtype=np.int64)
    return np.asarray(index_slice, dtype=np.int64)


# What a prefill holds of its decodes' use nonces (memory: docs/disagg.md, "Size limits"): rooms, and
# sessions over all rooms, since a room may declare up to MAX_USES destinations.
MAX_NOTED_ROOMS = 1 << 16
MAX_NOTED_SESSIONS = 1 << 17


class _Uses(dict):
    """A room's decode sessions -> the nonce of their use of the room, at most `limit` of them."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit


class NoncesByRoom(dict):
    """room -> _Uses, bounded: at most MAX_NOTED_ROOMS rooms and MAX_NOTED_SESSIONS sessions in all,
    the oldest rooms going first, except a room `live(room)` says a sender of this rank still
    serves (a flood of metadata for made-up rooms evicts those, never a room in flight; a live
    room passed over moves to the new end, so each eviction costs O(1) amortized). When every
    room held is live, a new one is not noted (its transfer then fails naming the bound). A
    session's first nonce stays."""

    def __init__(self, live=lambda room: False):
        super().__init__()
        self.sessions = 0
        self.live = live

    def note(self, room: int, session: str, declared: int, nonce: bytes | None) -> None:
        """`nonce` None: the session's metadata carried none (a decode that did not opt in)."""
        uses = self.get(room)
        if uses is None:
            while len(self) >= MAX_NOTED_ROOMS:
                if not self._evict_one(keep=room):
                    return
            uses = self[room] = _Uses(max(1, min(declared, MAX_USES)))
        if session in uses or len(uses) >= uses.limit:
            return
        while self.sessions >= MAX_NOTED_SESSIONS:
            if not self._evict_one(keep=room):
                return
        uses[session] = nonce
        self.sessions += 1

    def _evict_one(self, keep: int) -> bool:
        """Drop the oldest room that is neither `keep` nor live; False if there is none."""
        for _ in range(len(self)):
            room = next(iter(self))
            if room != keep and not self.live(room):
                self.drop(room)
                return True
            self[room] = self.pop(room)  # passed over: to the new end
        return False

    def drop(self, room: int) -> None:
        self.sessions -= len(self.pop(room, ()))


_UNPROTECTED = {
    DisaggregationMode.PREFILL: "its manifests are not keyed, so a decode cannot tell them from forged ones",
    DisaggregationMode.DECODE: "anyone who reaches this decode's status port can forge or replay a room's "
    "commit or fail it",
}
_warned_unprotected: set = set()


def _warn_once_if_unprotected(mode, secret) -> None:
    """One line per process at start-up when the PD messages are not keyed: what is open, and the fix."""
    if secret is None and mode in _UNPROTECTED and mode not in _warned_unprotected:
        _warned_unprotected.add(mode)
        logger.warning(
            "owned-page PD transfer runs unprotected: %s is unset, %s; set it, the same value, on the "
            "decode and every prefill rank (docs/disagg.md)",
            auth.SGLANG_NSA_CP_PD_SECRET.name,
            _UNPROTECTED[mode],
        )


class OwnedPageKVManager(MooncakeKVManager):
    """SGLang's Mooncake manager with the owned-page checks (prefill) and the commit rule (decode)."""

    # A 4th status frame (the reason) on this class only, SGLang's decode parser reads it; the
    # manifest and status signature follow it (`_encode_kv_status_message`).
    kv_status_msg_carries_reason = True

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        # SGLang starts the manager's threads inside __init__: the state they read comes first.
        self.owned_pages_ledger: OwnedPageLedger | None = None  # prefill, shared KV only
        self.outgoing_manifests = {}  # prefill: room -> manifest being concluded
        # prefill: room -> {decode session: nonce of its use of the room}; a room in flight is never evicted
        self.destination_nonces = NoncesByRoom(live=self._has_live_sender)
        self.room_nonces = {}  # decode: room -> nonce of this use of the room (sent with the metadata)
        self.manifest_inbox = {}  # decode: (room, prefill rank) -> manifest parsed, not applied yet
        self.room_manifests = {}  # decode: room -> {prefill rank: manifest}
        self.room_expectations = {}  # decode: room -> RoomExpectation (what it asked for)
        self.room_aux_indices = {}  # decode: room -> the aux (metadata) index it gave the prefill
        # what the status guard kept from SGLang's decode thread, or the screen from its prefill bootstrap thread
        self.dropped_messages = DropLog(
            where="the decode's status socket"
            if disaggregation_mode == DisaggregationMode.DECODE
            else "the prefill's bootstrap socket"
        )
        self.pd_secret = auth.pd_secret()
        if is_enabled() and disaggregation_mode == DisaggregationMode.PREFILL:
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
            rank, size = parallel.attn_cp_rank, parallel.attn_cp_size
            self.owned_pages_ledger = OwnedPageLedger(rank, size)
            logger.info("Owned-page PD transfer: CP rank %d of %d sends the pages it owns", rank, size)
            _warn_once_if_unprotected(disaggregation_mode, self.pd_secret)
        if disaggregation_mode != DisaggregationMode.DECODE:
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            return
        # Decode: status messages carry manifests of at most the pool's pages; nothing SGLang
        # sends to this socket comes near 1 MiB.
        _warn_once_if_unprotected(disaggregation_mode, self.pd_secret)
        with limited_status_frames((1 << 20) + max_manifest_bytes(pool_pages(args), MAX_USES)):
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)

    def _make_worker_recv(self, socket, timeout_ms=500):
        """The receive of SGLang's worker threads on this manager's socket. On a decode, every
        message is checked before SGLang's decode thread parses it (`status_guard`): one with a
        problem is dropped with a log line (at most one per 10 s) naming its claimed room and
        prefill rank and the problem; a PULL socket cannot name the sending address. On a
        shared-KV prefill, a message SGLang's bootstrap thread would raise on (and end) is dropped
        the same way (`bootstrap_message_problem`), and the use nonce that rides on a decode's
        request metadata is noted (SGLang ignores the extra frame)."""
        recv = super()._make_worker_recv(socket, timeout_ms)
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            return guard_recv(self, recv, self.dropped_messages)
        if self.owned_pages_ledger is None:
            return recv

        def recv_screened_noting_nonces():
            msg = recv()
            if msg is None:
                return None
            problem = bootstrap_message_problem(self, msg)
            if problem is not None:
                self.dropped_messages.note(bootstrap_origin(msg), problem)
                return None
            self._note_use_nonce(msg)
            return msg

        return recv_screened_noting_nonces

    # ---- prefill side ----------------------------------------------------------------------------
    def _note_use_nonce(self, msg) -> None:
        """[room, endpoint, port, session, ..., required destinations, ..., USE_NONCE_TAG + nonce]
        from a decode's `build_receiver_metadata_message`; a room's metadata without the nonce frame
        is noted as such (a decode that did not opt in: `add_transfer_request` fails its room);
        anything else is left to SGLang. A
        session's first nonce stays (a later one for the same session is ignored), a room holds at
        most the destinations its first metadata declared, and `NoncesByRoom` bounds rooms and
        sessions in all: SGLang's metadata channel is unauthenticated, so these bound what anyone
        who reaches it can make the prefill keep and put into the room's manifests."""
        if len(msg) < 10 or len(msg[0]) > MAX_DIGITS or not msg[0].isdigit():  # length first: a 1 MiB scan
            return  # not a room's metadata (registration, staging, abort): SGLang's
        try:
            room, session, declared = int(msg[0].decode("ascii")), msg[3].decode("ascii"), int(msg[7])
        except (UnicodeDecodeError, ValueError):
            return
        nonce = msg[-1] if len(msg) > 10 else b""
        if nonce.startswith(USE_NONCE_TAG) and len(nonce) == len(USE_NONCE_TAG) + USE_NONCE_BYTES:
            self.destination_nonces.note(room, session, declared, nonce[len(USE_NONCE_TAG) :])
        else:
            self.destination_nonces.note(room, session, declared, None)

    def _has_live_sender(self, room: int) -> bool:
        """Whether a sender of this rank serves `room` (SGLang's sender registers its room's status
        when it is created and its `clear` removes it)."""
        return room in self.request_status

    def _destination_problem(self, room: int) -> str | None:
        """Why a decode destination of `room` cannot take owned pages: it did not opt in (no use
        nonce on its metadata), or its nonce is not held (more rooms noted than the bound)."""
        uses = self.destination_nonces.get(room) or {}
        for session, info in list(self.transfer_infos.get(room, {}).items()):
            if info.is_dummy:
                continue
            if session in uses and uses[session] is None:
                return (
                    f"owned-page transfer of room {room}: decode {info.endpoint}:{info.dst_port} has not opted in "
                    f"to shared-KV prefills (its request metadata carries no use nonce), so it would commit this "
                    f"room without the owned-page checks; start that decode with {FLAG}"
                )
            if session not in uses:
                return (
                    f"owned-page transfer of room {room}: no use nonce held for decode {info.endpoint}:"
                    f"{info.dst_port} (the prefill holds at most {MAX_NOTED_ROOMS} rooms' nonces, the oldest "
                    "rooms not in flight going first), so its manifests could not answer that decode's use of the room"
                )
        return None

    def add_transfer_request(
        self,
        bootstrap_room,
        kv_indices,
        index_slice,
        is_last_chunk,
        aux_index=None,
        state_indices=None,
        *args,
        **kwargs,
    ):
        """Records the KV pages handed to the transfer queue (request positions, local page ids)
        for the rank's self-check and manifest; fails the room with a reason, instead of queueing,
        when a decode destination list is shorter than the positions it must hold (SGLang's worker
        would index past its end and stop the transfer thread)."""
        ledger = self.owned_pages_ledger
        live = (
            ledger is not None
            and bootstrap_room in self.request_status
            and self.check_status(bootstrap_room) != KVPoll.Failed
            and bootstrap_room in self.transfer_infos
        )
        if live and (problem := self._destination_problem(bootstrap_room)) is not None:
            logger.error("%s", problem)
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=problem)
            return None
        if live:
            positions = _positions(index_slice)
            local = kv_indices.numpy() if hasattr(kv_indices, "numpy") else np.asarray(kv_indices)
            if positions.size:
                need = int(positions.max()) + 1
                for info in list(self.transfer_infos[bootstrap_room].values()):
                    if not info.is_dummy and len(info.dst_kv_indices) < need:
                        self.conclude_failure(
                            bootstrap_room=bootstrap_room,
                            failure_reason=(
                                f"owned-page transfer of room {bootstrap_room}: decode {info.endpoint}:"
                                f"{info.dst_port} sent {len(info.dst_kv_indices)} destination pages, CP rank "
                                f"{ledger.rank} must write position {need - 1}"
                            ),
                        )
                        return None
            ledger.queue_kv(bootstrap_room, positions, local)
            if is_last_chunk and state_indices:
                dsa = [i for i, st in enumerate(self.kv_args.state_types) if st == StateType.DSA]
                if any(i < len(state_indices) and state_indices[i] is not None for i in dsa):
                    ledger.expect_index(bootstrap_room)
        return super().add_transfer_request(
            bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index, state_indices, *args, **kwargs
        )

    def maybe_send_extra(self, req, prefill_state_indices, executor, *args, **kwargs):
        """Records the index-K pages this rank owns (last chunk, per decode destination), which
        SGLang's sharded send (`_prepare_sharded_dsa_indices`) then ships from its local pages
        p // N to the decode pages at their positions; fails the room with a reason when the
        decode's list does not pair with the prefill's (SGLang would raise in its transfer thread)."""
        ledger = self.owned_pages_ledger
        if ledger is None:
            return super().maybe_send_extra(req, prefill_state_indices, executor, *args, **kwargs)
        types = list(self.kv_args.state_types)
        indices = list(prefill_state_indices)
        dst_lists = list(req.dst_state_indices)
        for i, st in enumerate(types):
            if i >= len(indices) or indices[i] is None:
                continue
            if st != StateType.DSA:
                self.conclude_failure(
                    bootstrap_room=req.room,
                    failure_reason=f"owned-page transfer: state {st.value} is not supported with shared KV",
                )
                return -1
            full = np.asarray(indices[i], dtype=np.int64)
            dst = np.asarray(dst_lists[i] if i < len(dst_lists) else [], dtype=np.int64)
            if len(full) != len(dst):
                self.conclude_failure(
                    bootstrap_room=req.room,
                    failure_reason=(
                        f"owned-page transfer of room {req.room}: {len(full)} index-K pages on the prefill, "
                        f"{len(dst)} destination pages from decode {req.endpoint}:{req.dst_port}"
                    ),
                )
                return -1
            mine = ledger.owned(full)
            ledger.record_index(req.room, len(full), np.nonzero(mine)[0], full[mine])
        return super().maybe_send_extra(req, prefill_state_indices, executor, *args, **kwargs)

    def conclude_transfer(self, **kwargs):
        """A Success becomes Failed with the reason when this rank did not hand every page it owns
        to the transfer exactly once; the manifest of a Success goes out with the status message
        (`_encode_kv_status_message`)."""
        ledger, room, status = self.owned_pages_ledger, kwargs.get("bootstrap_room"), kwargs.get("status")
        if ledger is None or room is None or status not in (KVPoll.Success, KVPoll.Failed):
            return super().conclude_transfer(**kwargs)
        manifest, problem = self_check(ledger, room)
        if status == KVPoll.Success and problem is not None:
            logger.error("%s", problem)
            kwargs.update(status=KVPoll.Failed, failure_reason=problem)
        if kwargs["status"] == KVPoll.Success and manifest is not None:
            self.outgoing_manifests[room] = manifest
        try:
            return super().conclude_transfer(**kwargs)
        finally:
            self.outgoing_manifests.pop(room, None)

    def _encode_kv_status_message(self, **kwargs):
        """The manifest frame goes after the reason frame of this rank's Success message; with
        the secret, every other status of a shared-KV rank ends with its status signature, so a
        decode with the secret can tell it from a forged one (`status_guard`)."""
        parts = super()._encode_kv_status_message(**kwargs)
        room = kwargs.get("bootstrap_room")
        manifest = self.outgoing_manifests.get(room)
        uses = [nonce for nonce in self.destination_nonces.get(room, {}).values() if nonce is not None]
        rank = self._prefill_unique_rank()
        if manifest is not None:
            parts = list(parts) + [encode_manifest(manifest, room, rank, self.pd_secret, uses)]
        elif self.owned_pages_ledger is not None and self.pd_secret is not None:
            status, reason = int(kwargs["status"]), parts[-1]  # the reason frame (kv_status_msg_carries_reason)
            parts = list(parts) + [sign_status(self.pd_secret, room, rank, status, reason, uses)]
        return parts

    # ---- decode side (an opted-in decode: keyed on the manifests a shared-KV prefill sends) --------
    def build_receiver_metadata_message(self, **kwargs):
        """SGLang's request metadata with this use's nonce as a last frame (`OwnedPageKVReceiver.
        send_metadata` draws it), which a shared-KV prefill binds its manifests to."""
        parts = super().build_receiver_metadata_message(**kwargs)
        nonce = self.room_nonces.get(kwargs.get("bootstrap_room"))
        return parts if nonce is None else list(parts) + [USE_NONCE_TAG + nonce]

    def parse_kv_status_message(self, msg):
        """SGLang's (room, status, prefill rank, reason) from the guard's one parse of the message
        (`status_guard.CheckedStatus`; a message that did not come through the guard is screened
        here the same way), keeping the manifest the guard decoded for `apply_prefill_status`
        (the decode thread calls both, in that order). A message the guard failed on
        (`Unchecked`) gets SGLang's own parse and no manifest."""
        if isinstance(msg, Unchecked):
            return super().parse_kv_status_message(msg)
        if not isinstance(msg, CheckedStatus):
            msg = screen(self, msg, self.dropped_messages)
            if not isinstance(msg, (CheckedStatus, Unchecked)):
                return None
            return self.parse_kv_status_message(msg)
        status = msg.status
        if status.manifest is not None:
            self.manifest_inbox[(status.room, status.prefill_rank)] = status.manifest
        return status.sglang_tuple()

    def apply_prefill_status(self, *, bootstrap_room, status, prefill_rank, failure_reason=None):
        """When the last expected Success of a room whose senders send manifests (every room of an
        owner-sharded prefill, when this decode has the secret) arrives, commit only if the manifests cover every page
        position exactly once from its owner, counted against what this decode asked for;
        otherwise the room fails with the reason."""
        manifest = self.manifest_inbox.pop((bootstrap_room, prefill_rank), None)
        responders = self.prefill_response_tracker.get(bootstrap_room)
        required = self.required_prefill_response_num_table.get(bootstrap_room)
        keyed = keyed_room(self, bootstrap_room)

        def apply(status, failure_reason):
            return super(OwnedPageKVManager, self).apply_prefill_status(
                bootstrap_room=bootstrap_room, status=status, prefill_rank=prefill_rank, failure_reason=failure_reason
            )

        current = self.request_status.get(bootstrap_room)
        if status != KVPoll.Success or current in (None, KVPoll.Success, KVPoll.Failed) or responders is None:
            return apply(status, failure_reason)  # not a Success, or the room is already decided
        origin = f"Success of room {bootstrap_room} from prefill rank {prefill_rank}"
        if keyed and manifest is None:  # only a message the guard failed on gets here so
            return self.dropped_messages.note(origin, "no checked owned-page manifest", bootstrap_room)
        if prefill_rank in self.room_manifests.get(bootstrap_room, ()):  # a replay within this use
            return self.dropped_messages.note(origin, "a second Success from that rank for this use", bootstrap_room)
        if manifest is not None or keyed:
            room_manifests = self.room_manifests.setdefault(bootstrap_room, {})
            if manifest is not None:
                room_manifests[prefill_rank] = manifest
        room_manifests = self.room_manifests.get(bootstrap_room)
        done = responders | {prefill_rank}
        if room_manifests is not None and required is not None and len(done) >= required:
            self.room_manifests.pop(bootstrap_room, None)
            expected = self.room_expectations.get(bootstrap_room)
            if expected is None:
                reason = (
                    f"owned-page transfer of room {bootstrap_room}: the decode has no record of the "
                    "pages it asked for (send_metadata did not run through the plugin)"
                )
            else:
                reason = verify_manifests(bootstrap_room, room_manifests, done, expected)
            if reason is not None:
                logger.error("%s", reason)
                status, failure_reason = KVPoll.Failed, reason
        return apply(status, failure_reason)

    def forget_room(self, room: int) -> None:
        """Drop what the decode recorded for a room (its receiver is cleared)."""
        self.dropped_messages.last_by_room.pop(room, None)
        self.room_manifests.pop(room, None)
        self.room_expectations.pop(room, None)
        self.room_nonces.pop(room, None)
        self.room_aux_indices.pop(room, None)
        for key in [k for k in list(self.manifest_inbox) if k[0] == room]:
            self.manifest_inbox.pop(key, None)


class OwnedPageKVSender(MooncakeKVSender):
    """SGLang's Mooncake sender, recording each chunk's owned positions for the rank's self-check."""

    def _prepare_send_indices(self, kv_indices, state_indices=None):
        """Note the positions this rank owns in the unfiltered chunk (logical page ids) before
        SGLang filters it down to them."""
        ledger = self.kv_mgr.owned_pages_ledger
        if ledger is not None:
            pages = kv_indices.numpy() if hasattr(kv_indices, "numpy") else np.asarray(kv_indices)
            ledger.expect_kv(self.bootstrap_room, self.curr_idx, pages, total=self.num_kv_indices)
        return super()._prepare_send_indices(kv_indices, state_indices)

    def clear(self):
        """Forget the room's ledger entry too (aborted or timed-out rooms never conclude)."""
        try:
            return super().clear()
        finally:
            if self.kv_mgr.owned_pages_ledger is not None:
                self.kv_mgr.owned_pages_ledger.drop(self.bootstrap_room)
                self.kv_mgr.destination_nonces.drop(self.bootstrap_room)


def _expected_prefill_ranks(receiver, every_tp_rank: bool = False) -> list[int]:
    """Prefill unique ranks (`CommonKVManager._prefill_unique_rank`) a receiver waits for (with
    `every_tp_rank`: every rank it sends its metadata to, dummy TP ranks included)."""
    info = vars(receiver).get("prefill_info")  # SGLang's `init()` sets it (a name the ledger checks)
    if info is None or info.target_cp_ranks is None:
        return []
    tp_ranks = list(info.target_tp_ranks or [])
    if info.target_tp_rank is not None and not (every_tp_rank and tp_ranks):
        tp_ranks = [info.target_tp_rank]
    return sorted(
        tp * (info.pp_size * info.attn_cp_size) + pp * info.attn_cp_size + cp
        for tp in tp_ranks
        for pp in info.target_pp_ranks or [0]
        for cp in info.target_cp_ranks
    )


class OwnedPageKVReceiver(MooncakeKVReceiver):
    """SGLang's Mooncake receiver, recording what it asks for so the manifests can be checked."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, *args, **kwargs):
        """Draws the nonce of this use of the room before SGLang marks the room waiting: a status
        signed for an earlier use (a replay, or a late one after a re-bootstrap) never matches it,
        even before `send_metadata`. A receiver SGLang refuses (deferred allocation, room already
        held) leaves the holder's nonce alone."""
        self.use_nonce = os.urandom(USE_NONCE_BYTES)
        if not (mgr.defer_decode_allocation and bootstrap_room in mgr.request_status):
            mgr.room_nonces[bootstrap_room] = self.use_nonce
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, *args, **kwargs):
        """Remember what this decode asks for in the room (destination pages of each kind, the
        prefill CP size and ranks it targets, its destinations) before asking, so a status that
        answers at once is checked against it."""
        info = vars(self).get("prefill_info")  # set by SGLang's `init()`, which failed if the prefill is gone
        if info is not None and info.attn_cp_size:
            types = list(self.kv_mgr.kv_args.state_types)
            dsa = [s for i, s in enumerate(state_indices or []) if i < len(types) and types[i] == StateType.DSA]
            index_pages = len(dsa[0]) if dsa and dsa[0] is not None else None
            self.kv_mgr.room_expectations[self.bootstrap_room] = RoomExpectation(
                len(kv_indices),
                index_pages,
                int(info.attn_cp_size),
                prefill_ranks=tuple(_expected_prefill_ranks(self, every_tp_rank=True)) or None,
                uses=max(1, int(self.required_dst_info_num or 1)),
                owner_sharded=bool(info.enable_kv_cache_sharding) and int(info.attn_cp_size) > 1,
            )
        if aux_index is not None:  # the one slot a prefill may write this room's metadata to
            self.kv_mgr.room_aux_indices[self.bootstrap_room] = int(aux_index)
        return super().send_metadata(kv_indices, aux_index, state_indices, *args, **kwargs)

    def _check_waiting_timeout(self):
        """A room that times out names the prefill ranks whose status never came through and the
        last message the guard dropped for it (the reason only; the outcome is SGLang's)."""
        result = super()._check_waiting_timeout()
        if result == KVPoll.Failed:
            mgr, room = self.kv_mgr, self.bootstrap_room
            expected = _expected_prefill_ranks(self)
            done = mgr.prefill_response_tracker.get(room) or set()
            silent = [r for r in expected if r not in done]
            dropped = mgr.dropped_messages.last_by_room.get(room)
            with mgr.failure_lock:
                reason = mgr.failure_records.get(room, "timed out")
                if len(expected) > 1 and silent:
                    reason += f"; no accepted transfer status from prefill rank(s) {silent} (success from {sorted(done)} of {expected})"  # fmt: skip
                if dropped is not None:  # the guard's words: a frame only by its size and hex (`_show`)
                    reason += f"; the last message dropped for this room: {cut(dropped, 400)}"
                mgr.failure_records[room] = reason
            mgr.room_manifests.pop(room, None)
        return result

    def _clear(self):
        """Drop the room's manifests and expectation too, unless a later receiver holds the room."""
        room = self.bootstrap_room
        try:
            return super()._clear()
        finally:
            mine = self.use_nonce
            if self.kv_mgr.room_nonces.get(room, mine) is mine:
                self.kv_mgr.forget_room(room)
