"""Owned-page PD transfer on SGLang's own KV-sharding path: what the plugin adds. Mirrors
`sglang/srt/disaggregation/common/conn.py`.

The flag turns on SGLang 0.5.23's `--enable-kv-cache-sharding`, whose transfer already ships the
pages each CP rank owns (logical page p on rank p % N at local page p // N): every CP rank is a
sender of its owned KV pages (`filter_kv_indices_for_shard_rank`) and index-K pages
(`_prepare_sharded_dsa_indices`), and the bootstrap advertises sharding, so any decode pulls from
all N CP ranks and reports Success after all N did. The plugin adds the checks:

- each rank checks, before it reports Success, that it handed every page it owns to the transfer
  exactly once (`owned_pages.OwnedPageLedger.finish`), and reports Failed with the difference
  otherwise; status messages carry the failure reason (a stock decode reads it);
- its Success message carries a manifest frame (positions and logical pages of its KV and
  index-K pages), keyed with SGLANG_NSA_CP_PD_SECRET when set (`disagg/auth.py`). A decode with
  this plugin (no flag needed) commits a room only when the N manifests cover every position
  exactly once from its owner, counted against its own destination pages and CP size (recorded
  when it sends them), and names the silent ranks when a room times out; with the secret, a
  Success whose manifest is missing or not keyed to that room and rank is dropped as if it never
  came (logged at most every 10 s), so a forged one neither commits nor fails the room. A
  manifest frame is parsed only for a room the decode asked for, only up to the size that room
  needs, and never raises into SGLang's decode thread: what is wrong becomes the room's failure
  reason. The decode's status socket refuses frames past that size for its largest request
  (ZMQ_MAXMSGSIZE, set while SGLang creates it). A stock decode ignores the frame.

Prefill-side targets (act only on a shared-KV prefill manager, `ledger_of(mgr)` not None):
`CommonKVManager.__init__`, `conclude_transfer`,
`_encode_kv_status_message`; `CommonKVSender._prepare_send_indices`, `clear`.
Decode-side targets (act only on rooms whose Success messages carry manifests, or on every room
when the decode has the secret): `CommonKVManager.__init__` (the status socket's size limit,
through `get_zmq_socket_on_host`), `parse_kv_status_message`, `apply_prefill_status`;
`CommonKVReceiver.send_metadata`, `_check_waiting_timeout`, `_clear`.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.manifest import cut
from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import (
    MANIFEST_TAG,
    OwnedPageLedger,
    RoomExpectation,
    UnauthenticatedManifest,
    decode_manifest,
    encode_manifest,
    max_manifest_bytes,
    verify_manifests,
)
from sglang_nsa_cp.sglang_ext.server_args import FLAG, is_enabled

logger = logging.getLogger(__name__)

_LEDGER = "_nsa_cp_ledger"  # prefill manager: OwnedPageLedger
_OUTGOING = "_nsa_cp_outgoing"  # prefill manager: room -> manifest being concluded
_INBOX = "_nsa_cp_inbox"  # decode manager: (room, prefill rank) -> manifest parsed, not applied yet
_MANIFESTS = "_nsa_cp_manifests"  # decode manager: room -> {prefill rank: manifest}
_EXPECTED = "_nsa_cp_expected"  # decode manager: room -> RoomExpectation (what it asked for)
_SECRET = "_nsa_cp_secret"  # both: SGLANG_NSA_CP_PD_SECRET, read once per manager
_STATUS_FRAME_LIMIT = threading.local()  # MAXMSGSIZE for the status socket SGLang is creating


def ledger_of(mgr):
    return mgr.__dict__.get(_LEDGER) if mgr is not None else None


def _state(mgr, name):
    return mgr.__dict__.setdefault(name, {})


# ---- prefill side ----------------------------------------------------------------------------------
def init_owner_sharded_manager(original, self, args, disaggregation_mode, *rest, **kwargs):
    """AROUND `CommonKVManager.__init__`: on a shared-KV prefill rank, the rank's ledger of owned
    pages and status messages that carry a failure reason. On a decode, bound the frames its
    status socket accepts (`limit_status_frames`). Both keep the PD secret, if set."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if is_enabled() and disaggregation_mode == DisaggregationMode.PREFILL:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.runtime_context import get_parallel

        if not isinstance(self, MooncakeKVManager):
            raise NotImplementedError(
                f"{FLAG}: owned pages are shipped by the Mooncake transfer backend only, not {type(self).__name__}"
            )
        parallel = get_parallel()
        rank, size = parallel.attn_cp_rank, parallel.attn_cp_size
        self.kv_status_msg_carries_reason = True  # a 4th frame; SGLang's decode parser reads it
        self.__dict__[_LEDGER] = OwnedPageLedger(rank, size)
        self.__dict__[_OUTGOING] = {}
        self.__dict__[_SECRET] = auth.pd_secret()
        logger.info("Owned-page PD transfer: CP rank %d of %d sends the pages it owns", rank, size)
    if disaggregation_mode != DisaggregationMode.DECODE:
        return original(self, args, disaggregation_mode, *rest, **kwargs)
    # Decode: status messages carry manifests of at most the pool's pages; nothing SGLang sends
    # to this socket comes near 1 MiB.
    pool_pages = max((n // max(i, 1) for n, i in zip(args.kv_data_lens, args.kv_item_lens)), default=0)
    _STATUS_FRAME_LIMIT.bytes = (1 << 20) + max_manifest_bytes(pool_pages)
    try:
        result = original(self, args, disaggregation_mode, *rest, **kwargs)
    finally:
        _STATUS_FRAME_LIMIT.bytes = None
    self.__dict__[_SECRET] = auth.pd_secret()
    return result


def limit_status_frames(original, context, socket_type, *args, **kwargs):
    """AROUND `get_zmq_socket_on_host` as `common/conn.py` calls it: while a decode manager is
    being built (`init_owner_sharded_manager`), its status socket gets ZMQ_MAXMSGSIZE before it
    binds (libzmq copies options to connections at bind time): a larger frame closes the
    connection that sent it before anyone parses it. Every other call passes through."""
    limit = getattr(_STATUS_FRAME_LIMIT, "bytes", None)
    if limit is None:
        return original(context, socket_type, *args, **kwargs)
    import zmq

    context.setsockopt(zmq.MAXMSGSIZE, limit)  # the default of sockets this context makes next
    try:
        return original(context, socket_type, *args, **kwargs)
    finally:
        context.sockopts.pop(zmq.MAXMSGSIZE, None)


def expect_owned_kv_pages(original, self, kv_indices, state_indices=None):
    """AROUND `CommonKVSender._prepare_send_indices`: note the positions this rank owns in the
    unfiltered chunk (logical page ids) before SGLang filters it down to them."""
    ledger = ledger_of(self.kv_mgr)
    if ledger is not None:
        pages = kv_indices.numpy() if hasattr(kv_indices, "numpy") else np.asarray(kv_indices)
        ledger.expect_kv(self.bootstrap_room, self.curr_idx, pages, total=self.num_kv_indices)
    return original(self, kv_indices, state_indices)


def self_check(ledger: OwnedPageLedger, room: int):
    """(manifest, problem) of a room this rank concludes; module-level so a test can bypass it."""
    return ledger.finish(room)


def check_before_concluding(original, self, **kwargs):
    """AROUND `CommonKVManager.conclude_transfer`: a Success becomes Failed with the reason when
    this rank did not hand every page it owns to the transfer exactly once; the manifest of a
    Success goes out with the status message (`attach_manifest`)."""
    ledger = ledger_of(self)
    room = kwargs.get("bootstrap_room")
    if ledger is None or room is None:
        return original(self, **kwargs)
    from sglang.srt.disaggregation.base.conn import KVPoll

    status = kwargs.get("status")
    if status not in (KVPoll.Success, KVPoll.Failed):
        return original(self, **kwargs)
    manifest, problem = self_check(ledger, room)
    if status == KVPoll.Success and problem is not None:
        logger.error("%s", problem)
        kwargs.update(status=KVPoll.Failed, failure_reason=problem)
    outgoing = self.__dict__[_OUTGOING]
    if kwargs["status"] == KVPoll.Success and manifest is not None:
        outgoing[room] = manifest
    try:
        return original(self, **kwargs)
    finally:
        outgoing.pop(room, None)


def attach_manifest(original, self, **kwargs):
    """AROUND `CommonKVManager._encode_kv_status_message`: append the manifest frame to this
    rank's Success message (after the reason frame)."""
    parts = original(self, **kwargs)
    outgoing = self.__dict__.get(_OUTGOING)
    if outgoing:
        room = kwargs.get("bootstrap_room")
        manifest = outgoing.get(room)
        if manifest is not None:
            secret = self.__dict__.get(_SECRET)
            parts = list(parts) + [encode_manifest(manifest, room, self._prefill_unique_rank(), secret)]
    return parts


def forget_sent_room(original, self, *args, **kwargs):
    """AROUND `CommonKVSender.clear`: drop the room's ledger entry (aborted or timed-out rooms
    never conclude)."""
    try:
        return original(self, *args, **kwargs)
    finally:
        ledger = ledger_of(self.kv_mgr)
        if ledger is not None:
            ledger.drop(self.bootstrap_room)


# ---- decode side (no flag: keyed on the manifests a shared-KV prefill sends) -----------------------
def record_expectation(original, self, kv_indices, *args, **kwargs):
    """AROUND `CommonKVReceiver.send_metadata`: remember what this decode asks for in the room
    (destination pages of each kind, the prefill CP size it targets) before asking, so a status
    that answers at once is checked against it."""
    info = getattr(self, "prefill_info", None)
    if info is not None and info.attn_cp_size:
        state_indices = kwargs.get("state_indices", args[1] if len(args) > 1 else None)
        from sglang.srt.disaggregation.base.conn import StateType

        types = list(getattr(self.kv_mgr.kv_args, "state_types", []) or [])
        dsa = [s for i, s in enumerate(state_indices or []) if i < len(types) and types[i] == StateType.DSA]
        index_pages = len(dsa[0]) if dsa and dsa[0] is not None else None
        _state(self.kv_mgr, _EXPECTED)[self.bootstrap_room] = RoomExpectation(
            len(kv_indices), index_pages, int(info.attn_cp_size)
        )
    return original(self, kv_indices, *args, **kwargs)


def read_manifest(original, self, msg):
    """AROUND `CommonKVManager.parse_kv_status_message`: keep the manifest frame of a status
    message for `verify_before_success` (the decode thread calls both, in that order). Only a
    room this decode asked for is parsed, up to the size that room needs; what is wrong with a
    frame becomes a string (the room's failure reason later), never an exception here."""
    parsed = original(self, msg)
    if parsed is None:
        return parsed
    body = msg[1:] if self.kv_status_msg_tag is not None else msg
    frame = body[4] if len(body) > 4 else b""
    room, _, prefill_rank, _ = parsed
    expected = _state(self, _EXPECTED).get(room)
    if expected is not None and frame.startswith(MANIFEST_TAG):
        keyed = self.__dict__.get(_SECRET) is not None
        try:
            manifest = decode_manifest(
                frame,
                room=room,
                prefill_rank=prefill_rank,
                secret=self.__dict__.get(_SECRET),
                max_pages=expected.max_pages,
            )
        except UnauthenticatedManifest as e:
            manifest = _Unauthenticated(cut(str(e), 300)) if keyed else cut(str(e), 300)
        except ValueError as e:
            manifest = cut(str(e), 300)
        _state(self, _INBOX)[(room, prefill_rank)] = manifest
    return parsed


class _Unauthenticated(str):
    """Why a status's manifest frame did not authenticate: with the secret, such a status is
    dropped as if it never came (a forged Success neither commits nor fails a room)."""


_dropped_log = {"last": 0.0, "count": 0}


def _log_dropped(room: int, prefill_rank: int, why: str) -> None:
    _dropped_log["count"] += 1
    now = time.monotonic()
    if now - _dropped_log["last"] >= 10:  # at most one line per 10 s, however many are forged
        _dropped_log["last"] = now
        logger.warning(
            "dropping a Success status of room %s from prefill rank %s (%d dropped so far): %s; "
            "with SGLANG_NSA_CP_PD_SECRET set here, every prefill must run the plugin with the "
            "same secret",
            room,
            prefill_rank,
            _dropped_log["count"],
            why,
        )


def verify_before_success(original, self, *, bootstrap_room, status, prefill_rank, failure_reason=None):
    """AROUND `CommonKVManager.apply_prefill_status`: when the last expected Success of a room
    whose senders send manifests (every room, when this decode has the secret) arrives, commit
    only if the manifests cover every page position exactly once from its owner, counted against
    what this decode asked for; otherwise the room fails with the reason."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    manifest = _state(self, _INBOX).pop((bootstrap_room, prefill_rank), None)
    rooms = _state(self, _MANIFESTS)
    responders = self.prefill_response_tracker.get(bootstrap_room)
    required = self.required_prefill_response_num_table.get(bootstrap_room)
    keyed = self.__dict__.get(_SECRET) is not None

    def apply(status, failure_reason):
        return original(
            self, bootstrap_room=bootstrap_room, status=status, prefill_rank=prefill_rank, failure_reason=failure_reason
        )

    current = self.request_status.get(bootstrap_room)
    if status != KVPoll.Success or current in (None, KVPoll.Success, KVPoll.Failed) or responders is None:
        return apply(status, failure_reason)  # not a Success, or the room is already decided
    if keyed and (manifest is None or isinstance(manifest, _Unauthenticated)):
        return _log_dropped(bootstrap_room, prefill_rank, manifest or "no owned-page manifest frame")
    if manifest is not None or keyed:
        room_manifests = rooms.setdefault(bootstrap_room, {})
        if prefill_rank in room_manifests:
            manifest = f"a second Success from prefill rank {prefill_rank}"
        if manifest is not None:
            room_manifests[prefill_rank] = manifest
    room_manifests = rooms.get(bootstrap_room)
    done = responders | {prefill_rank}
    if room_manifests is not None and required is not None and len(done) >= required:
        rooms.pop(bootstrap_room, None)
        expected = _state(self, _EXPECTED).get(bootstrap_room)
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


def _expected_prefill_ranks(receiver) -> list[int]:
    """Prefill unique ranks (`CommonKVManager._prefill_unique_rank`) a receiver waits for."""
    info = getattr(receiver, "prefill_info", None)
    if info is None or info.target_cp_ranks is None:
        return []
    tp_ranks = [info.target_tp_rank] if info.target_tp_rank is not None else list(info.target_tp_ranks or [])
    return sorted(
        tp * (info.pp_size * info.attn_cp_size) + pp * info.attn_cp_size + cp
        for tp in tp_ranks
        for pp in info.target_pp_ranks or [0]
        for cp in info.target_cp_ranks
    )


def name_silent_ranks(original, self):
    """AROUND `CommonKVReceiver._check_waiting_timeout`: a room that times out names the prefill
    ranks whose status never came (the reason only; the outcome is SGLang's)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    result = original(self)
    if result == KVPoll.Failed:
        mgr, room = self.kv_mgr, self.bootstrap_room
        expected = _expected_prefill_ranks(self)
        done = mgr.prefill_response_tracker.get(room) or set()
        silent = [r for r in expected if r not in done]
        if len(expected) > 1 and silent:
            with mgr.failure_lock:
                reason = mgr.failure_records.get(room, "timed out")
                mgr.failure_records[room] = (
                    f"{reason}; no transfer status from prefill rank(s) {silent} "
                    f"(success from {sorted(done)} of {expected})"
                )
        _state(mgr, _MANIFESTS).pop(room, None)
    return result


def forget_received_room(original, self, *args, **kwargs):
    """AROUND `CommonKVReceiver._clear`: drop the room's manifests."""
    room = self.bootstrap_room
    try:
        return original(self, *args, **kwargs)
    finally:
        _state(self.kv_mgr, _MANIFESTS).pop(room, None)
        _state(self.kv_mgr, _EXPECTED).pop(room, None)
        inbox = _state(self.kv_mgr, _INBOX)
        for key in [k for k in list(inbox) if k[0] == room]:
            inbox.pop(key, None)
