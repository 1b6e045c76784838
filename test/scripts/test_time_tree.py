"""scripts/time_tree.py counts the CPU time of every process a command starts, a grandchild that
outlives its parent's wait included (as SGLang's schedulers outlive their killed launcher), which
the command's own rusage (`/usr/bin/time`) misses."""

import importlib.util
import os
import resource
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("time_tree", os.path.join(REPO, "scripts", "time_tree.py"))
TT = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TT)

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
# the command: a child starts a grandchild that burns 1.5 s of CPU and exits a second later without
# waiting for it, so the grandchild is reparented (as a killed launcher's schedulers are); the
# command waits for the pipe the grandchild holds to close, then exits
ORPHANING = (
    "import os, subprocess, sys\n"
    "r, w = os.pipe()\n"
    f"grandchild = {BURN.format(s=1.5)!r}\n"
    "spawn = f'import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", {grandchild!r}], pass_fds=({w},)); time.sleep(1)'\n"
    "subprocess.run([sys.executable, '-c', spawn], pass_fds=(w,), check=True)\n"
    "os.close(w)\n"
    "os.read(r, 1)\n"
)


def test_an_unwaited_grandchilds_cpu_time_is_counted():
    row = TT.measure([sys.executable, "-c", ORPHANING], every_s=0.1)
    assert row["exit"] == 0, row
    assert row["cpu_s"] >= 1.2, row  # the grandchild's 1.5 s, less what the last sample misses
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", ORPHANING], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rusage = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert rusage < 1.0, rusage  # what /usr/bin/time would say: the grandchild is not in it


def test_a_command_is_required():
    assert TT.main(["--label", "x"]) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
