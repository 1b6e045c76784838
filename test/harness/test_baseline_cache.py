"""The forward baselines' cache (helpers/baseline_cache.py), CPU: a result is reused only for
the same inputs; a changed argument, checkpoint byte, source file, steering variable or a file
whose stored key is not its inputs' recomputes it, and `off` always recomputes."""

import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from helpers import baseline_cache as B

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")


def baseline(rank, world, group, *args):  # what the runner is asked to run (never run here)
    raise AssertionError("the counting runner stands in for the ranks")


class Runner:
    """Stands in for run_ranks: counts the computations, returns a fresh tensor per call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn, world, args=(), timeout_s=0):
        self.calls += 1
        return [{"logits": torch.full((2,), float(self.calls)), "rank": r} for r in range(world)]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.delenv(B.CACHE_ENV, raising=False)
    ckpt, src = tmp_path / "ckpt", tmp_path / "src"
    ckpt.mkdir()
    src.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (src / "harness.py").write_text("x = 1\n")
    runner = Runner()

    def run(*args, world=2):
        return B.cached_run_ranks(baseline, world, (str(ckpt), *args), runner=runner, sources=[src],
                                  where=tmp_path / "cache")  # fmt: skip

    return run, runner, ckpt, src, tmp_path / "cache"


def test_the_same_inputs_reuse_the_result(setup):
    run, runner, *_ = setup
    first = run("replicated", "bfloat16")
    again = run("replicated", "bfloat16")
    assert runner.calls == 1 and torch.equal(again[1]["logits"], first[1]["logits"]) and again[1]["rank"] == 1


@pytest.mark.parametrize("change", ["argument", "world", "checkpoint", "source", "source added", "variable"])
def test_changed_inputs_recompute(setup, monkeypatch, change):
    run, runner, ckpt, src, _ = setup
    run("replicated", "bfloat16")
    if change == "checkpoint":
        (ckpt / "model.safetensors").write_bytes(b"weightz")  # same path, same size, other bytes
    elif change == "source":
        (src / "harness.py").write_text("x = 2\n")
    elif change == "source added":
        (src / "plugin.py").write_text("")
    elif change == "variable":
        monkeypatch.setenv("SGLANG_NSA_CP_SCRATCH_CONTEXTS", "2")
    got = run("replicated", "fp8_e4m3" if change == "argument" else "bfloat16", world=3 if change == "world" else 2)
    assert runner.calls == 2 and got[0]["logits"][0] == 2.0, f"{change}: a stale baseline was reused"
    run("replicated", "fp8_e4m3" if change == "argument" else "bfloat16", world=3 if change == "world" else 2)
    assert runner.calls == 2, f"{change}: the recomputed baseline was not kept"


def test_bytecode_is_no_input(setup):
    run, runner, _, src, _ = setup
    run("off")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "harness.cpython-311.pyc").write_bytes(b"\x00")
    run("off")
    assert runner.calls == 1


@pytest.mark.parametrize("content", ["a stored key of other inputs", "a torn file"])
def test_a_file_not_holding_its_inputs_key_is_recomputed_and_replaced(setup, content):
    run, runner, _, _, cache = setup
    run("off")
    (path,) = cache.iterdir()
    if content == "a torn file":
        path.write_bytes(path.read_bytes()[:20])
    else:
        stored = torch.load(path, weights_only=False)
        torch.save({"key": "0" * 64, "result": stored["result"]}, path)
    assert run("off")[0]["logits"][0] == 2.0 and runner.calls == 2
    run("off")
    assert runner.calls == 2 and [p.name for p in cache.iterdir()] == [path.name]


def test_off_always_recomputes(setup, monkeypatch, tmp_path):
    monkeypatch.setenv(B.CACHE_ENV, "off")
    runner = Runner()
    for _ in range(2):
        B.cached_run_ranks(baseline, 1, ("off",), runner=runner)
    assert runner.calls == 2 and B.cache_dir() is None
    monkeypatch.setenv(B.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert B.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(B.CACHE_ENV)
    assert B.cache_dir() == B.DEFAULT_DIR and ".pytest_cache" in B.DEFAULT_DIR.parts


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
