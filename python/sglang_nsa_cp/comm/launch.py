"""Run a function on N local ranks joined by a torch.distributed group, and never hang.

Used by the demo and the multi-process tests: every rank reports its result or its traceback,
the parent waits with a deadline, and a failure names the rank that failed instead of leaving
the others blocked in a collective.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, timeout_s, fn, args, results):
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, dist.group.WORLD, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would share their memory
        # through file descriptors that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call `fn(rank, world_size, group, *args)` on `world_size` spawned processes.

    Returns the per-rank results in rank order. `fn` and its results must be picklable.
    Raises RankFailure naming every rank that raised, died or missed the deadline.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads

    outcomes: dict[int, tuple[str, Any]] = {}
    stopped_early = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
                for r in dead:
                    outcomes[r] = ("error", f"process exited with code {procs[r].exitcode}")
                continue
            outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
            if status == "error":
                stopped_early = True
                break  # the others are likely blocked in a collective; stop waiting for them
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    failed = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failed or missing:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failed.items())]
        if missing:
            why = "were stopped after a failure" if stopped_early else f"did not finish within {timeout_s:.0f} s"
            lines.append(f"ranks {missing} {why}")
        raise RankFailure("\n".join(lines))
    return [outcomes[r][1] for r in range(world_size)]
