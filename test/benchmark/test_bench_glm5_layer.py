"""The GLM-5 layer benchmark (benchmark/bench_glm5_layer.py) and its loader (benchmark/layer_terms.py) on
CPU: the toy run writes every part's points with provenance and stand-ins; the fit recovers known
coefficients from a synthetic grid and keeps them non-negative; the loader refuses a missing file
with the GPU command, and the docs block renders "not run yet" without it (CPU)."""

import copy
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import layer_terms as LT  # noqa: E402

BENCH = ROOT / "benchmark" / "bench_glm5_layer.py"
PARTS_KV = {"attention": ("bf16", "fp8"), "scratch_fill": ("bf16", "fp8"), "fused_store": ("bf16", "fp8"),
            "indexer": (None,), "gemms": (None,), "moe": (None,)}  # fmt: skip


def run_bench(*args, env_extra=None):
    env = {**os.environ, "TRITON_INTERPRET": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    proc = run_bench("--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = out / "bench_glm5_layer_cpu_toy.json"
    return path, json.loads(path.read_text())


def test_the_toy_run_writes_every_part_with_its_provenance(toy):
    _, raw = toy
    p = raw["provenance"]
    for key in ("commit", "dirty", "machine", "command", "model", "stand_ins", "date_utc"):
        assert key in p, f"provenance lacks {key}: {sorted(p)}"
    assert p["model"]["name"] == "toy" and p["model"]["shapes"]["topk"] == 16, p["model"]
    assert any("CPU toy" in s for s in p["stand_ins"]) and any("balanced routing" in s for s in p["stand_ins"])
    grid = raw["grid"]
    seen = {}
    for point in raw["points"]:
        seen.setdefault((point["part"], point["kv"]), []).append(point)
        assert point["ms"] > 0 and point["reps"] == len(point["ms_reps"]) >= 1, point
    for part, kvs in PARTS_KV.items():
        for kv in kvs:
            pts = seen.get((part, kv), [])
            want = {"attention": len(grid["new"]) * len(grid["history"]), "indexer": len(grid["new"]) * len(grid["history"]),
                    "scratch_fill": len(grid["fill_rows"]), "fused_store": len(grid["store_tokens"])}.get(part, len(grid["new"]))  # fmt: skip
            assert len(pts) == want, f"{part} {kv}: {len(pts)} points, want {want}"
    assert set(raw["modes"]) == {"gemms", "moe", "moe_dense"}, raw["modes"]
    assert raw["timing"]["warmup"] == 1 and raw["timing"]["reps"] == 3


def test_the_toy_results_load_and_every_part_answers(toy):
    path, _ = toy
    terms = LT.load(str(path))
    for kv in LT.KV:
        parts = [terms.ms(part, kv, 16, 24) for part in LT.PARTS]
        assert all(v > 0 for v in parts), parts
        assert terms.layer_ms(kv, 16, 24) == pytest.approx(sum(parts))
        assert terms.fill_ms(kv, 256) > 0 and terms.store_ms(kv, 16) > 0
        assert all(0 <= terms.max_rel_err[part, kv] < 10 for part in LT.PARTS)
    text = "\n".join(terms.describe())
    for part in (*LT.PARTS, "scratch_fill", "fused_store"):
        assert part in text, f"describe() does not mention {part}"
    assert "extrapolates" in text and "stand-in" in text


def synthetic(coefs: dict, topk: int = 2048) -> dict:
    """A results file whose every point is a part's formula at known coefficients."""
    qs, hs = [256, 1024, 4096, 16384], [0, 8192, 131072, 1048576]
    points = []
    for part, kv in [(p, k) for p, kvs in PARTS_KV.items() for k in kvs]:
        c = coefs[part]
        if part in ("attention", "indexer"):
            for q in qs:
                for h in hs:
                    ms = float(np.dot(c, LT.features(part, q, h, topk)))
                    points.append({"part": part, "kv": kv, "new": q, "history": h, "ms": ms})
        else:
            key = {"scratch_fill": "rows", "fused_store": "tokens"}.get(part, "new")
            points += [{"part": part, "kv": kv, key: x, "ms": c[0] + c[1] * x} for x in qs]
    prov = {"commit": "0" * 40, "dirty": False, "machine": {"cpu": "test", "gpus": ["synthetic"]}, "date_utc": "2026",
            "command": "synthetic", "model": {"name": "synthetic", "shapes": {"topk": topk}}, "stand_ins": []}  # fmt: skip
    kernels = {
        k: k for k in ("attention", "dequant", "indexer_logits", "indexer_topk", "fused_store_bf16", "fused_store_fp8")
    }
    return {"provenance": prov, "kernels": kernels, "modes": {"gemms": {"q_b": "rowwise"}, "moe": "m", "moe_dense": "d"},
            "grid": {"new": qs, "history": hs}, "points": points, "wall_s": 1.0}  # fmt: skip


COEFS = {"attention": [0.05, 2e-4, 3e-9, 1e-6], "indexer": [0.02, 1e-5, 4e-11], "gemms": [0.1, 5e-4], "moe": [0.3, 7e-4],
         "scratch_fill": [0.01, 2e-6], "fused_store": [0.008, 3e-6]}  # fmt: skip


def test_the_fit_recovers_known_coefficients_exactly(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(synthetic(COEFS)))
    terms = LT.load(str(path))
    for (part, kv), fit in terms.fits.items():
        got = list(fit.coef.values())
        assert got == pytest.approx(COEFS[part], rel=1e-6), f"{part} {kv}: {got} != {COEFS[part]}"
        assert fit.max_rel_err < 1e-9, (part, kv, fit.max_rel_err)
    a, b, c, d = COEFS["attention"]
    q, h = 3000, 50000
    assert terms.ms("attention", "fp8", q, h) == pytest.approx(a + b * q + c * q * min(2048, h + q / 2) + d * h)
    assert terms.ms("indexer", "bf16", q, h) == terms.ms("indexer", "fp8", q, h)  # one fit for both dtypes
    assert terms.ms("gemms", "fp8", 0, h) == 0.0 and terms.fill_ms("bf16", 0) == 0.0 and terms.store_ms("fp8", 0) == 0.0
    assert terms.ms("moe", "bf16", 1, 0) == pytest.approx(0.3 + 7e-4)  # below the grid: towards the constant


def test_the_fit_keeps_coefficients_non_negative():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    y = 5.0 - 0.5 * x  # falling with x: an unconstrained slope would be negative
    rows = np.stack([np.ones_like(x), x], axis=1)
    coef = LT.nonnegative_lstsq_rel(rows, y)
    assert (coef >= 0).all() and coef[1] == 0.0, coef


def test_bad_arguments_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="gpu_run.sh layer"):
        LT.load(str(tmp_path / "absent.json"))
    raw = synthetic(COEFS)
    (tmp_path / "r.json").write_text(json.dumps(raw))
    terms = LT.load(str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match="expected one of"):
        terms.ms("scratch_fill", "fp8", 10, 0)
    with pytest.raises(ValueError, match="kv='int8'"):
        terms.ms("attention", "int8", 10, 0)
    with pytest.raises(ValueError, match=">= 0"):
        terms.ms("attention", "fp8", -1, 0)
    partial = copy.deepcopy(raw)
    partial["points"] = [p for p in raw["points"] if p["part"] != "moe"]
    (tmp_path / "p.json").write_text(json.dumps(partial))
    with pytest.raises(ValueError, match="no points for .*moe"):
        LT.load(str(tmp_path / "p.json"))


def _gen_result_tables():
    spec = importlib.util.spec_from_file_location("gen_result_tables", ROOT / "scripts" / "gen_result_tables.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_the_docs_block_says_not_run_yet_without_the_file_and_renders_it_with(tmp_path, toy):
    generator = _gen_result_tables()
    generator.RESULTS = str(tmp_path)
    assert generator.render("glm5_layer").startswith("Not run yet: `bash scripts/gpu_run.sh layer")
    (tmp_path / "bench_glm5_layer_1xh200.json").write_text(toy[0].read_text())
    text = generator.render("glm5_layer")
    assert "| attention | bf16 |" in text and "| indexer | both |" in text and "max rel err" in text, text
    assert "From `benchmark/results/bench_glm5_layer_1xh200.json`" in text


def test_the_benchmark_refuses_a_device_it_cannot_time_on():
    proc = run_bench("--device", "cpu", env_extra={"TRITON_INTERPRET": "0"})
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
