"""Mooncake's TCP transport, as installed: how many entries one initiator engine may have in flight
to one peer, and what happens to that peer after a batch over the limit. No SGLang; two
TransferEngines (TCP, 127.0.0.1) in two processes, `batch_transfer_sync_write` as SGLang's
MooncakeTransferEngine.batch_transfer_sync calls it. See docs/sglang_cpu_server.md.

    .venv/bin/python benchmark/bench_mooncake_tcp_queue.py            # every scenario, a fresh engine pair each
    .venv/bin/python benchmark/bench_mooncake_tcp_queue.py 3000x1 10x1 s30 10x1   # one sequence, one pair
    MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 .venv/bin/python benchmark/bench_mooncake_tcp_queue.py 3000x1 10x1

A sequence is steps `NxK` (K concurrent batches of N entries, one thread each) and `sS` (sleep S
seconds); every step prints the return codes (0 ok, -1 failed) and its time.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

ITEM = 1152  # bytes per entry: one token row of the tiny model's bf16 latent cache (576 x 2)
BUF = 64 << 20

SCENARIOS = [
    # (what, steps, extra environment, repetitions: a fresh engine pair each)
    ("2048 entries, then 2049, in one batch", ["2048x1", "2049x1"], {}, 1),
    ("3 concurrent batches of 700 (2100 in flight)", ["700x3"], {}, 1),
    ("3 concurrent batches of 600 (1800 in flight)", ["600x3"], {}, 1),
    ("one 3000-entry batch, then 10 entries at once, 2 s and 32 s later", ["3000x1", "10x1", "s2", "10x1", "s30", "10x1"], {}, 5),
    ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535", ["3000x1", "10x1", "1024x3", "8192x1"], {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535"}, 1),
    ("MC_TCP_ENABLE_CONNECTION_POOL=0 (one connection per entry)", ["3000x1", "10x1"], {"MC_TCP_ENABLE_CONNECTION_POOL": "0"}, 1),
]  # fmt: skip


def _target(q, done):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(BUF)
    assert engine.register_memory(ctypes.addressof(buf), BUF) == 0
    q.put((f"127.0.0.1:{engine.get_rpc_port()}", ctypes.addressof(buf)))
    done.wait()


def run_steps(steps: list[str]) -> None:
    q, done = mp.Queue(), mp.Event()
    target = mp.Process(target=_target, args=(q, done))
    target.start()
    session, dst = q.get()
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(BUF)
    src = ctypes.addressof(buf)
    assert engine.register_memory(src, BUF) == 0
    for step in steps:
        if step.startswith("s"):
            time.sleep(float(step[1:]))
            continue
        n, k = map(int, step.split("x"))
        rets = [None] * k

        def send(i):
            offsets = [(i * n + j) * ITEM % (BUF - ITEM) for j in range(n)]
            rets[i] = engine.batch_transfer_sync_write(
                session, [src + o for o in offsets], [dst + o for o in offsets], [ITEM] * n
            )

        t0 = time.monotonic()
        threads = [threading.Thread(target=send, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"  {k} x {n} entries: {rets} in {time.monotonic() - t0:.2f} s", flush=True)
    done.set()
    target.join()


def main() -> None:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    if len(sys.argv) > 1:
        run_steps(sys.argv[1:])
        return
    for what, steps, env, repetitions in SCENARIOS:
        print(f"{what}:  {' '.join(steps)}", flush=True)
        for _ in range(repetitions):
            out = subprocess.run([sys.executable, __file__, *steps], env={**os.environ, **env},
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
            lines = [line.strip() for line in out.stdout.splitlines() if line.startswith("  ")]
            print("  " + ";  ".join(lines), flush=True)


if __name__ == "__main__":
    main()
