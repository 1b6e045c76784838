"""Run one registered test suite the way SGLang's CI does (its test/run_suite.py), with pytest.

Every test_*.py under test/ (each in the folder of the source it specifies) registers itself with
SGLang's markers from `sglang.test.ci.ci_register`, `register_cpu_ci(est_time=S, suite=...)` or
`register_cuda_ci(...)` (parsed from the source, no-ops at run time), and has an
`if __name__ == "__main__":` entry. This script collects them with SGLang's own `collect_tests`,
keeps the named suite's files, optionally one `auto_partition` of N (balanced by est_time), and
runs them with pytest: in one process (the default: the files share their imports), or one
process per file with --per-file (each file's time beside its est_time, for refreshing the
estimates). A test file that is not registered stops the run before any test, with the lines
to add.

    python scripts/run_suite.py                                    # the CPU suite
    python scripts/run_suite.py --suite nsa-cp-test-cpu-unit       # its unit tier (test.sh --fast)
    python scripts/run_suite.py --auto-partition-id 0 --auto-partition-size 2
    python scripts/run_suite.py --suite nsa-cp-test-1-gpu-h200 -- -s   # after --: pytest's own
    python scripts/run_suite.py --list                             # the plan; runs nothing
    python scripts/run_suite.py --per-file --write-times times.json   # time every file
    python scripts/run_suite.py --apply-times times.json   # est_time := what it took

A suite may include others: the CPU suite is its own files plus its unit tier's (files with no
server start and no rank spawn beyond a pool), so CI runs both and `scripts/test.sh --fast` the
tier alone. `--write-times` records each file's measured wall time (a per-file run) in a JSON that
test/scripts/test_run_suite.py holds every est_time to.

Exit status: pytest's (0 when every file passed), 1 when a per-file run failed, or on an idle
machine took more than 50 % off a file's est_time (`est_time_check`), or the machine has too few
GPUs for the suite, 2 for a registration problem or bad arguments. docs/testing.md says
more.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from sglang.test.ci.ci_register import CIRegistry, HWBackend, auto_partition, collect_tests, ut_parse_one_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTITION_ENV = "NSA_CP_TEST_PARTITION"  # read by test/helpers/sglang_servers.py (its ports)
PER_TEST_TIMEOUT_S = 900  # pytest-timeout's limit per test, as scripts/test.sh gives it
EST_TIME_TOLERANCE = 0.5  # a per-file run fails when a file took more than 50 % off its est_time ...
# ... on an idle run only: the 1-minute load average below the core count at its start and its end


@dataclasses.dataclass(frozen=True)
class Suite:
    backend: HWBackend
    num_gpus: int
    triton_interpret: str  # TRITON_INTERPRET for the run, unless the environment sets it
    what: str
    includes: tuple[str, ...] = ()  # suites whose files this one runs as well


UNIT_SUITE = "nsa-cp-test-cpu-unit"
UNIT_TIER_BUDGET_S = 360  # its files' est_time in all: under 5 minutes in one process (docs/testing.md)
SUITES = {
    "nsa-cp-test-cpu": Suite(
        HWBackend.CPU, 0, "1", "CPU with Triton's interpreter, what CI runs (its unit tier included)", (UNIT_SUITE,)
    ),
    UNIT_SUITE: Suite(HWBackend.CPU, 0, "1", "the CPU suite's unit tier: no server start, no rank spawn"),
    # SGLang's forward runs a rank per GPU over NCCL where there are enough GPUs, else shares GPU 0
    "nsa-cp-test-1-gpu-h200": Suite(HWBackend.CUDA, 1, "0", "one or more H200s: kernels and SGLang's forward"),
}
DEFAULT_SUITE = "nsa-cp-test-cpu"
REGISTER_FN = {HWBackend.CPU: "register_cpu_ci", HWBackend.CUDA: "register_cuda_ci"}


def shown(path: str) -> str:
    """path relative to the repository when inside it."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def test_files(test_dir: str) -> list[str]:
    """Every test_*.py in test_dir and its subfolders, sorted, relative to the repository when inside it."""
    return [shown(p) for p in sorted(glob.glob(os.path.join(test_dir, "**", "test_*.py"), recursive=True))]


def how_to_register(path: str, registered: bool) -> str:
    """The lines a file needs, for the error message (docs/testing.md shows the same)."""
    at_end = (
        " at its end (with `import sys` and `import pytest` at the top):\n\n"
        '    if __name__ == "__main__":\n'
        '        sys.exit(pytest.main([__file__, "-q"]))\n'
    )
    if registered:
        return "  Add" + at_end
    gpu = " or ".join(f'"{name}"' for name, s in SUITES.items() if s.backend is HWBackend.CUDA)
    return (
        "  Add after its imports:\n\n"
        "    from sglang.test.ci.ci_register import register_cpu_ci\n\n"
        f'    register_cpu_ci(est_time=SECONDS, suite="{DEFAULT_SUITE}")\n\n'
        f"  and{at_end}\n"
        f"  SECONDS: its wall time on the CPU CI machine, `time .venv/bin/python -m pytest {path}`. A GPU test\n"
        f"  imports and calls register_cuda_ci instead, with suite {gpu}.\n"
    )


def registration_problems(files: list[str]) -> list[str]:
    """One message per file that collect_tests would refuse or that no suite here would run."""
    problems = []
    for path in files:
        try:
            registries, has_main = ut_parse_one_file(path)
        except ValueError as exc:  # a malformed register_*_ci call; SGLang's message names the file
            problems.append(f"{exc}\n")
            continue
        if not registries:
            problems.append(f"{path} is not registered for CI: it calls neither register_cpu_ci nor "
                            f"register_cuda_ci.\n{how_to_register(path, registered=False)}")  # fmt: skip
            continue
        if not has_main and any(r.disabled is None for r in registries):
            problems.append(f'{path} has no `if __name__ == "__main__":` entry that runs it.\n'
                            f"{how_to_register(path, registered=True)}")  # fmt: skip
        for r in registries:
            suite = SUITES.get(r.effective_suite)
            if suite is None or suite.backend is not r.backend:
                known = ", ".join(f'{REGISTER_FN[s.backend]}(..., suite="{n}")' for n, s in SUITES.items())
                problems.append(f"{path} is registered to suite {r.effective_suite!r} on {r.backend.name}, "
                                f"which no runner here runs; use one of: {known}.\n")  # fmt: skip
    return problems


def collect(test_dir: str) -> list[CIRegistry]:
    """Every registration under test_dir; exits 2 naming each file with a problem and its fix."""
    files = test_files(test_dir)
    problems = registration_problems(files)
    if problems:
        print(f"run_suite: {len(problems)} registration problem(s) in {shown(test_dir)}; nothing was run.\n",
              file=sys.stderr)  # fmt: skip
        print("\n".join(problems), file=sys.stderr)
        print("docs/testing.md, 'Registering a test', says more.", file=sys.stderr)
        sys.exit(2)
    return collect_tests(files, sanity_check=True)


def plan(registries: list[CIRegistry], suite: str, part_id: int | None, part_size: int | None):
    """(files to run, files the suite lists as disabled) for one suite and partition, by filename."""
    backend = SUITES[suite].backend
    names = (suite, *SUITES[suite].includes)
    mine = [r for r in registries if r.backend is backend and r.effective_suite in names and not r.nightly]
    enabled = [r for r in mine if r.disabled is None]
    if part_size is not None:
        enabled = auto_partition(enabled, part_id, part_size)
    by_name = lambda r: r.filename  # noqa: E731
    return sorted(enabled, key=by_name), sorted((r for r in mine if r.disabled is not None), key=by_name)


def print_plan(suite: str, part: str, enabled: list[CIRegistry], disabled: list[CIRegistry]) -> None:
    total = sum(r.est_time for r in enabled)
    print(f"run_suite: suite {suite}, {SUITES[suite].what}; partition {part}: {len(enabled)} file(s), "
          f"est {total:.0f} s in all", flush=True)  # fmt: skip
    for r in enabled:
        print(f"  {r.filename}  est {r.est_time:.0f} s", flush=True)
    for r in disabled:
        print(f"  {r.filename}  disabled: {r.disabled}", flush=True)


def pytest_command(files: list[str], pytest_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # the GPU machine's pytest may lack it
        cmd.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    return cmd + pytest_args + files


def write_times(path: str, suite: str, rows: list[tuple[str, float, float, int]]) -> None:
    """The per-file wall times of one run, with where and when they were taken (the load matters:
    est_time is meant for an otherwise idle 2-core machine)."""
    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    from provenance import provenance

    record = {
        "provenance": provenance(model="toy models of the CPU suite", stand_ins=[]),
        "suite": suite,
        "load_average_at_end": os.getloadavg(),
        "files": {name: {"est_s": est, "took_s": round(took, 1), "exit": rc} for name, est, took, rc in rows},
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"run_suite: wrote {shown(path)}", flush=True)


def est_time_for(took_s: float) -> int:
    """A measured wall time as the est_time to register: rounded up to 5 s."""
    return max(5, 5 * -(-round(took_s) // 5))


def apply_times(path: str, test_dir: str) -> int:
    """Rewrites each timed file's est_time to what it took; returns how many files changed."""
    with open(path) as f:
        files = json.load(f)["files"]
    changed = 0
    for name, row in files.items():
        file = os.path.join(REPO, name)
        if not os.path.exists(file) or not os.path.abspath(file).startswith(os.path.abspath(test_dir)):
            continue
        with open(file) as f:
            text = f.read()
        new = re.sub(
            r"(register_c(?:pu|uda)_ci\(est_time=)[0-9.]+", rf"\g<1>{est_time_for(row['took_s'])}", text, count=1
        )
        if new != text:
            with open(file, "w") as f:
                f.write(new)
            changed += 1
    print(f"run_suite: est_time of {changed} file(s) set from {shown(path)}")
    return changed


def idle(load_at_start: float, load_at_end: float, cores: int) -> bool:
    """An idle run: the 1-minute load average below the core count at its start and at its end
    (else other work shared the cores, and a file's wall time says little about its est_time)."""
    return load_at_start < cores and load_at_end < cores


def est_time_check(rows, load_at_start: float, load_at_end: float, cores: int) -> tuple[list[str], bool]:
    """(one line per passing file more than EST_TIME_TOLERANCE off its est_time, whether that fails
    the run: only when the run was idle, see `idle`)."""
    off = [(name, est, took) for name, est, took, rc in rows
           if rc == 0 and abs(took - est) > EST_TIME_TOLERANCE * est]  # fmt: skip
    was_idle = idle(load_at_start, load_at_end, cores)
    verdict = "fails the run" if was_idle else "reported only"
    lines = [f"run_suite: {name} took {took:.0f} s, est_time {est:.0f} s: more than "
             f"{EST_TIME_TOLERANCE:.0%} off ({verdict}); set it with --write-times and --apply-times"
             for name, est, took in off]  # fmt: skip
    lines.append(f"run_suite: load average (1 min) {load_at_start:.2f} at start, {load_at_end:.2f} at end, "
                 f"{cores} cores: {'an idle run' if was_idle else 'not an idle run, est_time not enforced'}")  # fmt: skip
    return lines, bool(off) and was_idle


def partition_env(part_id: int, part_size: int) -> dict:
    """What partition I of N runs under, so that N partitions can run at once on one machine: its
    number (test/helpers/sglang_servers.py gives each partition its own slice of the ports its
    servers take) and its own temporary folder (pytest's tmp_path, SGLang's sockets)."""
    tmp = tempfile.mkdtemp(prefix=f"nsa_cp_partition{part_id}of{part_size}_")
    print(f"run_suite: partition {part_id} of {part_size}: {PARTITION_ENV}={part_id}/{part_size}, TMPDIR={tmp}",
          flush=True)  # fmt: skip
    return {PARTITION_ENV: f"{part_id}/{part_size}", "TMPDIR": tmp}


def run_files(enabled: list[CIRegistry], pytest_args: list[str], per_file: bool, env: dict,
              times: tuple[str, str] | None = None) -> int:  # fmt: skip
    """times: (path, suite) to record each file's wall time (per-file runs only)."""
    files = [r.filename for r in enabled]
    t0 = time.monotonic()
    if not per_file:
        rc = subprocess.run(pytest_command(files, pytest_args), env=env, cwd=REPO).returncode
        print(f"run_suite: {len(files)} file(s) in one pytest process: {time.monotonic() - t0:.0f} s "
              f"(est {sum(r.est_time for r in enabled):.0f} s), exit {rc}", flush=True)  # fmt: skip
        return rc
    rows = []
    load_at_start = os.getloadavg()[0]
    for i, r in enumerate(enabled, 1):
        print(f"run_suite: [{i}/{len(enabled)}] {r.filename}", flush=True)
        t1 = time.monotonic()
        rc = subprocess.run(pytest_command([r.filename], pytest_args), env=env, cwd=REPO).returncode
        rows.append((r.filename, r.est_time, time.monotonic() - t1, rc))
    # 5 is pytest's "no tests collected": a -k or -m given after -- may leave a file nothing to run.
    ok = (0, 5) if pytest_args else (0,)
    print(f"\nrun_suite: {len(rows)} file(s), one pytest process each: {time.monotonic() - t0:.0f} s")
    width = max(len(name) for name, *_ in rows)
    print(f"  {'file':{width}} {'est s':>6} {'took s':>7}  exit")
    for name, est, took, rc in rows:
        print(f"  {name:{width}} {est:6.0f} {took:7.0f}  {rc}{'' if rc in ok else '  FAILED'}")
    if times:
        write_times(*times, rows)
    est_fails = False
    if not pytest_args:  # with pytest's arguments a file may run only part of its tests
        lines, est_fails = est_time_check(rows, load_at_start, os.getloadavg()[0], os.cpu_count() or 1)
        print("\n".join(lines), flush=True)
    return 0 if all(rc in ok for *_, rc in rows) and not est_fails else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="arguments after -- go to pytest")
    parser.add_argument("--suite", default=DEFAULT_SUITE, choices=SUITES, help=f"default {DEFAULT_SUITE}")
    parser.add_argument("--auto-partition-id", type=int, help="this runner's partition, 0-based")
    parser.add_argument("--auto-partition-size", type=int, help="how many partitions the suite is split into")
    parser.add_argument("--per-file", action="store_true", help="one pytest process per file, with timings")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--write-times", metavar="JSON", help="with --per-file: record each file's wall time there")
    parser.add_argument(
        "--apply-times", metavar="JSON", help="set each file's est_time from such a record; runs nothing"
    )
    parser.add_argument(
        "--test-dir",
        default=os.path.join(REPO, "test"),
        help="where test_*.py are, subfolders included (default test/)",
    )
    own, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    args.pytest_args = pytest_args
    pid, size = args.auto_partition_id, args.auto_partition_size
    if (pid is None) != (size is None):
        parser.error("--auto-partition-id and --auto-partition-size go together")
    if args.write_times and not args.per_file:
        parser.error("--write-times needs --per-file: one pytest process per file is what times a file")
    if size is not None and not (size >= 1 and 0 <= pid < size):
        parser.error(f"--auto-partition-id must be in [0, {size}) and the size at least 1; got {pid} of {size}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.apply_times:
        apply_times(args.apply_times, args.test_dir)
        return 0
    registries = collect(args.test_dir)
    enabled, disabled = plan(registries, args.suite, args.auto_partition_id, args.auto_partition_size)
    part = "all" if args.auto_partition_size is None else f"{args.auto_partition_id} of {args.auto_partition_size}"
    print_plan(args.suite, part, enabled, disabled)
    if args.list:
        return 0
    if not enabled:
        print("run_suite: no files in this partition; nothing to run")
        return 0
    suite = SUITES[args.suite]
    if suite.num_gpus:
        import torch

        have = torch.cuda.device_count()
        if have < suite.num_gpus:
            print(f"run_suite: {args.suite} needs {suite.num_gpus} CUDA GPU(s); torch sees {have} "
                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})", file=sys.stderr)  # fmt: skip
            return 1
    # CPU suites run Triton's interpreter; GPU suites compile for the device. conftest.py would
    # otherwise turn the interpreter on everywhere, and the GPU files would skip.
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", suite.triton_interpret)}
    if args.auto_partition_size is not None:
        env.update(partition_env(args.auto_partition_id, args.auto_partition_size))
    times = (args.write_times, args.suite) if args.write_times else None
    return run_files(enabled, args.pytest_args, args.per_file, env, times)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
