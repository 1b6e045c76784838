"""The prefill benchmark runs at any CP size: a CPU smoke run over gloo at N = 4 and 8 with the
tiny model, every path agreeing with the one-GPU path and shared KV at 1/N of replicated."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=254, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.parametrize("cp", [4, 8])
def test_prefill_benchmark_runs_on_cpu_ranks(cp, tmp_path):
    args = [
        "--device",
        "cpu",
        "--config",
        "tiny",
        "--cp",
        str(cp),
        "--page-size",
        "16",
        "--cold",
        "150",
        "--hit",
        "128:40",
        "--repeats",
        "1",
        "--bw-repeats",
        "1",
        "--sweep-mib",
        "0.25",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "bench_prefill.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "of all-gather" in run.stdout  # the printed tables
    raw = json.loads((tmp_path / "bench_prefill.json").read_text())
    by = {(p["case"]["name"], p["path"]): p for p in raw["paths"]}
    assert {path for _, path in by} == {"one_gpu", "replicated", "shared", "shared_prefetch"}
    for (case, path), p in by.items():
        assert p["logit_rel_err_vs_one_gpu"] <= 1e-5, (case, path)
    for case in ("cold 150", "hit 128+40"):
        replicated, shared = by[(case, "replicated")], by[(case, "shared_prefetch")]
        assert shared["kv_bytes"] * cp == replicated["kv_bytes"]
    hit = by[("hit 128+40", "shared_prefetch")]
    assert hit["scratch_bytes"] > 0 and hit["bytes_moved"]["materialize_latent"]["calls"] == 3
    assert all(b["gathered_bytes"] > 0 for b in raw["materialize_bandwidth"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
