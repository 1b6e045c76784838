"""The one local rank launcher (tests, benchmarks, the demo): `run_ranks` calls the same
`fn(rank, world_size, group, *args)` on N spawned processes joined by a torch.distributed group,
and never hangs.

    parent ── spawn ──> rank 0 ─┐
           ── spawn ──> rank 1 ─┼─ results queue: ("ok", result) or ("error", traceback)
           ── spawn ──> rank 2 ─┘   + a stack file per rank (faulthandler)
    first "error" or dead rank   -> stop every rank, raise with that rank's traceback
    deadline passed              -> SIGUSR1 to every live rank (faulthandler dumps all its
                                    threads' stacks), raise naming each rank and its stack

One `RankFailure` carries a "rank r/N failed:" block per rank that failed, died or timed out.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_S = 0.2
STACK_DUMP_WAIT_S = 2.0  # how long a signalled rank gets to write its stacks


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, timeout_s, stack_path, fn, args, results):
    # Kept open for the process's life: faulthandler writes to its descriptor on a crash
    # (SIGSEGV, SIGABRT, ...) and on SIGUSR1, which the parent sends past the deadline.
    stack_file = open(stack_path, "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
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


def _start(procs) -> None:
    """Start the ranks with OMP_NUM_THREADS=1 (N ranks share this machine's cores)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _dump_stacks(procs, ranks: list[int], stack_paths: list[Path]) -> dict[int, str]:
    """Ask each of `ranks` still alive for its threads' stacks; what each wrote."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT_S)
    return {r: _read_stack(stack_paths[r]) or "(no stack written)" for r in ranks}


def _read_stack(path: Path) -> str:
    """What a rank's faulthandler wrote; empty if it died before opening its file."""
    return path.read_text().strip() if path.exists() else ""


def _collect_dead(procs, outcomes: dict, stack_paths: list[Path]) -> list[int]:
    """Record, as failed, each rank that exited with an error without reporting one."""
    dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
    for r in dead:
        stack = _read_stack(stack_paths[r])
        outcomes[r] = ("error", f"process exited with code {procs[r].exitcode}\n{stack}".strip())
    return dead


def _stop(procs, finished: bool) -> None:
    for p in procs:
        p.join(timeout=5 if finished else 0.5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call `fn(rank, world_size, group, *args)` on `world_size` spawned processes.

    Returns the per-rank results in rank order. `fn` and its results must be picklable.
    The first rank to raise or die stops every rank; past `timeout_s` every live rank's stack
    is dumped. Raises RankFailure with a "rank r/N failed:" block (traceback or stack) per rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        stack_paths = [Path(tmp) / f"rank{r}.stack" for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, timeout_s, str(stack_paths[r]), fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        _start(procs)
        outcomes: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", result) | ("error", text)
        timed_out: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < world_size:
                try:
                    rank, status, value = results.get(timeout=POLL_S)
                except queue.Empty:
                    if _collect_dead(procs, outcomes, stack_paths):
                        break  # a dead rank leaves the others blocked in a collective
                    if time.monotonic() > deadline:
                        late = [r for r in range(world_size) if r not in outcomes]
                        timed_out = _dump_stacks(procs, late, stack_paths)
                        break
                    continue
                outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
                if status == "error":
                    # The others are likely blocked in a collective: stop them. A rank that died
                    # first (its peers' collectives then fail) is the cause: name it too.
                    time.sleep(POLL_S)
                    _collect_dead(procs, outcomes, stack_paths)
                    break
        finally:
            _stop(procs, finished=len(outcomes) == world_size)

    failed = {r: text for r, (status, text) in outcomes.items() if status == "error"}
    if not failed and not timed_out and len(outcomes) == world_size:
        return [outcomes[r][1] for r in range(world_size)]
    n = world_size
    blocks = [f"rank {r}/{n} failed:\n{text}" for r, text in sorted(failed.items())]
    blocks += [
        f"rank {r}/{n} failed: did not finish within {timeout_s:.0f} s; its stacks:\n{s}"
        for r, s in sorted(timed_out.items())
    ]
    stopped = [r for r in range(n) if r not in outcomes and r not in timed_out]
    if stopped:
        blocks.append(f"ranks {stopped} of {n} were stopped after the failure above")
    raise RankFailure("\n".join(blocks))
