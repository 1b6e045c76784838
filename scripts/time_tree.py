"""Time one command with every process it starts: wall time, CPU time (user + system) of its whole
process tree and the tree's peak memory (PSS), and record it in benchmark/results/cpu_test_times.json.

    .venv/bin/python scripts/time_tree.py -- .venv/bin/python -m pytest -q test/system/test_sglang_server_pd.py

`/usr/bin/time` counts only children that are waited for; SGLang's schedulers outlive their
launcher's wait (a killed server's ranks are reparented), so this samples /proc every 0.5 s
instead: a process belongs to the tree once its parent does, and its CPU time is the last value
seen (what a process used in its last half second is missed). CPU time against wall time says
whether a test file computes or waits: on 2 cores a file whose CPU time is near 2 x its wall time
gains nothing from running beside another (docs/testing.md, "Where the time goes").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmark", "results", "cpu_test_times.json")
HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, CPU ticks, start time) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except OSError:
        return 0


def measure(cmd: list[str], every_s: float = 0.5) -> dict:
    t0, load0 = time.monotonic(), os.getloadavg()
    child = subprocess.Popen(cmd, cwd=REPO)
    tree, ticks, peak_pss = {child.pid}, {}, 0
    while True:
        rc = child.poll()
        procs = {int(d): s for d in os.listdir("/proc") if d.isdigit() and (s := _stat(int(d)))}
        grew = True
        while grew:  # a process joins when its parent is in the tree (orphans stay: added already)
            new = {pid for pid, (ppid, _, _) in procs.items() if ppid in tree and pid not in tree}
            tree |= new
            grew = bool(new)
        alive = [pid for pid in tree if pid in procs]
        for pid in alive:
            ticks[(pid, procs[pid][2])] = procs[pid][1]
        peak_pss = max(peak_pss, sum(_pss(pid) for pid in alive))
        if rc is not None:
            break
        time.sleep(every_s)
    wall = time.monotonic() - t0
    return {"exit": rc, "wall_s": round(wall, 1), "cpu_s": round(sum(ticks.values()) / HZ, 1),
            "peak_pss_gib": round(peak_pss / 2**30, 2), "load_average_start": [round(x, 1) for x in load0],
            "load_average_end": [round(x, 1) for x in os.getloadavg()]}  # fmt: skip


def main(argv: list[str]) -> int:
    if "--" not in argv or not argv[argv.index("--") + 1 :]:
        print("usage: time_tree.py [--label NAME] -- COMMAND...", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1 :]
    own = argv[: argv.index("--")]
    label = own[own.index("--label") + 1] if "--label" in own else " ".join(a for a in cmd if a.startswith("test/"))
    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    from provenance import provenance

    row = measure(cmd)
    row["provenance"] = provenance(model="toy models of the CPU suite", argv=["scripts/time_tree.py", *argv])
    record = {"files": {}}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            record = json.load(f)
    record["files"][label or " ".join(cmd)] = row
    with open(RESULTS, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"time_tree: {label}: {json.dumps({k: v for k, v in row.items() if k != 'provenance'})}", flush=True)
    return row["exit"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
