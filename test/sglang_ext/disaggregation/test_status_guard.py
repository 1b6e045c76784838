"""CPU (one PD run of 3 processes; the rest in process):
the guard on a decode's status socket (sglang_ext/disaggregation/status_guard.py).

SGLang 0.5.23's decode thread trusts every message on that socket: an AUX_DATA with an aux index
past its buffer writes the sender's bytes into whatever memory follows, and one with a
non-number, or a STAGING_REQ on a decode without staging, raises and ends the thread, after which
every room waits until it times out (docs/upstream.md). Checked here:

- in process, a table of hostile messages of every kind the thread dispatches (AUX_DATA,
  CHUNK_READY, STAGING_REQ, ABORT_ACK, statuses; bad indices, wrong types, wrong frame counts,
  oversize, forged and replayed statuses with the secret) each gives its reason, plus seeded
  mutations of a valid message of each kind for the waiting room; good messages pass;
- replays and limits, through SGLang's receiver (the plugin's, its real `__init__` and
  `send_metadata`) and its decode thread: an earlier use's Failed before the metadata, a Success
  repeated within its use, a rank the room did not target, the timeout's reason, statuses SGLang
  would only log, frames shown without a whole-frame repr, the socket's receive queue, and what
  SGLang's metadata channel can make a prefill keep;
- SGLang's real decode thread (`MooncakeKVManager.start_decode_thread`) on a real socket: behind
  the guard it drops every one of them, writes nothing out of place and still commits a room;
  without it (SGLang's own manager) an aux index past the end writes into the next buffer and
  each of four messages ends the thread (the control);
- the real thing, in the owned-page PD harness (`helpers/sglang_pd_harness.py`) (2 prefill CP ranks, a plugin decode built
  by `DecodePreallocQueue._init_kv_manager`, Mooncake TCP on 127.0.0.1, the secret set): the
  fuzz hits the decode's status socket while a room is in flight, the room still commits byte
  exact, a rank's signed Failed still fails the next with its reason, the one after commits.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import ctypes  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_pd_harness as PD  # noqa: E402
from helpers.status_guard_decode import (  # noqa: E402
    ABORT_GENERATION,
    AUX_INDEX,
    EARLIER,
    ITEM_LENS,
    NOW,
    ROOM,
    PrefillThread,
    SECRET,
    SLOTS,
    AuxBuffers,
    DecodeThread,
    aux_message,
    decode_manager,
    idle_manager,
    make_receiver,
    metadata_message,
    prefill_manager,
    rank_claims,
    status_message,
    success_message,
    wait_for,
)

register_cpu_ci(est_time=35, suite="nsa-cp-test-cpu")


class Case(NamedTuple):
    name: str
    msg: list
    reason: str  # a piece of the reason the guard must give
    needs: str = "any"  # "secret": hostile only to a decode with the secret; "staging": only with staging on


def hostile_messages(room, aux_index, kv_args, pages=4, use=NOW) -> list[Case]:
    """Messages SGLang's decode thread must never see, for a decode whose room `room` is in flight
    (aux slot `aux_index`, `pages` pages from 2 CP ranks, nonce `use`) and whose aux buffers are
    `kv_args`'. Rooms other than `room` are not waiting on it."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import sign_status

    item, slots, buffers = kv_args.aux_item_lens[0], kv_args.aux_data_lens[0] // kv_args.aux_item_lens[0], len(kv_args.aux_data_ptrs)  # fmt: skip
    data, idx, other = b"\xab" * item, b"%d" % aux_index, room + 10**6
    good_aux = aux_message(room, 0, idx, data)
    manifest = encode_manifest(rank_claims(1, pages), room, 1, SECRET, uses=[use])
    failed = status_message(room, 0, 1, b"rank 1 failed")
    chunk = [b"CHUNK_READY", b"%d" % room, b"0", b"0", b"1", b"writer", b"0"]
    staging = [b"STAGING_REQ", b"%d" % room, b"0", b"1", b"session"]
    return [
        # AUX_DATA: SGLang writes data at aux_data_ptrs[buffer] + item_len * index, unchecked
        Case("aux index one past the buffer", aux_message(room, 0, b"%d" % slots, data), f"aux index {slots} is out of range (0..{slots - 1})"),  # fmt: skip
        Case("aux index far past the buffer", aux_message(room, 0, b"1000000000", data), "aux index 1000000000 is out of range"),
        Case("negative aux index", aux_message(room, 0, b"-1", data), "aux index <2 B 2d31> is not a decimal number"),
        Case("aux index not a number", aux_message(room, 0, b"three", data), "is not a decimal number"),
        Case("aux index int() takes: '0_3'", aux_message(room, 0, b"0_3", data), "is not a decimal number"),
        Case("aux index int() takes: ' 3'", aux_message(room, 0, b" 3", data), "is not a decimal number"),
        Case("aux index in Arabic-Indic digits", aux_message(room, 0, "٣".encode(), data), "is not a decimal number"),
        Case("aux index of 25 digits", aux_message(room, 0, b"9" * 25, data), "aux index of 25 bytes"),
        Case("aux buffer index past the buffers", aux_message(room, buffers, idx, data), f"aux buffer index {buffers} is out of range"),  # fmt: skip
        Case("AUX_DATA room not a number", [b"AUX_DATA", b"seven", *good_aux[2:]], "room <5 B 736576656e> is not a decimal number"),
        Case("AUX_DATA of 1 frame", [b"AUX_DATA"], "AUX_DATA of 1 frames (6 expected)"),
        Case("AUX_DATA of 5 frames", good_aux[:5], "AUX_DATA of 5 frames (6 expected)"),
        Case("AUX_DATA of 7 frames", good_aux + [b""], "AUX_DATA of 7 frames (6 expected)"),
        Case("length frame of 3 bytes", good_aux[:4] + [b"\x00\x00\x08", data], "a data length frame of 3 bytes"),
        Case("declared length differs", aux_message(room, 0, idx, data, declared=item + 1), f"{item} data bytes, {item + 1} declared"),  # fmt: skip
        Case("oversized aux data", aux_message(room, 0, idx, data + b"\xab" * 4096), f"{item + 4096} data bytes for an aux slot of {item}"),  # fmt: skip
        Case("another slot than the room's", aux_message(room, 0, b"%d" % ((aux_index + 1) % slots), data), f"this decode gave room {room} aux index {aux_index}"),  # fmt: skip
        Case("AUX_DATA for a room not asked for", aux_message(other, 0, idx, data), f"AUX_DATA for room {other}, which this decode gave no aux index"),  # fmt: skip
        # CHUNK_READY and STAGING_REQ: staging messages (SGLang asserts on a STAGING_REQ without staging)
        Case("CHUNK_READY without staging", chunk, "CHUNK_READY on a decode without staging"),
        Case("CHUNK_READY garbage without staging", [b"CHUNK_READY", b"\xff"], "CHUNK_READY on a decode without staging"),
        Case("STAGING_REQ without staging", staging, "STAGING_REQ on a decode without staging"),
        Case("STAGING_REQ of 1 frame without staging", [b"STAGING_REQ"], "STAGING_REQ on a decode without staging"),
        Case("CHUNK_READY pages past the room", chunk[:3] + [b"3", b"2"] + chunk[5:], f"pages 3..4 of room {room}, which has {pages}", "staging"),  # fmt: skip
        Case("CHUNK_READY chunk not a number", chunk[:2] + [b"x"] + chunk[3:], "chunk index <1 B 78> is not a decimal number", "staging"),  # fmt: skip
        Case("CHUNK_READY of 6 frames", chunk[:6], "CHUNK_READY of 6 frames (7 expected)", "staging"),
        Case("CHUNK_READY writer id not ASCII", chunk[:5] + [b"\xff" * 8, b"0"], "writer id", "staging"),
        Case("CHUNK_READY for a room not waiting", [chunk[0], b"%d" % other, *chunk[2:]], "which is not waiting on this decode", "staging"),  # fmt: skip
        Case("STAGING_REQ chunk index 10^12", staging[:2] + [b"1000000000000"] + staging[3:], "chunk index 1000000000000 is out of range", "staging"),  # fmt: skip
        Case("STAGING_REQ pages past the room", staging[:3] + [b"%d" % (pages + 1)] + staging[4:], f"page count {pages + 1} is out of range", "staging"),  # fmt: skip
        Case("STAGING_REQ of 4 frames", staging[:4], "STAGING_REQ of 4 frames (5 to 6 expected)", "staging"),
        # ABORT_ACK
        Case("ABORT_ACK of 1 frame", [b"ABORT_ACK"], "ABORT_ACK of 1 frames (3 to 4 expected)"),
        Case("ABORT_ACK of 5 frames", [b"ABORT_ACK", b"%d" % room, b"0", b"1", b"1"], "ABORT_ACK of 5 frames"),
        Case("ABORT_ACK room not a number", [b"ABORT_ACK", b"\x00", b"0", b"1"], "room <1 B 00> is not a decimal number"),
        Case("ABORT_ACK negative generation", [b"ABORT_ACK", b"%d" % room, b"0", b"-5"], "generation <2 B 2d35> is not a decimal number"),  # fmt: skip
        Case("ABORT_ACK without a generation", [b"ABORT_ACK", b"%d" % room, b"0"], f"ABORT_ACK of generation None for room {room}"),  # fmt: skip
        Case("ABORT_ACK of another generation", [b"ABORT_ACK", b"%d" % room, b"0", b"%d" % (ABORT_GENERATION + 1)], "which this decode does not hold for that abort"),  # fmt: skip
        Case("ABORT_ACK for a room not held", [b"ABORT_ACK", b"%d" % other, b"0", b"%d" % ABORT_GENERATION], f"for room {other}, which this decode does not hold"),  # fmt: skip
        # statuses: [room, status, prefill rank, reason?, manifest?, status signature?]
        Case("status of 1 frame", [b"%d" % room], "a status of 1 frames (3 to 6 expected)"),
        Case("status of 2 frames", [b"%d" % room, b"4"], "a status of 2 frames (3 to 6 expected)"),
        Case("status of 7 frames", failed + [b""] * 3, "a status of 7 frames"),
        Case("room not ASCII", [b"\xff\xfe", b"4", b"0"], "room <2 B fffe> is not a decimal number"),  # fmt: skip
        Case("status not a number", [b"%d" % room, b"Success", b"0"], "status <7 B 53756363657373> is not a decimal number"),
        Case("status not a KVPoll value", status_message(room, 9, 0), "status 9 is not a KVPoll value"),
        Case("status past a byte", status_message(room, 300, 0), "status 300 is out of range (0..255)"),
        Case("room past 63 bits", [b"9" * 19, b"4", b"0"], "room 9999999999999999999 is out of range"),
        Case("room of 5000 digits", [b"9" * 5000, b"4", b"0"], "room of 5000 bytes"),
        Case("prefill rank 2^20", status_message(room, 4, 1 << 20), "prefill rank 1048576 is out of range (0..65535)"),
        Case("status for a room not waiting", status_message(other, 0, 0, b"forged"), f"a Failed status for room {other}, which is not waiting on this decode"),  # fmt: skip
        Case("oversized reason", status_message(room, 0, 0, b"x" * (20 << 10)), "a failure reason of 20480 bytes"),
        Case("unknown extra frame", status_message(room, 0, 0, b"", b"extra"), "neither a manifest nor a status signature"),
        Case("manifest on a Failed", status_message(room, 0, 1, b"", manifest), "a manifest on a Failed status"),
        # with the secret: a Success proves itself by its manifest, anything else by its signature
        Case("Success without a manifest", status_message(room, 4, 1, b""), "a Success without an owned-page manifest", "secret"),  # fmt: skip
        Case("Success, manifest of another key", status_message(room, 4, 1, b"", encode_manifest(rank_claims(1, pages), room, 1, b"k" * 32, uses=[use])), "bad MAC", "secret"),  # fmt: skip
        Case("Success, unsigned manifest", status_message(room, 4, 1, b"", encode_manifest(rank_claims(1, pages), room, 1, None, uses=[use])), "does not sign", "secret"),  # fmt: skip
        Case("Success, manifest of rank 0 as rank 1", status_message(room, 4, 1, b"", encode_manifest(rank_claims(0, pages), room, 0, SECRET, uses=[use])), "bad MAC", "secret"),  # fmt: skip
        Case("Success replayed from an earlier use", status_message(room, 4, 1, b"", encode_manifest(rank_claims(1, pages), room, 1, SECRET, uses=[EARLIER])), "a replay", "secret"),  # fmt: skip
        Case("Failed, unsigned", failed, "an unsigned Failed status", "secret"),
        Case("Failed, signed with another key", failed + [sign_status(b"k" * 32, room, 1, 0, failed[3], [use])], "bad MAC", "secret"),  # fmt: skip
        Case("Failed, reason altered", failed + [sign_status(SECRET, room, 1, 0, b"other reason", [use])], "bad MAC", "secret"),  # fmt: skip
        Case("Failed, signature of a WaitingForInput", failed + [sign_status(SECRET, room, 1, 2, failed[3], [use])], "bad MAC", "secret"),  # fmt: skip
        Case("Failed, signed as rank 0", failed + [sign_status(SECRET, room, 0, 0, failed[3], [use])], "bad MAC", "secret"),  # fmt: skip
        Case("Failed replayed from an earlier use", failed + [sign_status(SECRET, room, 1, 0, failed[3], [EARLIER])], "a replay: a Failed status", "secret"),  # fmt: skip
        Case("Failed, signature cut short", failed + [sign_status(SECRET, room, 1, 0, failed[3], [use])[:-5]], "a malformed status signature", "secret"),  # fmt: skip
    ]  # fmt: skip


def good_messages(room, aux_index, kv_args, pages=4, secret=None) -> dict[str, list]:
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import sign_status

    reason = b"rank 1 failed"
    return {
        "AUX_DATA of the room's slot": aux_message(room, 0, b"%d" % aux_index, b"\x11" * kv_args.aux_item_lens[0]),
        "AUX_DATA, the last buffer": aux_message(room, len(kv_args.aux_data_ptrs) - 1, b"%d" % aux_index, b"\x22"),
        "ABORT_ACK": [b"ABORT_ACK", b"%d" % room, b"1", b"%d" % ABORT_GENERATION],
        "Success of rank 0": status_message(
            room, 4, 0, b"", encode_manifest(rank_claims(0, pages), room, 0, secret, uses=[NOW])
        ),
        "Success of rank 1, two destinations": status_message(
            room, 4, 1, b"", encode_manifest(rank_claims(1, pages), room, 1, secret, uses=[EARLIER, NOW])
        ),
        "Failed": status_message(
            room, 0, 1, reason, *([sign_status(secret, room, 1, 0, reason, [NOW])] if secret else [])
        ),
    }


KINDS = (b"AUX_DATA", b"CHUNK_READY", b"STAGING_REQ", b"ABORT_ACK")  # frame 0; anything else is a status


def kind(msg) -> str:
    return msg[0].decode() if msg[0] in KINDS else "status"


# Frames no numeric field takes (not ASCII decimal, or past 20 digits), nor any optional frame
_HOSTILE_FRAMES = [b"", b"-1", b"x", b"\xff\xfe", b"9" * 25, b"1_0", b" 1", b"1.0", b"0x1f", "٣".encode(), b"\x00" * 9]


def valid_messages(room, aux_index, kv_args) -> list[list]:
    """One well-formed message of each kind for `room`, waiting on a decode without the secret
    that gave it aux slot `aux_index` (CHUNK_READY and STAGING_REQ: with staging)."""
    return [
        aux_message(room, 0, b"%d" % aux_index, b"\x33" * kv_args.aux_item_lens[0]),
        [b"CHUNK_READY", b"%d" % room, b"0", b"0", b"1", b"writer", b"0"],
        [b"STAGING_REQ", b"%d" % room, b"0", b"1", b"session", b"0"],
        [b"ABORT_ACK", b"%d" % room, b"1", b"%d" % ABORT_GENERATION],
        status_message(room, 0, 1, b"reason"),
    ]


# Per kind: the frames a mutation may replace by a hostile one or delete (its numbers: any hostile
# frame there is wrong; deleting one shifts a non-number into a number's place, or leaves too few)
_NUMERIC = {b"AUX_DATA": (1, 2, 3, 4), b"CHUNK_READY": (1, 2, 3, 4, 6), b"STAGING_REQ": (1, 2, 3),
            b"ABORT_ACK": (1, 2, 3), b"status": (0, 1, 2)}  # fmt: skip


def mutated_messages(room, kv_args, aux_index, per_kind=30, seed=0) -> list[list]:
    """`per_kind` seeded mutations of each of `valid_messages(room, aux_index, ...)`: a numeric
    frame replaced by a hostile one or deleted, or a hostile frame appended past the frames the
    kind takes. Aimed at a waiting room and its own aux slot, so only the guard's checks of the
    mutated frame can drop them."""
    rng = random.Random(seed)
    out = []
    for template in valid_messages(room, aux_index, kv_args):
        numeric = _NUMERIC[template[0] if template[0] in _NUMERIC else b"status"]
        for _ in range(per_kind):
            msg, op, at = list(template), rng.randrange(3), rng.choice(numeric)
            if op == 0:
                msg[at] = rng.choice(_HOSTILE_FRAMES)
            elif op == 1:
                del msg[at]
            else:
                msg.append(rng.choice(_HOSTILE_FRAMES))
            out.append(msg)
    return out


# ---- the guard on a decode manager in process (helpers/status_guard_decode.py) -----------------------


def test_every_hostile_message_gets_its_reason():
    """Each hostile message -> its reason, within 50 ms, for the decode configuration it is hostile
    to; good messages of every kind -> None, with and without the secret."""
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import decode_message_problem

    aux = AuxBuffers()
    cases = hostile_messages(ROOM, AUX_INDEX, aux.kv_args)
    kinds = {kind(c.msg) for c in cases}
    # docs/disagg.md states these counts (63 hostile messages of 5 kinds): change both together
    assert len(cases) == 63 and len(kinds) == 5, (len(cases), kinds)
    for case in cases:
        mgr = decode_manager(
            secret=SECRET if case.needs == "secret" else None, staging=case.needs == "staging", aux=aux
        )
        start = time.monotonic()
        problem = decode_message_problem(mgr, case.msg)
        assert time.monotonic() - start < 0.05, case.name
        assert problem is not None and case.reason in problem, f"{case.name}: {problem!r}"
        if case.needs == "secret":  # without the secret SGLang's rule applies: not the guard's business
            assert decode_message_problem(decode_manager(aux=aux), case.msg) is None, case.name
    for secret in (None, SECRET):
        for name, msg in good_messages(ROOM, AUX_INDEX, aux.kv_args, secret=secret).items():
            assert decode_message_problem(decode_manager(secret=secret, aux=aux), msg) is None, (name, secret)
    assert decode_message_problem(decode_manager(), []) == "an empty message"
    assert decode_message_problem(decode_manager(), [b"7", "4", b"0"]) == "a frame that is not bytes"


def test_mutations_aimed_at_a_waiting_room_are_each_dropped_by_their_own_check():
    """The unmutated messages pass the guard (a decode without the secret, with and without
    staging: their room is waiting, the aux slot is its own), so a mutation is dropped only if
    the guard checks the frame it changed; the test fails for any that gets through."""
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import decode_message_problem

    aux = AuxBuffers()
    for staging in (False, True):
        mgr = decode_manager(staging=staging, aux=aux)
        for msg in valid_messages(ROOM, AUX_INDEX, aux.kv_args):
            problem = decode_message_problem(mgr, msg)
            assert (problem is None) == (staging or kind(msg) not in ("CHUNK_READY", "STAGING_REQ")), (msg, problem)
        mutations = mutated_messages(ROOM, aux.kv_args, AUX_INDEX)
        assert len(mutations) == 150 and len({kind(m) for m in mutations}) == 5
        for msg in mutations:
            assert decode_message_problem(mgr, msg) is not None, f"let through (staging {staging}): {msg}"


def test_a_shared_kv_prefill_signs_what_the_guard_checks():
    """The prefill side of the status signature: a shared-KV rank with the secret signs every
    status it sends without a manifest, for the uses it was asked for; the decode's guard takes
    it, and not once its reason or status is changed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import OwnedPageKVManager
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import decode_message_problem

    prefill = object.__new__(OwnedPageKVManager)
    prefill.__dict__.update(
        kv_status_msg_tag=None, kv_status_msg_carries_reason=True, owned_pages_ledger=object(), outgoing_manifests={},
        destination_nonces={ROOM: {"session": NOW}}, pd_secret=SECRET, attn_tp_rank=0, pp_size=1, attn_cp_size=2,
        pp_rank=0, attn_cp_rank=1,
    )  # fmt: skip
    msg = prefill._encode_kv_status_message(bootstrap_room=ROOM, status=KVPoll.Failed, failure_reason="lost page 3")
    assert len(msg) == 5 and msg[:4] == [b"7", b"0", b"1", b"lost page 3"], msg
    decode = decode_manager(secret=SECRET)
    assert decode_message_problem(decode, msg) is None
    assert "bad MAC" in decode_message_problem(decode, msg[:3] + [b"no page lost"] + msg[4:])
    decode.defer_decode_allocation = True  # where SGLang acts on a WaitingForInput
    assert "bad MAC" in decode_message_problem(decode, [msg[0], b"2", *msg[2:]])
    decode.room_nonces[ROOM] = b"x" * 16  # a later use of the room
    assert "a replay" in decode_message_problem(decode, msg)
    prefill.pd_secret = None
    assert len(prefill._encode_kv_status_message(bootstrap_room=ROOM, status=KVPoll.Failed, failure_reason="r")) == 4


def test_drops_are_logged_at_most_once_per_10_s_with_the_claimed_origin(caplog):
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog, claimed_origin, decode_message_problem

    now = [0.0]
    drops = DropLog(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sglang_nsa_cp.sglang_ext.disaggregation.status_guard"):
        for t in (0.0, 1.0, 9.9, 10.0, 12.0):
            now[0] = t
            drops.note(claimed_origin(status_message(5, 0, 3)), "an unsigned Failed status")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and drops.count == 5, lines
    assert "(4 so far), a status claiming room 5 from prefill rank 3: an unsigned Failed status" in lines[1], lines[1]
    assert "does not name it" in lines[0]
    now[0] = 30.0  # a real rank's status after its room failed: counted, not a warning
    drops.note(
        claimed_origin(status_message(5, 4, 1)), decode_message_problem(decode_manager(), status_message(5, 4, 1))
    )
    assert drops.count == 6 and len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
    assert claimed_origin(aux_message(5, 0, b"1", b"x")) == "AUX_DATA claiming room 5"
    assert claimed_origin([b"ABORT_ACK", b"\xff" * 100, b"2"]).startswith(
        "ABORT_ACK claiming room <100 B ffffffffffffffff...>"
    )


# ---- SGLang's real decode thread on a real socket ------------------------------------------------------


def test_behind_the_guard_sglangs_decode_thread_drops_the_fuzz_and_still_commits():
    """Every hostile message and mutation for a decode with the secret, pushed to SGLang's running
    decode thread: all dropped, nothing written to any aux slot or past the buffers; then the room's
    metadata lands in its slot and its two manifests commit it, so the thread is alive."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    aux = AuxBuffers()
    mgr = decode_manager(secret=SECRET, aux=aux)
    hostile = [c.msg for c in hostile_messages(ROOM, AUX_INDEX, aux.kv_args) if c.needs in ("any", "secret")]
    hostile += mutated_messages(ROOM, aux.kv_args, AUX_INDEX)
    decode = DecodeThread(mgr)
    try:
        decode.push(hostile)
        wait_for(lambda: mgr.dropped_messages.count == len(hostile), f"{mgr.dropped_messages.count} of {len(hostile)} dropped")  # fmt: skip
        assert decode.thread.is_alive() and not aux.backing.any(), "a hostile message got through"
        good = good_messages(ROOM, AUX_INDEX, aux.kv_args, secret=SECRET)
        decode.push([good["AUX_DATA of the room's slot"], good["Success of rank 0"], good["Success of rank 1, two destinations"]])  # fmt: skip
        wait_for(lambda: mgr.request_status[ROOM] == KVPoll.Success, f"room {ROOM}: {mgr.request_status[ROOM]}, {mgr.failure_records}")  # fmt: skip
        assert bytes(aux.slot(0, AUX_INDEX)) == b"\x11" * ITEM_LENS[0] and int(aux.backing.astype(bool).sum()) == ITEM_LENS[0]  # fmt: skip
        assert decode.thread.is_alive() and mgr.dropped_messages.count == len(hostile)
    finally:
        decode.close()


KILLERS = {
    "AUX_DATA room not a number": [b"AUX_DATA", b"seven", b"0", b"3", struct.pack(">I", 1), b"x"],
    "AUX_DATA of 4 frames": [b"AUX_DATA", b"7", b"0", b"3"],
    "AUX_DATA buffer index past the buffers": aux_message(ROOM, 2, b"3", b"x"),
    "STAGING_REQ without staging": [b"STAGING_REQ", b"7", b"0", b"1", b"session"],
}


@pytest.mark.parametrize("killer", sorted(KILLERS))
def test_without_the_guard_one_message_writes_past_the_buffer_and_one_ends_the_thread(killer, monkeypatch):
    """The control, SGLang's own decode manager: an AUX_DATA at the aux index one past the last
    slot writes its bytes into the memory after the buffer; `killer` raises in the decode thread,
    which ends it, and the room's Success then goes unread."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_type.__name__))
    aux = AuxBuffers()
    mgr = decode_manager(stock=True, aux=aux)
    decode = DecodeThread(mgr)
    try:
        decode.push([aux_message(ROOM, 1, b"%d" % SLOTS, b"\xee" * ITEM_LENS[1])])
        wait_for(lambda: aux.neighbor[: ITEM_LENS[1]].all(), "the write past the buffer")
        assert decode.thread.is_alive()
        decode.push([KILLERS[killer]])
        wait_for(lambda: not decode.thread.is_alive(), f"{killer}: the thread survived")
        decode.push([status_message(ROOM, 4, 0), status_message(ROOM, 4, 1)])
        time.sleep(0.3)
        assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and raised, raised
    finally:
        decode.close()


# ---- replays and limits (a second review's findings), through SGLang's receiver and decode thread ---------


def _signed_failed(rank, use, room=ROOM, reason=b"rank 1 failed"):
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import sign_status

    return status_message(room, 0, rank, reason, sign_status(SECRET, room, rank, 0, reason, [use]))


def test_a_signed_failed_of_an_earlier_use_cannot_fail_a_reused_room_before_its_metadata():
    """Finding 1: until `send_metadata` drew the room's nonce, a Failed signed for any use of the
    room failed it: a captured one, or a late genuine one after a re-bootstrap, failed the new use
    while it waited for memory. The receiver now draws the nonce when SGLang creates it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=SECRET)
    receiver = make_receiver(mgr, metadata=False)
    assert mgr.request_status[ROOM] == KVPoll.Bootstrapping
    decode = DecodeThread(mgr)
    try:
        decode.push([_signed_failed(1, EARLIER)])
        wait_for(lambda: mgr.dropped_messages.count == 1 or mgr.request_status[ROOM] == KVPoll.Failed, "the Failed")
        assert mgr.request_status[ROOM] == KVPoll.Bootstrapping and ROOM not in mgr.failure_records, mgr.failure_records
        assert "a replay" in mgr.dropped_messages.recent[-1][1], mgr.dropped_messages.recent
        decode.push([_signed_failed(1, receiver.use_nonce)])  # this use's own Failed still counts
        wait_for(lambda: mgr.request_status[ROOM] == KVPoll.Failed, "this use's Failed")
        assert mgr.failure_records[ROOM] == "rank 1 failed"
    finally:
        decode.close()


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no secret"])
def test_a_success_replayed_within_its_use_is_dropped_and_the_room_commits(secret):
    """Finding 2: a second copy of rank 0's genuine Success became "a second Success from prefill
    rank 0" and failed the room. A repeat from the same rank for the same use is now dropped."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=secret)
    make_receiver(mgr)
    use = mgr.room_nonces[ROOM]
    decode = DecodeThread(mgr)
    try:
        decode.push([success_message(0, secret=secret, use=use)] * 2)
        wait_for(lambda: len(mgr.prefill_response_tracker[ROOM]) == 1 and mgr.dropped_messages.count == 1, "the two Successes")  # fmt: skip
        decode.push([success_message(1, secret=secret, use=use)])
        wait_for(lambda: mgr.request_status[ROOM] in (KVPoll.Success, KVPoll.Failed), "the room's outcome")
        assert mgr.request_status[ROOM] == KVPoll.Success, mgr.failure_records
    finally:
        decode.close()


@pytest.mark.parametrize("owner_sharded", [False, True], ids=["replicated CP prefill", "shared-KV prefill"])
def test_a_keyed_decode_serves_a_replicated_prefill_as_sglang_does(owner_sharded):
    """Issue 47: the flag needs the secret, and an opted-in decode with it must still serve a
    replicated CP (or non-CP) prefill, which sends SGLang's statuses: no manifest, no signature.
    Such a room commits on SGLang's rule; a room of an owner-sharded prefill still drops them."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=SECRET)
    make_receiver(mgr, owner_sharded=owner_sharded)
    decode = DecodeThread(mgr)
    try:
        decode.push([status_message(ROOM, int(KVPoll.Success), rank, b"") for rank in (0, 1)])
        if owner_sharded:
            wait_for(lambda: mgr.dropped_messages.count == 2, "both unsigned Successes dropped")
            assert mgr.request_status[ROOM] == KVPoll.Bootstrapping, mgr.failure_records
        else:
            wait_for(lambda: mgr.request_status[ROOM] == KVPoll.Success, f"SGLang's commit: {mgr.failure_records}")
            assert mgr.dropped_messages.count == 0, mgr.dropped_messages.recent
    finally:
        decode.close()


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no secret"])
def test_only_the_prefill_ranks_a_room_targeted_count_toward_its_commit(secret):
    """Finding 8: a Success from prefill rank 2 (2 % 2 == CP rank 0), which the room never
    targeted, counted as CP rank 0's and committed the room without rank 0. It is now dropped,
    and the room commits when rank 0 answers."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=secret)
    make_receiver(mgr)
    use = mgr.room_nonces[ROOM]
    decode = DecodeThread(mgr)
    try:
        decode.push(
            [success_message(2, secret=secret, use=use, claims_rank=0), success_message(1, secret=secret, use=use)]
        )
        wait_for(lambda: 1 in mgr.prefill_response_tracker[ROOM], "rank 1's Success")
        time.sleep(0.2)
        assert mgr.request_status[ROOM] == KVPoll.Bootstrapping, (mgr.request_status[ROOM], mgr.failure_records)
        assert "room 7 targets prefill ranks [0, 1]" in mgr.dropped_messages.recent[-1][1], mgr.dropped_messages.recent
        decode.push([success_message(0, secret=secret, use=use)])
        wait_for(lambda: mgr.request_status[ROOM] == KVPoll.Success, f"the commit: {mgr.failure_records}")
    finally:
        decode.close()


def drop_then_time_out(mgr, make_messages, what: str):
    """A receiver of ROOM on `mgr` (no prefill to notify); `make_messages()` (made once the
    receiver holds the room's use nonce) pushed through the decode
    thread until the guard dropped them all; then the room's wait timed out. Returns the receiver
    (still registered: `clear()` it), the drop reasons the guard logged and the room's status
    before the timeout."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver = make_receiver(mgr)
    receiver.abort_notified = True  # no prefill to notify
    messages = make_messages()
    decode = DecodeThread(mgr)
    try:
        decode.push(messages)
        wait_for(lambda: mgr.dropped_messages.count == len(messages), what)
    finally:
        decode.close()
    reasons = [reason for _, reason in mgr.dropped_messages.recent]
    before = mgr.request_status.get(ROOM)
    mgr.waiting_timeout = 0
    assert receiver._check_waiting_timeout() == KVPoll.Failed
    return receiver, reasons, before


def test_a_timeout_names_what_the_guard_dropped_for_the_room():
    """Finding 5: the secret on the decode only ended in a timeout whose reason said the prefill
    ranks sent nothing, though both did; the variable appeared only in the rate-limited drop log.
    The timeout's reason now carries the room's last dropped message, which names it."""

    mgr = idle_manager(secret=SECRET)
    receiver, _, _ = drop_then_time_out(
        mgr,
        lambda: [success_message(rank, secret=None, use=mgr.room_nonces[ROOM]) for rank in (0, 1)],
        "both unkeyed Successes dropped",
    )
    reason = mgr.failure_records[ROOM]
    assert "no accepted transfer status from prefill rank(s) [0, 1]" in reason, reason
    assert "the last message dropped for this room: a status claiming room 7 from prefill rank 1" in reason, reason
    assert "SGLANG_NSA_CP_PD_SECRET" in reason, reason
    receiver.clear()
    assert ROOM not in mgr.dropped_messages.last_by_room and ROOM not in mgr.room_nonces


def test_a_keyed_room_fed_no_manifests_names_the_secret_when_it_times_out():
    """Issue 47: a keyed decode fed by an owner-sharded prefill that sends no manifests (SGLang's
    own sharded prefill, or the plugin's without the flag) timed out saying only 'a Success without
    an owned-page manifest'. The timeout's reason now names the variable and what the prefill needs."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=SECRET)
    messages = [status_message(ROOM, KVPoll.Success, rank, b"") for rank in (0, 1)]
    receiver, _, _ = drop_then_time_out(mgr, lambda: messages, "both manifest-less Successes dropped")
    reason = mgr.failure_records[ROOM]
    assert "a Success without an owned-page manifest" in reason and "SGLANG_NSA_CP_PD_SECRET" in reason, reason
    receiver.clear()


def test_a_status_answering_no_use_is_reported_as_a_missing_nonce_not_a_replay():
    """Issue 47: when a prefill rank held no nonce of the decode for a room (evicted past its bound,
    or its metadata never reached that rank), its Success carried a manifest of no use and its
    signed Failed (which names the bound) a signature of no use: the decode dropped both as "a
    replay", and the room timed out saying so. Both are now reported as the missing nonce, the
    Failed with the prefill's (keyed) reason, in the drop log and the room's timeout reason; a
    status of no use still does not count (an earlier one of the room would match it too)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import sign_status

    mgr = idle_manager(secret=SECRET)
    said = b"owned-page transfer of room 7: no use nonce held for decode 127.0.0.1:17001"
    failed = status_message(ROOM, KVPoll.Failed, 1, said)
    messages = [
        status_message(ROOM, KVPoll.Success, 0, b"", encode_manifest(rank_claims(0), ROOM, 0, SECRET, uses=[])),
        failed + [sign_status(SECRET, ROOM, 1, KVPoll.Failed, said, [])],
    ]
    receiver, reasons, before = drop_then_time_out(mgr, lambda: messages, "both statuses of no use dropped")
    assert not any("replay" in r for r in reasons), reasons
    assert "a manifest of room 7 that answers no use of the room: the prefill rank held no use nonce" in reasons[0]
    assert "a Failed status of room 7 signed for no use of the room" in reasons[1] and said.decode() in reasons[1]
    assert before not in (KVPoll.Success, KVPoll.Failed)  # neither counted
    assert "no use nonce held for decode 127.0.0.1:17001" in mgr.failure_records[ROOM], mgr.failure_records[ROOM]
    receiver.clear()


def test_a_peers_text_never_reaches_a_timed_out_rooms_reason():
    """Issue 47: a dropped message's frames were shown by their repr, and the room's last drop goes
    into the reason a timed-out room returns to its client: an unauthenticated peer could write 40
    characters of its choosing there. The guard now names a frame only by its size and first 8
    bytes in hex, and the reason's drop part is bounded."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager(secret=SECRET)
    text = b"CALL-555-0100-FOR-SUPPORT"
    messages = [status_message(ROOM, KVPoll.Failed, 1, b"", text), [b"%d" % ROOM, b"%d" % KVPoll.Failed, text]]
    receiver, _, _ = drop_then_time_out(mgr, lambda: messages, "both dropped")
    reason = mgr.failure_records[ROOM]
    assert "CALL" not in reason and "SUPPORT" not in reason, reason
    assert f"from prefill rank <{len(text)} B {text[:8].hex()}...>: prefill rank of 25 bytes" in reason, reason
    assert all("CALL" not in origin + why for origin, why in mgr.dropped_messages.recent)  # nor in the log
    receiver.clear()


def test_statuses_sglang_would_only_log_are_dropped(caplog):
    """Finding 6: without the secret each Bootstrapping, Transferring or WaitingForInput status
    (while the decode does not defer allocation) reached SGLang, which logged a warning for each:
    10,000 messages, 10,000 lines. Dropped now, with at most one line per 10 s."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = idle_manager()
    make_receiver(mgr)
    statuses = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring] * 100
    decode = DecodeThread(mgr)
    try:
        with caplog.at_level(logging.WARNING):
            decode.push([status_message(ROOM, s, i % 2, b"") for i, s in enumerate(statuses)])
            wait_for(lambda: mgr.dropped_messages.count == len(statuses), f"{mgr.dropped_messages.count} dropped")
        assert mgr.request_status[ROOM] == KVPoll.Bootstrapping
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "which SGLang's decode would only log" in lines[0], lines
    finally:
        decode.close()


class _ReprSpy(bytes):
    """A frame that records each repr of it (slicing one gives plain bytes)."""

    reprs: list = []

    def __repr__(self):
        _ReprSpy.reprs.append(len(self))
        return super().__repr__()


def test_the_guard_cuts_a_frame_before_it_reprs_it():
    """Finding 4: the guard's log took `repr` of a whole frame before cutting it to 40 characters,
    ~10 ms of the decode thread per 1 MiB frame. It now reprs only the first 40 bytes."""
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog, guard_recv

    mgr, huge = decode_manager(), _ReprSpy(b"\xff" * (1 << 20))
    messages = [[huge, b"4", b"0"], [b"7", b"4", huge], aux_message(ROOM, 0, huge, b"x"), [b"ABORT_ACK", huge, b"1"]]
    drops = DropLog()
    for msg in messages:
        assert guard_recv(mgr, lambda msg=msg: msg, drops)() is None
    assert drops.count == len(messages) and _ReprSpy.reprs == [], _ReprSpy.reprs
    assert "room <1048576 B ffffffffffffffff...>" in drops.recent[0][0] and len(" ".join(drops.recent[0])) < 150, (
        drops.recent[0]
    )
    assert "rank <1048576 B ffffffffffffffff...>" in drops.recent[1][0] and len(" ".join(drops.recent[1])) < 150, (
        drops.recent[1]
    )


class _ScanSpy(bytes):
    """A frame that records each digit scan and hash of it (each costs O(size))."""

    scans: list = []

    def isdigit(self):
        _ScanSpy.scans.append(("isdigit", len(self)))
        return super().isdigit()

    def __hash__(self):
        _ScanSpy.scans.append(("hash", len(self)))
        return super().__hash__()


def test_a_long_frame_is_measured_before_it_is_scanned():
    """Issue 47: a 1 MiB all-digit room frame cost the decode's guard ~0.9 ms (its digit check ran
    before its length check; the kind lookup hashed the frame, ~0.4 ms more) and the prefill's
    nonce note ~1.5 ms. Now no frame longer than a room number or a kind tag is scanned or hashed,
    on the decode (SGLang's decode thread behind the guard) or on the prefill's bootstrap socket."""
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog, guard_recv

    digits = _ScanSpy(b"7" * (1 << 20))
    mgr, drops = decode_manager(), DropLog()
    messages = [
        [digits, b"4", b"0"],
        [b"7", digits, b"0"],
        aux_message(ROOM, 0, digits, b"x"),
        [b"ABORT_ACK", digits, b"1"],
    ]
    for msg in messages:
        assert guard_recv(mgr, lambda msg=msg: msg, drops)() is None
    assert drops.count == len(messages) and _ScanSpy.scans == [], _ScanSpy.scans
    assert "room of 1048576 bytes (at most 20 digits)" in drops.recent[0][1], drops.recent[0]
    prefill = object.__new__(conn.OwnedPageKVManager)
    prefill.destination_nonces = conn.NoncesByRoom()
    prefill._note_use_nonce([digits, *metadata_message(ROOM, "decode:1", NOW)[1:]])
    assert len(prefill.destination_nonces) == 0
    assert _ScanSpy.scans == [], _ScanSpy.scans


def test_each_success_is_parsed_once_and_its_manifest_decoded_once(monkeypatch):
    """Issue 47: the guard parsed a status and decoded (MAC-checked) its manifest, then the
    plugin's `parse_kv_status_message` did both again. Through SGLang's decode thread, a keyed
    room's two Successes now cost one manifest decode each and no second parse of SGLang's layout:
    the guard's parse rides on the message."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    from sglang_nsa_cp.sglang_ext.disaggregation import owned_pages, status_guard
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn

    decodes, sglang_parses = [], []

    def counting_decode(*args, **kwargs):
        decodes.append(kwargs.get("prefill_rank"))
        return owned_pages.decode_manifest(*args, **kwargs)

    sglangs_parse = CommonKVManager.parse_kv_status_message

    def counting_parse(self, msg):
        sglang_parses.append(msg)
        return sglangs_parse(self, msg)

    for module in (status_guard, conn):
        monkeypatch.setattr(module, "decode_manifest", counting_decode, raising=False)
    monkeypatch.setattr(CommonKVManager, "parse_kv_status_message", counting_parse)
    mgr = idle_manager(secret=SECRET)
    make_receiver(mgr)
    decode = DecodeThread(mgr)
    try:
        decode.push([success_message(rank, secret=SECRET, use=mgr.room_nonces[ROOM]) for rank in (0, 1)])
        wait_for(lambda: mgr.request_status[ROOM] == KVPoll.Success, f"the commit: {mgr.failure_records}")
    finally:
        decode.close()
    assert sorted(decodes) == [0, 1], f"manifest decodes per Success: {decodes}"
    assert sglang_parses == [], f"{len(sglang_parses)} second parse(s) of the status layout"


def test_a_fault_in_the_guard_is_surfaced_and_the_message_handled_as_sglang_would(monkeypatch, caplog):
    """Issue 47: the guard caught every exception and dropped the message, so a bug in it dropped
    genuine statuses and rooms timed out. A fault (here injected into the status check) is now
    counted (`DropLog.faults`), logged once per room with the room, and the message goes to SGLang's
    decode thread unchecked: a Failed fails its room with its reason. In a keyed room an unchecked
    Success still cannot commit (no checked manifest)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation import status_guard

    def broken_check(mgr, msg):
        raise RuntimeError("injected bug in the status check")

    monkeypatch.setattr(status_guard, "_status", broken_check)
    mgr = idle_manager()
    make_receiver(mgr, owner_sharded=False)
    decode = DecodeThread(mgr)
    try:
        with caplog.at_level(logging.ERROR):
            decode.push([status_message(ROOM, int(KVPoll.Failed), 0, b"rank 0 failed")] * 2)
            wait_for(lambda: mgr.dropped_messages.faults == 2, "both faults counted")
        assert mgr.request_status[ROOM] == KVPoll.Failed and mgr.failure_records[ROOM] == "rank 0 failed"
        assert mgr.dropped_messages.count == 0 and decode.thread.is_alive()
        lines = [r.getMessage() for r in caplog.records if "status guard failed" in r.getMessage()]
        assert len(lines) == 1 and f"room {ROOM}" in lines[0] and "injected bug" in lines[0], lines
    finally:
        decode.close()
    keyed = idle_manager(secret=SECRET)
    make_receiver(keyed)
    decode = DecodeThread(keyed)
    try:
        decode.push([success_message(rank, secret=SECRET, use=keyed.room_nonces[ROOM]) for rank in (0, 1)])
        wait_for(lambda: keyed.dropped_messages.faults == 2 and keyed.dropped_messages.count == 2, "both Successes")
        assert keyed.request_status[ROOM] == KVPoll.Bootstrapping, keyed.failure_records
        assert "no checked owned-page manifest" in keyed.dropped_messages.recent[-1][1]
    finally:
        decode.close()


def test_a_stalled_decode_takes_a_prefills_statuses_without_making_it_wait():
    """Finding 3 of issue 41 bounded the queue of one connection on SGLang's status socket (its
    RCVHWM is 0) to 64 messages; issue 47 measured what that costs: a prefill rank (SGLang's PUSH
    socket: SNDHWM 1,000, its 30 s send timeout, then the status is dropped) got only 8,500 keyed
    Successes out to a decode that had stopped reading. Built through the hook the socket now
    queues STATUS_RCVHWM (65,536) whole messages per connection: a decode 20,000 statuses behind
    still takes every one at once, and a sender past the limit still waits."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket_on_host

    import sglang_nsa_cp.sglang_ext.disaggregation.common.conn as hooks

    ctx = zmq.Context()
    with hooks.limited_status_frames(4096):
        port, pull = hooks.limit_status_frames(get_zmq_socket_on_host, ctx, zmq.PULL, host="127.0.0.1")
    _, sglangs = hooks.limit_status_frames(get_zmq_socket_on_host, ctx, zmq.PULL, host="127.0.0.1")
    assert pull.getsockopt(zmq.RCVHWM) == hooks.STATUS_RCVHWM == 1 << 16 and sglangs.getsockopt(zmq.RCVHWM) == 0
    push = ctx.socket(zmq.PUSH)  # SGLang's prefill status socket keeps ZMQ's default SNDHWM of 1,000
    push.connect(f"tcp://127.0.0.1:{port}")
    msg, sent, most = success_message(1), 0, 200_000
    while sent < most:  # nobody reads: the sender must come to a stop (after the TCP buffers fill)
        try:
            push.send_multipart(msg, flags=zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            if push.poll(1000, zmq.POLLOUT) == 0:
                break
    assert 20_000 <= sent < most, f"{sent} keyed Successes out to a decode that does not read"
    got = 0
    while pull.poll(200):
        pull.recv_multipart()
        got += 1
    assert got == sent, (got, sent)
    for sock in (push, pull, sglangs):
        sock.close(linger=0)
    ctx.term()


BOOTSTRAP_KILLERS = {  # each ends SGLang 0.5.23's own prefill bootstrap thread
    "non-ASCII frame 0": [b"\xff7", b"127.0.0.1", b"17001", b"s"],
    "non-ASCII session": [b"8", b"127.0.0.1", b"17001", b"\xe9"],
    "too few frames": [b"8", b"127.0.0.1"],
    "room not a number": [b"eight", *[b"1"] * 9],
    "metadata without a destination count": [b"8", b"127.0.0.1", b"17001", b"s", b"", b""],
    "registration of 5 frames": [b"None", b"127.0.0.1", b"17001", b"s", b"\x00" * 3],
    "WATERMARK without staging": [b"WATERMARK", b"1", b"2"],
}


@pytest.mark.parametrize("stock", [False, True], ids=["plugin", "sglang"])
def test_the_prefill_bootstrap_thread_survives_malformed_messages_and_serves_the_room(stock):
    """Issue 47: one non-ASCII (or otherwise malformed) message on a prefill's bootstrap socket ends
    SGLang's bootstrap thread (SGLang's bug: every later room then waits until it times out). The
    plugin's prefill screens that socket as the decode's: each message SGLang's parser would raise
    on is dropped with the rate-limited log line, and the genuine room's metadata, sent after them,
    is still served (the room's decode noted, WaitingForInput, the nonce held). The control, SGLang's
    own manager, loses its thread to the first message."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = prefill_manager(stock=stock)
    prefill = PrefillThread(mgr)
    try:
        prefill.push(BOOTSTRAP_KILLERS.values())
        prefill.push([metadata_message(ROOM, "decode:1", NOW)])
        if stock:
            prefill.thread.join(timeout=10)
            assert not prefill.thread.is_alive() and ROOM not in mgr.transfer_infos
            return
        wait_for(lambda: mgr.request_status[ROOM] == KVPoll.WaitingForInput, "the genuine room served")
        assert prefill.thread.is_alive()
        assert list(mgr.transfer_infos[ROOM]) == ["decode:1"] and dict(mgr.destination_nonces[ROOM]) == {
            "decode:1": NOW
        }
        assert mgr.dropped_messages.count == len(BOOTSTRAP_KILLERS) and 8 not in mgr.transfer_infos
        reasons = [why for _, why in mgr.dropped_messages.recent]
        assert "frame 0 <2 B ff37> is not short ASCII text" in reasons[0], reasons
        assert all("SGLang's parser raises" in r for r in reasons[1:-1]) and "without staging" in reasons[-1], reasons
    finally:
        prefill.close()


def test_what_the_metadata_channel_can_make_a_prefill_keep_is_bounded():
    """Finding 7: SGLang's (unauthenticated) metadata channel steered the prefill's per-room nonce
    map: 1,000 sessions in one room, a decode's nonce overwritten by a later message of its
    session, 100k rooms held, and enough injected sessions pushed a genuine manifest past the
    decode's size limit. Now a room holds at most the destinations its metadata declared, a
    session's first nonce stays, at most MAX_NOTED_ROOMS rooms and MAX_NOTED_SESSIONS sessions in all
    are held (rooms filled with injected sessions measured 139 KiB each: docs/disagg.md), and the
    decode's limit counts the nonces of its own destinations."""
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import MAX_USES, decode_manifest, encode_manifest

    prefill = object.__new__(conn.OwnedPageKVManager)
    prefill.destination_nonces = conn.NoncesByRoom()
    prefill._note_use_nonce(metadata_message(ROOM, "decode:1", NOW))
    prefill._note_use_nonce(metadata_message(ROOM, "decode:1", EARLIER))  # the same session again
    for i in range(1000):
        prefill._note_use_nonce(metadata_message(ROOM, f"injected:{i}", b"%016d" % i))
    assert dict(prefill.destination_nonces[ROOM]) == {"decode:1": NOW}
    frame = encode_manifest(rank_claims(1, 1), ROOM, 1, SECRET, uses=prefill.destination_nonces[ROOM].values())
    decode_manifest(frame, room=ROOM, prefill_rank=1, secret=SECRET, max_pages=1, use=NOW, max_uses=1)
    # a room of 256 pages and 8 decode destinations (decode TP 8 over prefill TP 1): all 8 fit
    for d in range(8):
        prefill._note_use_nonce(metadata_message(ROOM + 1, f"decode:{d}", b"%016d" % d, destinations=8, pages=256))
    claims = rank_claims(1, 256)
    frame = encode_manifest(claims, ROOM + 1, 1, SECRET, uses=prefill.destination_nonces[ROOM + 1].values())
    decode_manifest(frame, room=ROOM + 1, prefill_rank=1, secret=SECRET, max_pages=256, use=b"%016d" % 7, max_uses=8)
    template = metadata_message(0, "decode:1", NOW)
    for room in range(100, 100 + conn.MAX_NOTED_ROOMS + 100):
        prefill._note_use_nonce([b"%d" % room, *template[1:]])
    assert len(prefill.destination_nonces) == conn.MAX_NOTED_ROOMS and ROOM not in prefill.destination_nonces
    assert prefill.destination_nonces.sessions == conn.MAX_NOTED_ROOMS
    # rooms that each declare the most destinations, filled with injected sessions: the session
    # budget holds, the oldest rooms going first, and the newest room is whole
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conn, "MAX_NOTED_SESSIONS", 4 * MAX_USES)
        prefill.destination_nonces = conn.NoncesByRoom()
        template = metadata_message(0, "decode:1", NOW, destinations=MAX_USES)
        for room in range(10):
            for i in range(MAX_USES):
                prefill._note_use_nonce([b"%d" % room, *template[1:3], b"injected:%d" % i, *template[4:]])
        held = prefill.destination_nonces
        assert held.sessions == sum(map(len, held.values())) == 4 * MAX_USES, held.sessions
        assert list(held) == [6, 7, 8, 9] and all(len(uses) == MAX_USES for uses in held.values())
        held.drop(9)
        assert held.sessions == 3 * MAX_USES


def test_a_metadata_flood_for_made_up_rooms_never_evicts_a_room_in_flight():
    """Issue 47: 65,536 metadata messages for made-up rooms (no room id needed) evicted the genuine
    rooms' nonces from the prefill's map, oldest first, and every room in flight then failed
    although its pages arrived. A room a sender of the rank still serves (SGLang's sender
    registered its status) is now passed over: the flood evicts made-up rooms only, and the
    genuine room's destination check still finds its decode's nonce."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn

    prefill = object.__new__(conn.OwnedPageKVManager)
    prefill.request_status = {ROOM: KVPoll.WaitingForInput}  # this rank's sender serves ROOM
    prefill.destination_nonces = conn.NoncesByRoom(live=prefill._has_live_sender)
    prefill.transfer_infos = {ROOM: {"decode:1": SimpleNamespace(is_dummy=False, endpoint="127.0.0.1", dst_port=17001)}}
    prefill._note_use_nonce(metadata_message(ROOM, "decode:1", NOW))
    template = metadata_message(0, "attacker", NOW)
    for room in range(100, 100 + conn.MAX_NOTED_ROOMS + 100):
        prefill._note_use_nonce([b"%d" % room, *template[1:]])
    held = prefill.destination_nonces
    assert len(held) == conn.MAX_NOTED_ROOMS and dict(held[ROOM]) == {"decode:1": NOW}
    assert prefill._destination_problem(ROOM) is None
    assert 100 not in held and 100 + conn.MAX_NOTED_ROOMS + 99 in held  # made-up rooms went, oldest first
    del prefill.request_status[ROOM]  # its sender cleared: an ordinary room, evicted by the next flood
    for room in range(10**6, 10**6 + conn.MAX_NOTED_ROOMS):
        prefill._note_use_nonce([b"%d" % room, *template[1:]])
    assert ROOM not in held


# ---- the real thing: the owned-page PD harness ------------------------------------------------
def fuzz_status_socket(mgr, room) -> dict:
    """Runs in the harness's decode process right after `room`'s metadata went out (its pages
    still in flight: a prefill rank's first write waits). Pushes every hostile message for this
    decode (it has the secret) and the mutations to its status socket, waits until the guard
    dropped them all, and reports what changed."""
    import zmq

    args = mgr.kv_args
    slots = [bytes((ctypes.c_char * n).from_address(p)) for p, n in zip(args.aux_data_ptrs, args.aux_data_lens)]
    pages, use = mgr.room_expectations[room].kv_pages, mgr.room_nonces[room]
    cases = [c for c in hostile_messages(room, mgr.room_aux_indices[room], args, pages, use) if c.needs != "staging"]
    hostile = [c.msg for c in cases] + mutated_messages(room, args, mgr.room_aux_indices[room])
    before = mgr.dropped_messages.count
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://{mgr.local_ip}:{mgr.rank_port}")
    for msg in hostile:
        push.send_multipart(msg)
    deadline = time.monotonic() + 30
    while mgr.dropped_messages.count - before < len(hostile) and time.monotonic() < deadline:
        time.sleep(0.02)
    push.close(linger=0)
    ctx.term()
    own = mgr.room_aux_indices[room]  # the real prefill may be writing this room's slot by now
    changed = []
    for b, (p, n, item) in enumerate(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)):
        now = bytes((ctypes.c_char * n).from_address(p))
        changed += [(b, s) for s in range(n // item) if s != own and now[s * item : (s + 1) * item] != slots[b][s * item : (s + 1) * item]]  # fmt: skip
    return {
        "fuzz_sent": len(hostile),
        "fuzz_dropped": mgr.dropped_messages.count - before,
        "fuzz_kinds": sorted({kind(m) for m in hostile}),
        "aux_slots_changed": changed,
        "decode_threads_alive": all(t.is_alive() for t in mgr._worker_threads),
    }


def test_a_fuzzed_decode_still_commits_byte_exact():
    """N = 2 prefill CP ranks and a plugin decode, every process with the secret. While room 600
    is in flight (rank 1's first write waits 3 s), 205 hostile messages hit the decode's status
    socket: all dropped, no other aux slot changed, SGLang's decode threads alive; then room 600
    commits byte exact, room 601 fails with rank 0's reason (its Failed is signed, so it passes the
    guard) and room 602 commits."""

    n = 2
    reqs = [
        PD.request(600, list(range(10, 20)), list(range(1, 11)), chunks=[5, 5], fuzz=fuzz_status_socket),
        PD.request(601, list(range(20, 26)), list(range(11, 17))),
        PD.request(602, [3, 9, 4, 17, 30, 11], list(range(17, 23))),
    ]
    faults = {("slow", 1): {600: 3.0}, ("drop", 0): {601}}
    reports = PD.run(n, {"plugin": (True, reqs)}, reqs, faults)
    fuzzed = reports["room"][("plugin", 600)]
    # docs/disagg.md states 205 sent: change both together
    assert fuzzed["fuzz_sent"] == 205 and fuzzed["fuzz_dropped"] == fuzzed["fuzz_sent"], fuzzed
    assert fuzzed["fuzz_kinds"] == ["ABORT_ACK", "AUX_DATA", "CHUNK_READY", "STAGING_REQ", "status"], fuzzed
    assert fuzzed["aux_slots_changed"] == [] and fuzzed["decode_threads_alive"], fuzzed
    info = reports["ready"][0]
    PD.check_committed(reports, "plugin", reqs[0], n, info)
    PD.check_failed(reports, "plugin", 601, "CP rank 0 of 2: owned KV pages not sent at positions")
    PD.check_committed(reports, "plugin", reqs[2], n, info)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
