"""Where a result came from: the commit and whether the tree was dirty, the machine, the command.
Every benchmark writes `provenance(...)` into its results file as "provenance". Imported as
`provenance` (a benchmark's own folder is on sys.path).

The GPU machine gets a copy of the working tree whose `.git`, where one travels, can be older than
the tree, so before a device run

    python benchmark/provenance.py --stamp      # writes .provenance.json (git-ignored; carry it)

records here what git says and a hash of every tracked file (`--header WHAT` prints the block as a
log's first line). `provenance()` believes the stamp only
while the files still hash the same (then the tree is the stamped one), else reads git, and says
"unknown" when it has neither.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join(ROOT, ".provenance.json")


def git_state() -> dict | None:
    """{"commit", "dirty", "dirty_files", "diff_sha256"} of the checkout at ROOT, or None without git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout  # fmt: skip

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
        diff = git("diff", "HEAD")
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return {
        "commit": commit,
        "dirty": bool(status),
        "dirty_files": [line[3:] for line in status],
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if status else None,
    }


def tree_sha256(paths: list[str]) -> str:
    """One hash over the named files' contents as they are now (a missing file counts as missing)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        full = os.path.join(ROOT, path)
        content = open(full, "rb").read() if os.path.isfile(full) else b"<missing>"
        digest.update(f"{path}\0{hashlib.sha256(content).hexdigest()}\n".encode())
    return digest.hexdigest()[:16]


def source_state() -> dict:
    """The stamp while the tracked files still hash as stamped, else git's state here, else unknown."""
    if os.path.exists(STAMP):
        with open(STAMP) as f:
            stamped = json.load(f)
        if tree_sha256(stamped.pop("paths")) == stamped["tree_sha256"]:
            return {**stamped, "source": "stamp .provenance.json (tree unchanged since)"}
    state = git_state()
    if state is not None:
        return {**state, "source": "git"}
    return {"commit": "unknown", "dirty": None, "dirty_files": [], "diff_sha256": None, "source": "none"}


def machine() -> dict:
    """CPU, cores, load, Python; the GPUs and torch/CUDA/NCCL/Triton versions where torch is imported."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    info = {"cpu": cpu, "cores": os.cpu_count(), "load_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version()}  # fmt: skip
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    triton = sys.modules.get("triton")
    if triton is not None:
        info["triton"] = triton.__version__
    return info


def provenance(model: str | dict, stand_ins: list[str] | tuple[str, ...] = (), argv: list[str] | None = None) -> dict:
    """The "provenance" block of a results file. model: the shapes run (a dict) or a line such as
    "toy model: 2 layers, hidden 64"; stand_ins: what ran in place of a real component."""
    argv = sys.argv if argv is None else argv
    return {
        **source_state(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(shlex.quote(a) for a in ["python", os.path.relpath(argv[0], ROOT), *argv[1:]]),
        "model": model,
        "stand_ins": list(stand_ins),
    }


def stamp() -> dict:
    state = git_state()
    if state is None:
        raise SystemExit("provenance.py --stamp: no git checkout at " + ROOT)
    listed = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True, check=True).stdout
    paths = listed.split()
    with open(STAMP, "w") as f:
        json.dump({**state, "tree_sha256": tree_sha256(paths), "paths": paths}, f, indent=1)
    return state


if __name__ == "__main__":
    if sys.argv[1:2] == ["--header"]:  # a log's first line: scripts/gpu_run.sh
        import torch  # noqa: F401  (the GPUs and versions in the machine block)

        block = {**provenance("see the log"), "command": " ".join(sys.argv[2:])}
        print("# provenance: " + json.dumps(block))
        raise SystemExit(0)
    if sys.argv[1:] != ["--stamp"]:
        raise SystemExit(
            "usage: python benchmark/provenance.py --stamp   (writes .provenance.json)\n"
            "       python benchmark/provenance.py --header WHAT...   (one JSON line for a log)"
        )
    s = stamp()
    print(f"provenance: {s['commit'][:12]}{' (dirty: ' + ', '.join(s['dirty_files']) + ')' if s['dirty'] else ''}"
          f" -> {os.path.relpath(STAMP)}")  # fmt: skip
