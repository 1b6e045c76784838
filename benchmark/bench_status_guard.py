"""What the status guard costs and what it bounds, on a decode's status socket and a prefill's nonce map (CPU, Linux, ~1 min).

    .venv/bin/python benchmark/bench_status_guard.py [--out DIR] [--quick]

Through SGLang's real decode manager and decode thread with the plugin's guard in front, as the status-guard
tests build them (test/helpers/status_guard_decode.py), and the status socket as a plugin decode binds it
(SGLang's `get_zmq_socket_on_host` through the plugin's hook):
1. decode-thread time per dropped frame of 40 B, 64 KiB, 1 MiB (median), the guard on main beside the guard
   before issue 41 (its frame display took `repr` of the whole frame, then cut it to 40 characters);
2. a genuine commit (two keyed Successes through the guard until the room commits), alone and while 4 peers
   (another process) send 1 MiB junk frames, beside the guard before issue 41;
3. the receiving process's peak RSS for one message of 256 frames of 1 MiB (SGLang's socket and the plugin's:
   no ZMQ option bounds the frames of one message), and how many messages of 4 x 1 MiB one connection
   gets queued on a decode that does not read (the plugin's RCVHWM beside SGLang's 0, unlimited);
4. a prefill's nonce map (SGLang's metadata channel): memory at its cap of 65,536 rooms, that the cap holds
   under 100,000 rooms, the same map without the cap, and rooms filled to their most destinations (1,024)
   past its budget of 131,072 sessions in all.
Raw: DIR/bench_status_guard.json. --quick: fewer repeats and smaller messages (a smoke run, not for docs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO / "python"))

from provenance import provenance  # noqa: E402  (benchmark/, this script's folder)

MODEL = "no model: SGLang 0.5.23's Mooncake decode thread and the plugin's status guard on ZMQ sockets (127.0.0.1)"
os.environ.setdefault("TRITON_INTERPRET", "1")

from tables import format_table  # noqa: E402

MIB = 1 << 20
FRAME_SIZES = (40, 64 << 10, MIB)


def _rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _guard(before_fix: bool):
    """The guard as on main, or (`before_fix`) with its frame display as before issue 41: repr of the whole
    frame, then cut to 40 characters."""
    from sglang_nsa_cp.sglang_ext.disaggregation import status_guard

    cut, digits = status_guard.cut, status_guard.MAX_DIGITS

    def show_before_fix(frame) -> str:
        if isinstance(frame, bytes) and len(frame) <= digits and frame.isdigit():
            return frame.decode()
        return cut(repr(frame), 40)

    return mock.patch.object(status_guard, "_show", show_before_fix) if before_fix else contextlib.nullcontext()


def _junk(size: int) -> list[bytes]:
    """A status whose room frame is `size` bytes of 0xff: the guard drops it ("room ... is not a decimal number")."""
    return [b"\xff" * size, b"4", b"0"]


def _frame_limit(kv_args) -> int:
    """The plugin decode's status-frame limit for this pool (as OwnedPageKVManager.__init__ computes it)."""
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import MAX_USES, max_manifest_bytes, pool_pages

    return MIB + max_manifest_bytes(pool_pages(kv_args), MAX_USES)


# ---- 1. decode-thread time per dropped frame ----------------------------------------------------------------
def drop_cost(repeats: int) -> dict:
    """Median microseconds of the guard's receive (check, claimed origin, drop log) per junk message."""
    from helpers.status_guard_decode import decode_manager
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog, guard_recv

    out = {}
    for before_fix in (False, True):
        for size in FRAME_SIZES:
            msg, mgr, drops = _junk(size), decode_manager(), DropLog()
            recv = guard_recv(mgr, lambda: msg, drops)
            n = max(10, repeats // 10) if before_fix and size == MIB else repeats
            times = []
            with _guard(before_fix):
                for _ in range(n):
                    start = time.perf_counter_ns()
                    assert recv() is None
                    times.append(time.perf_counter_ns() - start)
            assert drops.count == n
            out[f"{'before_fix' if before_fix else 'guard'}_{size}B"] = {"median_us": round(statistics.median(times) / 1e3, 1), "n": n}  # fmt: skip
    return out


# ---- 2. a genuine commit, alone and under junk -----------------------------------------------------------------
def _junk_peers(port: int, peers: int, size: int, stop) -> None:
    """`peers` PUSH sockets sending junk frames of `size` bytes to `port` until `stop` is set (another process)."""
    import zmq

    ctx = zmq.Context()
    socks = []
    for _ in range(peers):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    msg = _junk(size)
    while not stop.is_set():
        for sock in socks:
            try:
                sock.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.0005)
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def commit_latency(trials: int, peers: int, before_fix: bool) -> dict:
    """Milliseconds from pushing a room's two keyed Successes to its commit, through SGLang's decode thread."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from helpers.status_guard_decode import SECRET, DecodeThread, idle_manager, make_receiver, success_message

    mgr = idle_manager(secret=SECRET)
    decode = DecodeThread(mgr, frame_limit=_frame_limit(mgr.kv_args))
    fork = multiprocessing.get_context("fork")
    stop = fork.Event()
    junk = fork.Process(target=_junk_peers, args=(decode.port, peers, MIB, stop), daemon=True) if peers else None
    times = []
    try:
        with _guard(before_fix):
            if junk:
                junk.start()
                time.sleep(1.0)  # the peers' queues fill
            dropped = mgr.dropped_messages.count
            for room in range(1000, 1000 + trials):
                receiver = make_receiver(mgr, room=room)
                messages = [success_message(rank, room=room, use=mgr.room_nonces[room]) for rank in (0, 1)]
                start = time.perf_counter()
                decode.push(messages)
                while mgr.request_status[room] != KVPoll.Success:
                    assert time.perf_counter() - start < 30, (room, mgr.request_status[room], mgr.failure_records)
                    time.sleep(0.0002)
                times.append((time.perf_counter() - start) * 1e3)
                receiver.clear()
            dropped = mgr.dropped_messages.count - dropped
    finally:
        stop.set()
        if junk:
            junk.join(timeout=10)
        decode.close()
    times.sort()
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(times[0], 3), "max_ms": round(times[-1], 3), "trials": trials,
            "junk_dropped_meanwhile": dropped}  # fmt: skip


# ---- 3. one large message, and the queue of one connection --------------------------------------------------
def _status_socket(ctx, plugin: bool, limit: int):
    """A PULL socket bound as SGLang's decode binds its status socket; `plugin`: through the plugin's hook."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket_on_host

    from sglang_nsa_cp.sglang_ext.disaggregation.common import conn as hooks

    if not plugin:
        return get_zmq_socket_on_host(ctx, zmq.PULL, host="127.0.0.1")
    with hooks.limited_status_frames(limit):
        return hooks.limit_status_frames(get_zmq_socket_on_host, ctx, zmq.PULL, host="127.0.0.1")


def _receiver_process(conn, plugin: bool, limit: int, rcvhwm: int | None = None) -> None:
    """Binds a status socket, says its port, waits for "go", reports VmRSS; then reads every queued message and
    reports (messages, frames, bytes, baseline RSS, RSS while holding, peak RSS while reading) in KiB."""
    import zmq

    from sglang_nsa_cp.sglang_ext.disaggregation.common import conn as hooks

    if rcvhwm is not None:  # the plugin's socket with another queue limit (the one before issue 47: 64)
        hooks.STATUS_RCVHWM = rcvhwm
    ctx = zmq.Context()
    port, pull = _status_socket(ctx, plugin, limit)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on
    baseline = _rss_kib()
    conn.send(port)
    conn.recv()  # the sender is done (or waits)
    holding = _rss_kib()
    messages = frames = size = 0
    while pull.poll(1000):
        msg = pull.recv_multipart()  # as SGLang's decode thread receives
        messages, frames, size = messages + 1, frames + len(msg), size + sum(map(len, msg))
        del msg
    conn.send(dict(messages=messages, frames=frames, bytes=size, baseline_kib=baseline, holding_kib=holding,
                   peak_kib=_rss_kib("VmHWM")))  # fmt: skip
    pull.close(linger=0)
    ctx.term()


def _send_to_receiver(plugin: bool, limit: int, frames: int, frame: int, most: int, msg=None, rcvhwm=None,
                      sndhwm: int = 1) -> dict:  # fmt: skip
    """Sends messages of `frames` x `frame` bytes (or `msg`) to a fresh receiving process until the socket stops
    taking them (1 s without room) or `most` went out; returns what the receiver saw."""
    import zmq

    fork = multiprocessing.get_context("fork")
    mine, theirs = fork.Pipe()
    child = fork.Process(target=_receiver_process, args=(theirs, plugin, limit, rcvhwm), daemon=True)
    child.start()
    port = mine.recv()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, sndhwm)
    push.connect(f"tcp://127.0.0.1:{port}")
    msg = msg or [b"\xff" * frame] * frames
    sent = 0
    while sent < most:
        try:
            push.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            if push.poll(1000, zmq.POLLOUT) == 0:
                break
    time.sleep(0.5)  # what was sent reaches the receiver's queue
    mine.send("go")
    seen = mine.recv()
    push.close(linger=0)
    ctx.term()
    child.join(timeout=30)
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    return dict(sent=sent, sender_stopped=sent < most, received=seen["messages"], message_mib=frames * frame / MIB,
                baseline_rss_mib=mib(seen["baseline_kib"]), holding_rss_delta_mib=mib(seen["holding_kib"] - seen["baseline_kib"]),
                peak_rss_delta_mib=mib(seen["peak_kib"] - seen["baseline_kib"]))  # fmt: skip


def one_large_message(frames: int, frame: int, limit: int) -> dict:
    """Peak RSS of the receiving process for one message of `frames` x `frame` bytes, SGLang's socket and the plugin's."""
    return {side: _send_to_receiver(side == "plugin", limit, frames, frame, most=1) for side in ("sglang", "plugin")}


def queued_per_connection(frames: int, frame: int, limit: int, most: int) -> dict:
    """Messages one connection gets queued on a decode that does not read: the plugin's socket (RCVHWM 64) and
    SGLang's (RCVHWM 0), the latter stopped by us at `most`."""
    return {side: _send_to_receiver(side == "plugin", limit, frames, frame, most) for side in ("plugin", "sglang")}


def stalled_decode(most: int, limit: int) -> dict:
    """Genuine statuses a prefill rank gets out to a decode whose decode thread does not read (the review's
    stall: a decode ~1,000 statuses behind made SGLang's prefill drop one after its 30 s send timeout). The
    sender is a PUSH socket with SGLang's prefill options (`CommonKVManager._connect`: ZMQ's default SNDHWM of
    1,000; a send that waits 1 s here stands for its 30 s SNDTIMEO, after which SGLang drops the status); each
    message a keyed Success of a 64-page room. Receivers: the plugin's socket now, with the 64-message limit it
    had before, and SGLang's own (stopped by us at `most`)."""
    from helpers.status_guard_decode import SECRET, NOW, rank_claims, status_message

    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    msg = status_message(7, 4, 1, b"", encode_manifest(rank_claims(1, 64), 7, 1, SECRET, uses=[NOW]))
    sides = {"plugin": (True, None), "plugin_before": (True, 64), "sglang": (False, None)}
    out = {name: _send_to_receiver(plugin, limit, 0, 0, most, msg=msg, rcvhwm=rcvhwm, sndhwm=1000)
           for name, (plugin, rcvhwm) in sides.items()}  # fmt: skip
    return dict(message_bytes=sum(map(len, msg)), **out)


# ---- 4. the prefill's nonce map ---------------------------------------------------------------------------------
def _noted_bytes(rooms: int, capped: bool, sessions: int = 1) -> tuple[int, int, int]:
    """(bytes tracemalloc sees added, rooms held, sessions held) after `rooms` rooms' metadata of `sessions`
    sessions each reached a prefill's `_note_use_nonce` (capped: MAX_NOTED_ROOMS and MAX_NOTED_SESSIONS; else no
    cap, the map before issue 41)."""
    from helpers.status_guard_decode import metadata_message
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn

    templates = [metadata_message(0, f"10.0.0.{s % 250}:{17000 + s}", b"%016d" % s, destinations=sessions) for s in range(sessions)]  # fmt: skip
    prefill = object.__new__(conn.OwnedPageKVManager)
    prefill.destination_nonces = conn.NoncesByRoom()
    caps = {} if capped else {"MAX_NOTED_ROOMS": 1 << 62, "MAX_NOTED_SESSIONS": 1 << 62}
    with mock.patch.multiple(conn, **caps) if caps else contextlib.nullcontext():
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for room in range(rooms):
            key = b"%d" % (10**12 + room)
            for template in templates:
                prefill._note_use_nonce([key, *template[1:]])
        added = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    return added, len(prefill.destination_nonces), prefill.destination_nonces.sessions


def nonce_map(rooms: int) -> dict:
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import MAX_NOTED_ROOMS, MAX_NOTED_SESSIONS
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import MAX_USES

    at_cap, held_at_cap, _ = _noted_bytes(MAX_NOTED_ROOMS, True)
    past_cap, held_past_cap, _ = _noted_bytes(rooms, True)
    uncapped, held_uncapped, _ = _noted_bytes(rooms, False)
    # rooms that each declare the most destinations, filled with injected sessions, past the session budget
    full_rooms = MAX_NOTED_SESSIONS // MAX_USES + 32
    full, full_held, full_sessions = _noted_bytes(full_rooms, True, sessions=MAX_USES)
    return dict(cap_rooms=MAX_NOTED_ROOMS, at_cap_mib=round(at_cap / MIB, 2), held_at_cap=held_at_cap, rooms_sent=rooms,
                past_cap_mib=round(past_cap / MIB, 2), held_past_cap=held_past_cap, uncapped_mib=round(uncapped / MIB, 2),
                held_uncapped=held_uncapped, cap_sessions=MAX_NOTED_SESSIONS, full_room_sessions=MAX_USES,
                full_rooms_sent=full_rooms, full_rooms_held=full_held, full_sessions_held=full_sessions,
                full_rooms_mib=round(full / MIB, 2))  # fmt: skip


# ---- the run ---------------------------------------------------------------------------------------------------
def table(r: dict) -> str:
    d, c, one, q, n = r["drop_cost"], r["commit_latency"], r["one_large_message"], r["queued_per_connection"], r["nonce_map"]  # fmt: skip
    rows = [["measurement", "guard on main", "before issue 41 / SGLang's own"]]
    for size in FRAME_SIZES:
        rows.append([f"drop a {size:,} B frame (us, median)", f"{d[f'guard_{size}B']['median_us']:.1f}", f"{d[f'before_fix_{size}B']['median_us']:.1f}"])  # fmt: skip
    alone, junk, junk_before = c["alone"], c["junk"], c["junk_before_fix"]
    rows.append(["commit alone (ms, median [min-max])", f"{alone['median_ms']:.2f} [{alone['min_ms']:.2f}-{alone['max_ms']:.2f}]", "-"])  # fmt: skip
    rows.append([f"commit, {r['params']['junk_peers']} peers of 1 MiB junk (ms)", f"{junk['median_ms']:.2f} [{junk['min_ms']:.2f}-{junk['max_ms']:.2f}]",
                 f"{junk_before['median_ms']:.2f} [{junk_before['min_ms']:.2f}-{junk_before['max_ms']:.2f}]"])  # fmt: skip
    m = one["plugin"]["message_mib"]
    rows.append([f"one {m:.0f} MiB message: peak RSS + (MiB)", f"{one['plugin']['peak_rss_delta_mib']}", f"{one['sglang']['peak_rss_delta_mib']}"])  # fmt: skip
    qm = q["plugin"]["message_mib"]
    rows.append([f"{qm:.0f} MiB messages one connection queues", f"{q['plugin']['received']} (sender stopped: {q['plugin']['sender_stopped']})",
                 f"{q['sglang']['received']} of {q['sglang']['sent']} (sender stopped: {q['sglang']['sender_stopped']})"])  # fmt: skip
    rows.append(["  receiver RSS while holding them (MiB)", f"+{q['plugin']['holding_rss_delta_mib']}", f"+{q['sglang']['holding_rss_delta_mib']}"])  # fmt: skip
    rows.append([f"nonce map, {n['rooms_sent']:,} rooms (MiB, rooms held)", f"{n['past_cap_mib']:.1f}, {n['held_past_cap']:,}", f"{n['uncapped_mib']:.1f}, {n['held_uncapped']:,} (no cap)"])  # fmt: skip
    rows.append([f"nonce map at its cap, {n['cap_rooms']:,} rooms (MiB)", f"{n['at_cap_mib']:.1f}", "-"])
    rows.append([f"{n['full_rooms_sent']} rooms of {n['full_room_sessions']} sessions (MiB, rooms, sessions held)",
                 f"{n['full_rooms_mib']:.1f}, {n['full_rooms_held']}, {n['full_sessions_held']:,}", "-"])  # fmt: skip
    return format_table(rows, header_rule=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmark" / "results")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller messages: a smoke run")
    ap.add_argument("--only", choices=["stalled_decode"], help="run this part alone; update it in the results file")
    args = ap.parse_args()
    logging.getLogger("sglang_nsa_cp.sglang_ext.disaggregation.status_guard").setLevel(logging.ERROR)
    quick = args.quick
    params = dict(drop_repeats=100 if quick else 1000, commit_trials=5 if quick else 30, junk_peers=4,
                  large_frames=16 if quick else 256, queue_frames=4, queue_most=80 if quick else 160,
                  nonce_rooms=70_000 if quick else 100_000)  # fmt: skip
    import sglang.srt.utils.network  # noqa: F401  (the forked receiving processes inherit it: no import there)

    from helpers.status_guard_decode import AuxBuffers

    limit = _frame_limit(AuxBuffers().kv_args)
    stall_most = 20_000 if quick else 100_000
    if args.only:
        path = args.out / "bench_status_guard.json"
        result = json.loads(path.read_text())
        result["stalled_decode"] = stalled_decode(stall_most, limit) | {
            "provenance": provenance(MODEL),
            "most": stall_most,
        }
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["stalled_decode"], indent=2))
        return
    started = time.monotonic()
    result = dict(provenance=provenance(MODEL), params=params, quick=quick, status_frame_limit_bytes=limit)
    # the processes fork before any zmq context or decode thread of this process exists
    result["one_large_message"] = one_large_message(params["large_frames"], MIB, limit)
    result["queued_per_connection"] = queued_per_connection(params["queue_frames"], MIB, limit, params["queue_most"])
    result["stalled_decode"] = stalled_decode(stall_most, limit)
    result["drop_cost"] = drop_cost(params["drop_repeats"])
    result["commit_latency"] = {
        "alone": commit_latency(params["commit_trials"], 0, before_fix=False),
        "junk": commit_latency(params["commit_trials"], params["junk_peers"], before_fix=False),
        "junk_before_fix": commit_latency(params["commit_trials"], params["junk_peers"], before_fix=True),
    }
    result["nonce_map"] = nonce_map(params["nonce_rooms"])
    result["load_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_status_guard.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    m = result["provenance"]["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, load {m['load_1_5_15']} -> {result['load_1_5_15_at_end']}, "
          f"{result['seconds']} s; raw: {args.out / 'bench_status_guard.json'}")  # fmt: skip


if __name__ == "__main__":
    main()
