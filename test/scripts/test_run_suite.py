"""The suite runner (scripts/run_suite.py): every test file here is registered to a suite it runs,
an unregistered or entry-less file stops it with its name and the lines to add, and partitions
split a suite into disjoint parts balanced by est_time. CPU, ~20 s (two runs of the script)."""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import collect_tests, register_cpu_ci

register_cpu_ci(est_time=20, suite="nsa-cp-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "run_suite.py")
_spec = importlib.util.spec_from_file_location("run_suite", SCRIPT)
RS = sys.modules["run_suite"] = importlib.util.module_from_spec(_spec)  # scripts/ is not a package
_spec.loader.exec_module(RS)

REGISTERED = """
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="nsa-cp-test-cpu")


def test_ok():
    pass


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
"""
UNREGISTERED = """
def test_new():
    pass
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_every_test_file_here_is_registered_to_a_suite_the_runner_runs():
    files = RS.test_files(os.path.join(REPO, "test"))
    assert len(files) >= 20 and "test/scripts/test_run_suite.py" in files, files
    assert RS.registration_problems(files) == []
    suites = {r.filename: r.effective_suite for r in collect_tests(files)}
    gpu = (
        "sglang_ext/layers/test_sglang_gpu_forward.py",
        "kernels/test_kernels_gpu.py",
        "harness/test_mqa_logits_triton.py",
    )
    assert {suites[f"test/{f}"] for f in gpu} == {"nsa-cp-test-1-gpu-h200"}


def test_no_test_file_imports_another_and_every_name_is_unique():
    """Shared code lives in test/helpers/; pytest imports each test file by its own name (its folder
    is not a package), so two files of one name in different folders would collide."""
    files = RS.test_files(os.path.join(REPO, "test"))
    names = {os.path.basename(f)[: -len(".py")] for f in files}
    assert len(names) == len(files), sorted(files)
    for path in files:
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read(), filename=path)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & names, (
            f"{path} imports test module(s) {sorted(imported & names)}: move that code into test/helpers/"
        )


def test_an_unregistered_file_stops_the_run_naming_it_and_the_fix(tmp_path):
    """The new file sits in a subfolder, as the tests do (test/<source folder>/test_*.py)."""
    (tmp_path / "test_registered.py").write_text(REGISTERED)
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "test_new_feature.py").write_text(UNREGISTERED)
    run = _run("--test-dir", str(tmp_path))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "test_registered.py" not in run.stdout, "the plan was printed: the check must come first"
    err = run.stderr
    assert f"{tmp_path}/layout/test_new_feature.py is not registered for CI" in err, err
    assert "nothing was run" in err and "test_registered.py" not in err, err
    for line in ("from sglang.test.ci.ci_register import register_cpu_ci",
                 'register_cpu_ci(est_time=SECONDS, suite="nsa-cp-test-cpu")',
                 'if __name__ == "__main__":', 'sys.exit(pytest.main([__file__, "-q"]))',
                 f"time .venv/bin/python -m pytest {tmp_path}/layout/test_new_feature.py"):  # fmt: skip
        assert line in err, f"{line!r} missing from:\n{err}"
    # The lines the message gives, as it says to add them, make the file pass the check.
    (tmp_path / "layout" / "test_new_feature.py").write_text(
        'import sys\n\nimport pytest\nfrom sglang.test.ci.ci_register import register_cpu_ci\n\n'
        'register_cpu_ci(est_time=3, suite="nsa-cp-test-cpu")\n' + UNREGISTERED +
        '\n\nif __name__ == "__main__":\n    sys.exit(pytest.main([__file__, "-q"]))\n'
    )  # fmt: skip
    run = _run("--test-dir", str(tmp_path), "--list")
    assert run.returncode == 0, run.stderr
    assert "2 file(s), est 4 s" in run.stdout and "test_new_feature.py  est 3 s" in run.stdout, run.stdout


@pytest.mark.parametrize(
    "source, message",
    [
        (REGISTERED.replace("if __name__", "if False and __name__"), 'has no `if __name__ == "__main__":` entry'),
        (REGISTERED.replace('suite="nsa-cp-test-cpu"', 'suite="base-a-test-cpu"'), "suite 'base-a-test-cpu' on CPU"),
        (
            REGISTERED.replace("register_cpu_ci(est_time=1,", "register_cuda_ci(est_time=1,"),
            "suite 'nsa-cp-test-cpu' on CUDA",
        ),
        (REGISTERED.replace("est_time=1", "est_time=ONE"), "est_time is a required constant"),
    ],
    ids=["no-main-entry", "unknown-suite", "cpu-suite-on-cuda", "est-time-not-a-constant"],
)
def test_each_registration_problem_is_named_with_its_file(tmp_path, source, message):
    path = tmp_path / "test_x.py"
    path.write_text(source)
    problems = RS.registration_problems([str(path)])
    assert len(problems) == 1 and message in problems[0] and str(path) in problems[0], problems


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_partitions_split_the_cpu_suite_once_balanced_by_est_time(size):
    registries = collect_tests(RS.test_files(os.path.join(REPO, "test")))
    whole, _ = RS.plan(registries, "nsa-cp-test-cpu", None, None)
    parts = [RS.plan(registries, "nsa-cp-test-cpu", i, size)[0] for i in range(size)]
    names = [r.filename for part in parts for r in part]
    assert sorted(names) == [r.filename for r in whole] and len(set(names)) == len(names), f"{size=}"
    sums = [sum(r.est_time for r in part) for part in parts]
    # Greedy longest-first: no part exceeds another by more than the longest file.
    assert max(sums) - min(sums) <= max(r.est_time for r in whole), f"{size=}, {sums=}"


def test_the_cpu_suite_runs_its_unit_tier_and_the_tier_fits_the_five_minute_loop():
    registries = collect_tests(RS.test_files(os.path.join(REPO, "test")))
    whole = {r.filename for r in RS.plan(registries, "nsa-cp-test-cpu", None, None)[0]}
    unit = RS.plan(registries, RS.UNIT_SUITE, None, None)[0]
    assert unit and {r.filename for r in unit} < whole
    # est_time per file is its own process's time; in one process the imports are paid once.
    assert sum(r.est_time for r in unit) <= RS.UNIT_TIER_BUDGET_S, [(r.filename, r.est_time) for r in unit]


def test_measured_times_become_est_times_rounded_up_to_five_seconds(tmp_path):
    test_dir = tmp_path / "test"
    test_dir.mkdir()
    (test_dir / "test_a.py").write_text(REGISTERED)
    (test_dir / "test_b.py").write_text(REGISTERED.replace("est_time=1", "est_time=40"))
    times = tmp_path / "times.json"
    rel = lambda f: os.path.relpath(test_dir / f, REPO)  # noqa: E731
    times.write_text(json.dumps({"files": {rel("test_a.py"): {"took_s": 21.2}, rel("test_b.py"): {"took_s": 2.0}}}))
    assert RS.apply_times(str(times), str(test_dir)) == 2
    assert "register_cpu_ci(est_time=25," in (test_dir / "test_a.py").read_text()
    assert "register_cpu_ci(est_time=5," in (test_dir / "test_b.py").read_text()
    assert RS.apply_times(str(times), str(test_dir)) == 0  # already what was measured


def test_a_file_more_than_half_off_its_est_time_fails_an_idle_run_only():
    rows = [("a.py", 100, 151, 0), ("b.py", 100, 49, 0), ("c.py", 100, 150, 0), ("d.py", 100, 50, 0),
            ("failed.py", 100, 1, 1)]  # fmt: skip
    lines, fails = RS.est_time_check(rows, 1.9, 0.5, cores=2)
    assert fails and len(lines) == 3, lines  # a and b, not c and d (exactly 50 % off), not the failed file
    assert "a.py took 151 s, est_time 100 s" in lines[0] and "fails the run" in lines[0], lines
    assert "b.py took 49 s" in lines[1] and "an idle run" in lines[2], lines
    for start, end in ((2.0, 0.5), (0.5, 2.0)):  # the load average reached the cores at one end
        lines, fails = RS.est_time_check(rows, start, end, cores=2)
        assert not fails and "reported only" in lines[0] and "not an idle run" in lines[-1], lines
    lines, fails = RS.est_time_check(rows[2:4], 0.0, 0.0, cores=2)  # within 50 %: nothing to report
    assert not fails and len(lines) == 1 and "an idle run" in lines[0], lines


@pytest.mark.parametrize("load, rc", [(0.1, 1), (2.5, 0)])
def test_a_per_file_run_applies_the_est_time_check(tmp_path, monkeypatch, capsys, load, rc):
    """Through main(): a file registered at 60 s that takes no time fails the per-file run when
    the machine is idle, and is only reported when it is loaded; pytest's arguments skip it."""
    (tmp_path / "test_a.py").write_text(REGISTERED.replace("est_time=1", "est_time=60"))
    ran = []
    monkeypatch.setattr(RS.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(RS.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(RS.os, "cpu_count", lambda: 2)
    assert RS.main(["--test-dir", str(tmp_path), "--per-file"]) == rc and len(ran) == 1
    out = capsys.readouterr().out
    assert "test_a.py took 0 s, est_time 60 s: more than 50% off" in out, out
    assert RS.main(["--test-dir", str(tmp_path), "--per-file", "--", "-k", "ok"]) == 0
    assert "est_time 60 s: more than" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--auto-partition-id", "0"], "go together"),
        (["--auto-partition-id", "2", "--auto-partition-size", "2"], "got 2 of 2"),
        (["--suite", "nightly"], "invalid choice"),
        (["--write-times", "t.json"], "--write-times needs --per-file"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        RS.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_arguments_after_double_dash_go_to_pytest():
    args = RS.parse_args(["--per-file", "--", "-k", "zigzag", "-x"])
    assert args.per_file and args.pytest_args == ["-k", "zigzag", "-x"]
    assert RS.pytest_command(["test/comm/test_tail.py"], args.pytest_args)[-4:] == [
        "-k",
        "zigzag",
        "-x",
        "test/comm/test_tail.py",
    ]


def test_partitions_run_at_once_get_their_own_ports_and_temporary_folders(tmp_path, monkeypatch):
    """Partition I of N runs under NSA_CP_TEST_PARTITION=I/N (the live servers' port slice,
    test/helpers/sglang_servers.py) and a TMPDIR of its own, so N of them can run at once."""
    from helpers import sglang_servers as S

    monkeypatch.setattr(RS.tempfile, "tempdir", str(tmp_path))
    envs = [RS.partition_env(i, 2) for i in range(2)]
    assert [e[S.PARTITION_ENV] for e in envs] == ["0/2", "1/2"] and RS.PARTITION_ENV == S.PARTITION_ENV
    assert envs[0]["TMPDIR"] != envs[1]["TMPDIR"] and all(os.path.isdir(e["TMPDIR"]) for e in envs), envs


def test_a_skip_fails_the_gpu_run(tmp_path):
    """scripts/gpu_run.sh sets NSA_CP_FAIL_ON_SKIP=1: a GPU test that skips (no CUDA, no bundle)
    fails the run instead of passing it; without the variable a skip stays a skip."""
    import shutil

    shutil.copy(os.path.join(REPO, "test", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_gpu.py").write_text(
        "import pytest\n\n@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_kernel():\n    pass\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_gpu.py")]
    plain = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, env=os.environ | {"NSA_CP_FAIL_ON_SKIP": "0"}
    )
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout
    strict = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, env=os.environ | {"NSA_CP_FAIL_ON_SKIP": "1"}
    )
    assert strict.returncode == 1 and "needs CUDA" in strict.stdout, strict.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
