"""Forward baselines (CP off, replicated CP) computed once per inputs and reused: `cached_run_ranks`
is `run_ranks` whose result is kept on disk under a key of everything that decides it, so a rerun
of the pool, HiCache, speculative or q8 forward tests recomputes only the runs under test (shared
KV) while nothing their baselines depend on has changed.

The key (sha256) covers: the function (module and name), the world size, the arguments (a path
among them by the bytes of the file or folder it names, so a checkpoint written afresh in each
session's temporary folder keys by its content), the versions of Python, torch, Triton and SGLang
and the hash of SGLang's installed file list (its dist-info RECORD, which holds every file's
hash), every file of the package and of test/helpers/ (bytecode aside), and the environment
variables that steer the forward (SGLANG_*, TRITON_*, NSA_CP_*). A result is reused only when
its file holds that same key; any change recomputes it and replaces the file, never a silent
reuse of a stale one (test/harness/test_baseline_cache.py).

Where: NSA_CP_BASELINE_CACHE (a folder), by default `.pytest_cache/nsa_cp_baselines/` of the
repository (ignored by git); `NSA_CP_BASELINE_CACHE=off` recomputes every time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from helpers.distributed import run_ranks

REPO = Path(__file__).resolve().parents[2]
CACHE_ENV = "NSA_CP_BASELINE_CACHE"
DEFAULT_DIR = REPO / ".pytest_cache" / "nsa_cp_baselines"
# the package as imported (its editable install or a copy) and these helpers
SOURCE_DIRS = (Path(importlib.util.find_spec("sglang_nsa_cp").origin).parent, Path(__file__).resolve().parent)
ENV_PREFIXES = ("SGLANG_", "TRITON_", "NSA_CP_")


def cache_dir() -> Path | None:
    where = os.environ.get(CACHE_ENV)
    if where == "off":
        return None
    return Path(where) if where else DEFAULT_DIR


def _hash_path(h, path: Path) -> None:
    files = [path]
    if path.is_dir():  # compiled bytecode is no input: Python rewrites it as it pleases
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        h.update(f.read_bytes() + b"\0")


def _environment() -> str:
    dists = []
    for name in ("torch", "triton", "sglang"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            dists.append(f"{name}: not installed")
            continue
        record = hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()
        dists.append(f"{name} {dist.version} RECORD {record}")
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k != CACHE_ENV)
    return f"python {sys.version}\n" + "\n".join(dists) + f"\n{env!r}"


def inputs_key(fn: Callable, world: int, args: tuple, sources=SOURCE_DIRS) -> str:
    h = hashlib.sha256()
    h.update(f"{fn.__module__}.{fn.__qualname__} world {world}\n".encode())
    for a in args:
        if isinstance(a, str) and os.path.exists(a):
            h.update(b"path:")
            _hash_path(h, Path(a))
        else:
            h.update(repr(a).encode())
        h.update(b"\n")
    for folder in sources:
        _hash_path(h, Path(folder))
    h.update(_environment().encode())
    return h.hexdigest()


def cached_run_ranks(fn: Callable, world: int, args: tuple = (), timeout_s: float = 120.0, *,
                     runner: Callable = run_ranks, sources=SOURCE_DIRS, where: Path | None = None) -> list[Any]:  # fmt: skip
    """`runner(fn, world, args=args, timeout_s=timeout_s)`, or its result from an earlier call
    with the same key (see the module). `where`: the cache folder (default `cache_dir()`)."""
    where = cache_dir() if where is None else where
    if where is None:
        return runner(fn, world, args=args, timeout_s=timeout_s)
    key = inputs_key(fn, world, args, sources)
    path = Path(where) / f"{fn.__name__}-w{world}-{key[:20]}.pt"
    if path.exists():
        try:
            stored = torch.load(path, weights_only=False)
        except Exception:  # a torn or foreign file: recompute below
            stored = None
        if isinstance(stored, dict) and stored.get("key") == key:
            return stored["result"]
    result = runner(fn, world, args=args, timeout_s=timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"key": key, "result": result}, tmp)
    os.replace(tmp, path)
    return result
