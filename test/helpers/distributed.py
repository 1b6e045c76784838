"""The one local rank launcher of the tests and benchmarks: `run_ranks` calls the same
`fn(rank, world_size, group, *args)` on N spawned processes joined by a torch.distributed group,
and never hangs. `RankPool` keeps those processes alive across calls, for a test module that
runs many short calls (spawning a rank and importing torch costs seconds; a call, milliseconds).
On CPU (Triton's interpreter, gloo or no group) a rank is forked from a server process that
imported torch and SGLang once (FORKSERVER_PRELOAD), under the parent's environment at the call;
its output goes where the test process's went when that server started, so a failure is read from
its traceback and stack file, as on any rank.

    parent ── spawn ──> rank 0 ─┐   each rank: init the group once, then run every call it gets
           ── spawn ──> rank 1 ─┼─ results queue: ("ok", result) or ("error", traceback)
           ── spawn ──> rank 2 ─┘   + a stack file per rank (faulthandler)
    first "error" or dead rank   -> stop every rank still working (ranks without a group finish
                                    their calls), raise with that rank's traceback
    deadline passed              -> SIGUSR1 to every live rank (faulthandler dumps all its
                                    threads' stacks), raise naming each rank and its stack

One `RankFailure` carries a "rank r/N failed:" block per rank that failed, died or timed out.
After a failure a pool's next call starts fresh ranks in place of the stopped ones: all of them
when they share a process group (it is broken), else only those whose call did not succeed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import pickle
import queue
import signal
import socket
import sys
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

# CPU ranks (Triton's interpreter, gloo or no group) fork from one server process per test process
# that imported torch and SGLang once: a spawned rank imports them again, about 9 CPU-s on the 2-core
# machine, most of a short test. CUDA ranks are spawned (CUDA must not be set up before a fork).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "sglang.srt.model_executor.model_runner",
                      "sglang.srt.models.deepseek_v2", "sglang.srt.mem_cache.page_interleave_pool",
                      "sglang.srt.disaggregation.mooncake.conn"]  # fmt: skip
# What torch and SGLang read while those modules are imported (the CPU stand-ins' settings): the
# server imports them under these values, and a rank asked to run under others is refused.
FORKSERVER_ENV = {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
                  "SGLANG_DSA_FUSE_TOPK": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NCCL over sockets on loopback: what lets several ranks share one GPU (see nccl_device).
SHARED_GPU_NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                       "NCCL_SOCKET_IFNAME": "lo"}  # fmt: skip


def nccl_device(rank: int) -> int:
    """The GPU of NCCL rank `rank`: its own where the machine has one per rank; else GPU 0, as a
    host of its own. NCCL refuses two ranks of one host on one device ("Duplicate GPU detected");
    a distinct NCCL_HOSTID per rank makes it treat them as hosts and use its socket transport:
    exact, slow (correctness only, never a timing). Call before the rank's first NCCL collective."""
    if torch.cuda.device_count() > rank:
        return rank
    os.environ.update(SHARED_GPU_NCCL_ENV, NCCL_HOSTID=nccl_hostid(rank))
    return 0


def nccl_hostid(rank: int) -> str:
    return f"nsa-cp-test-rank-{rank}"


@contextlib.contextmanager
def on_gpu_zero(rank: int):
    """Around starting rank `rank`'s process: yields GPU 0, with NCCL_HOSTID naming the rank in
    the environment the child inherits (restored after); what `nccl_device` does in-process."""
    saved = os.environ.get("NCCL_HOSTID")
    os.environ["NCCL_HOSTID"] = nccl_hostid(rank)
    try:
        yield 0
    finally:
        if saved is None:
            os.environ.pop("NCCL_HOSTID", None)
        else:
            os.environ["NCCL_HOSTID"] = saved


def uses_forkserver(backend: str | None) -> bool:
    return backend != "nccl" and os.environ.get("TRITON_INTERPRET") == "1"


def _context(backend: str | None):
    if not uses_forkserver(backend):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _forked_env_problem(env: dict[str, str]) -> str | None:
    """Why a rank forked from the server cannot run under `env` (the parent's environment), if it
    cannot: a variable the preloaded modules read at import differs from the server's."""
    differ = {k: (os.environ.get(k), env.get(k)) for k in FORKSERVER_ENV if os.environ.get(k) != env.get(k)}
    if differ:
        return (f"the rank's environment differs from the one torch and SGLang were preloaded under "
                f"(variable: (preloaded, asked)): {differ}; set FORKSERVER_ENV in test/helpers/distributed.py "
                f"or run the rank with backend='nccl' or TRITON_INTERPRET unset (spawned ranks)")  # fmt: skip
    return None


def _worker(rank, world_size, port, backend, timeout_s, stack_path, calls, results, env):
    # Kept open for the process's life: faulthandler writes to its descriptor on a crash
    # (SIGSEGV, SIGABRT, ...) and on SIGUSR1, which the parent sends past the deadline.
    stack_file = open(stack_path, "w")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    call_id = None
    try:
        if uses_forkserver(backend):  # forked from the server: its environment, not the parent's
            if problem := _forked_env_problem(env):
                raise RuntimeError(problem)
            os.environ.clear()
            os.environ.update(env)
        torch.set_num_threads(1)
        group = None
        if backend is not None:
            if backend == "nccl":
                torch.cuda.set_device(nccl_device(rank))
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            group = dist.group.WORLD
        while (call := calls.get()) is not None:
            call_id, fn, args = call
            out = fn(rank, world_size, group, *args)
            # Plain pickle copies tensors by value; the queue's own pickler would share their
            # memory through file descriptors that die with this process.
            results.put((call_id, rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((call_id, rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without the interpreter's teardown (Mooncake's and SGLang's threads can make it take
    # seconds): everything this rank had to say is flushed first.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_env(backend: str | None) -> dict[str, str]:
    """The environment the ranks run under: this process's, OMP_NUM_THREADS=1 (N ranks share the
    machine's cores); forked ranks also under the stand-ins' settings the server was preloaded with
    (FORKSERVER_ENV) where this process does not set them."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return {**FORKSERVER_ENV, **env} if uses_forkserver(backend) else env


def _start(procs, env: dict[str, str]) -> None:
    """Start the ranks under `env` (a spawned rank, and the fork server when it starts, inherit
    this process's environment at start)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)


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
    """Record, as failed, each rank that exited with an error without reporting one (a rank
    leaves with code 0 only after its report is flushed: that report is still to be read)."""
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


class RankPool:
    """`world_size` spawned ranks that stay alive across calls: `run(fn, args)` calls
    `fn(rank, world_size, group, *args)` on every rank and returns the results in rank order,
    with `run_ranks`' failure rules. A rank may keep state between calls in module globals.

    backend: "gloo" or "nccl" joins the ranks in a torch.distributed group (`group`); None gives
    independent ranks (`group` is None): a failure then waits for the other ranks' calls (they
    block on nothing) and restarts only the ranks whose call did not succeed, when each of them
    has exited (a rank that died, or raised and left); the others keep their state. Use as a
    context manager, or call close().
    """

    def __init__(self, world_size: int, backend: str | None = "gloo", timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self._ctx = _context(backend)
        self._call_ids = itertools.count()
        self._procs: list = []
        self._tmp = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="run_ranks_")
        self._stack_paths = [Path(self._tmp.name) / f"rank{r}.stack" for r in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._port = free_port()
        self._calls, self._procs = [None] * self.world_size, [None] * self.world_size
        self._respawn(range(self.world_size))

    def _respawn(self, ranks) -> None:
        """Start `ranks` afresh (new call queues), sharing the pool's results queue."""
        env = _rank_env(self.backend)
        for r in ranks:
            self._calls[r] = self._ctx.Queue()
            worker_args = (r, self.world_size, self._port, self.backend, self.timeout_s)
            self._procs[r] = self._ctx.Process(
                target=_worker,
                args=(*worker_args, str(self._stack_paths[r]), self._calls[r], self._results, env),
                daemon=True,
            )
        _start([self._procs[r] for r in ranks], env)

    def _recover(self, outcomes: dict) -> None:
        """After a failed call: restart only the ranks whose call did not succeed, when the ranks
        share no group and each of those has exited by itself; else stop every rank."""
        lost = [r for r in range(self.world_size) if outcomes.get(r, ("",))[0] != "ok"]
        if self.backend is None:
            for r in lost:
                if outcomes.get(r, ("",))[0] == "error":
                    self._procs[r].join(timeout=5)  # it reported and is leaving
            if all(self._procs[r].exitcode is not None for r in lost):
                self._respawn(lost)
                return
        self.close(finished=False)

    def run(self, fn: Callable[..., Any], args: tuple = (), timeout_s: float | None = None) -> list[Any]:
        """Call `fn(rank, world_size, group, *args)` on every rank; `fn` and its results must be
        picklable. Raises RankFailure (and stops the ranks, see the class) when one raises, dies
        or runs past `timeout_s` (the pool's by default)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self._procs:
            self._spawn()
        call_id = next(self._call_ids)
        for calls in self._calls:
            calls.put((call_id, fn, args))
        n = self.world_size
        outcomes: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", result) | ("error", text)
        timed_out: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < n:
            try:
                got, rank, status, value = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if _collect_dead(self._procs, outcomes, self._stack_paths) and self.backend is not None:
                    break  # a dead rank leaves the others blocked in a collective
                if time.monotonic() > deadline:
                    late = [r for r in range(n) if r not in outcomes]
                    timed_out = _dump_stacks(self._procs, late, self._stack_paths)
                    break
                continue
            if got not in (call_id, None):
                continue  # a late answer to a call that already failed
            outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
            if status == "error" and self.backend is not None:
                # The others are likely blocked in a collective: stop them. A rank that died
                # first (its peers' collectives then fail) is the cause: name it too. Ranks
                # without a group block on nothing: their calls run to the end, so only the
                # failed one is replaced.
                time.sleep(POLL_S)
                _collect_dead(self._procs, outcomes, self._stack_paths)
                break
        failed = {r: text for r, (status, text) in outcomes.items() if status == "error"}
        if not failed and not timed_out and len(outcomes) == n:
            return [outcomes[r][1] for r in range(n)]
        self._recover(outcomes)
        blocks = [f"rank {r}/{n} failed:\n{text}" for r, text in sorted(failed.items())]
        blocks += [
            f"rank {r}/{n} failed: did not finish within {timeout_s:.0f} s; its stacks:\n{s}"
            for r, s in sorted(timed_out.items())
        ]
        stopped = [r for r in range(n) if r not in outcomes and r not in timed_out]
        if stopped:
            blocks.append(f"ranks {stopped} of {n} were stopped after the failure above")
        raise RankFailure("\n".join(blocks))

    def close(self, finished: bool = True) -> None:
        """Stop every rank (after the call in progress, when `finished`)."""
        if not self._procs:
            return
        if finished:
            for calls in self._calls:
                calls.put(None)
        _stop(self._procs, finished)
        self._procs = []
        self._tmp.cleanup()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str | None = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call `fn(rank, world_size, group, *args)` on `world_size` spawned processes.

    Returns the per-rank results in rank order. `fn` and its results must be picklable.
    The first rank to raise or die stops every rank; past `timeout_s` every live rank's stack
    is dumped. Raises RankFailure with a "rank r/N failed:" block (traceback or stack) per rank.
    backend None: no torch.distributed group (`group` is None).
    """
    with RankPool(world_size, backend, timeout_s) as pool:
        return pool.run(fn, args)
