"""benchmark/bench_ttft_projection.py: it refuses, naming the GPU command, without the layer terms;
on stand-in terms (test/benchmark/fake_layer_terms.py) it writes every arm's TTFT with its range,
refuses what an arm's pool cannot hold, and sums its steps from trace_cost's step cost."""

import json
import os
import subprocess
import sys
import types

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
sys.path.insert(0, os.path.join(ROOT, "test", "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import bench_ttft_projection as P  # noqa: E402
import trace_budget as TB  # noqa: E402
import trace_cost as TK  # noqa: E402
from fake_layer_terms import FakeTerms  # noqa: E402


def test_refuses_without_layer_terms_naming_the_gpu_command(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "bench_ttft_projection.py"), "--quick", "--out",
           str(tmp_path), "--layer-terms", str(tmp_path / "missing.json")]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "scripts/gpu_run.sh layer" in run.stderr and not (tmp_path / "bench_ttft_projection.json").exists()


def test_quick_projection_on_stand_in_terms(tmp_path, monkeypatch):
    fake = types.ModuleType("layer_terms")
    fake.load = lambda path=None: FakeTerms()
    monkeypatch.setitem(sys.modules, "layer_terms", fake)
    assert P.main(["--quick", "--out", str(tmp_path)]) == 0
    raw = json.loads((tmp_path / "bench_ttft_projection.json").read_text())
    assert raw["provenance"]["command"].startswith("python benchmark/bench_ttft_projection.py --quick")
    rows = {(r["path"], r["prompt"], r["cached_kind"]): r for r in raw["rows"]}
    assert {p for p, _, _ in rows} == {"replicated", "shared", "layer_split", "dp_attention", "tp"}
    # a 1M prompt exceeds replicated CP 8's and a DP rank's pools (449k, 396k); the flag serves it
    assert rows[("replicated", 1048576, "none")]["refused"] and rows[("dp_attention", 1048576, "none")]["refused"]
    assert not rows[("shared", 1048576, "none")]["refused"]
    for r in raw["rows"]:
        if not r["refused"]:
            assert r["ttft_s_low"] <= r["ttft_s"] <= r["ttft_s_high"], r
    # a cached prefix leaves one chunk to compute
    assert rows[("shared", 131072, "all but the last 8,192")]["steps"] == 1
    assert rows[("shared", 131072, "none")]["steps"] == 16
    # a DP rank takes 1/8 of the node's chunk: 8 x the steps
    assert rows[("dp_attention", 131072, "none")]["steps"] == 128


def test_one_step_is_trace_costs_step():
    glm5, terms = TB.load_model("glm5"), FakeTerms(err=0.0)
    layout = TB.Layout("layer_split", 8)
    budget = TB.node_budget(glm5, layout, "fp8", 61464, 0)
    got = P.project(terms, glm5, layout, "fp8", 8192, 0, 8192, "mid", budget, 61464)
    cost = TK.StepCost(terms, glm5, "layer_split", 8, 1, "fp8", "mid", 61464, budget.tokens_per_rank)
    assert got["steps"] == 1 and got["ttft_s"] == pytest.approx(cost.step_ms([[(8192, 0)]]) / 1e3)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
