"""The env-var registry (CPU): typed reads, overrides, and docs that list exactly the
registered variables."""

import re
import sys
from pathlib import Path

import pytest

from sglang_nsa_cp.envs import envs, markdown_table

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"SGLANG_NSA_CP_[A-Z0-9_]*[A-Z0-9]")


def test_deploy_guide_table_is_the_generated_one():
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert markdown_table() in guide, "docs/deploy.md's variable table is stale: paste `python -m sglang_nsa_cp.envs`"


def test_every_variable_named_anywhere_is_registered():
    registered = {v.name for v in envs.all()}
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "python").rglob("*.py"),
             *(ROOT / "test").glob("*.py"), *(ROOT / "benchmark").glob("*.py")]  # fmt: skip
    named = {(name, f.relative_to(ROOT).as_posix()) for f in files for name in NAME.findall(f.read_text())}
    unknown = sorted((name, path) for name, path in named if name not in registered)
    assert not unknown, f"(variable, file) not declared in python/sglang_nsa_cp/envs.py: {unknown}"


def test_typed_reads_and_overrides(monkeypatch):
    with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
        assert envs.SGLANG_NSA_CP_SHARED_KV.get() is True
    monkeypatch.delenv("SGLANG_NSA_CP_SHARED_KV", raising=False)
    assert envs.SGLANG_NSA_CP_SHARED_KV.get() is False
    monkeypatch.setenv("SGLANG_NSA_CP_SHARED_KV", "maybe")
    with pytest.raises(ValueError, match="SGLANG_NSA_CP_SHARED_KV='maybe' is not a boolean"):
        envs.SGLANG_NSA_CP_SHARED_KV.get()
    with envs.SGLANG_NSA_CP_KERNELS.override("Torch"):
        assert envs.SGLANG_NSA_CP_KERNELS.get() == "torch"
    with envs.SGLANG_NSA_CP_KERNELS.override("cuda"), pytest.raises(ValueError, match="expected one of"):
        envs.SGLANG_NSA_CP_KERNELS.get()
    with envs.SGLANG_NSA_CP_PD_SECRET.override("short"), pytest.raises(ValueError, match="at least 16"):
        envs.SGLANG_NSA_CP_PD_SECRET.get()
    secret = "0123456789abcdef0123"
    for padded in (secret + "\n", " " + secret):  # every other variable refuses them: so does the secret
        monkeypatch.setenv("SGLANG_NSA_CP_PD_SECRET", padded)
        with pytest.raises(ValueError, match="SGLANG_NSA_CP_PD_SECRET has 1 space character") as refused:
            envs.SGLANG_NSA_CP_PD_SECRET.get()
        assert secret not in str(refused.value)  # never the value
    monkeypatch.setenv("SGLANG_NSA_CP_PD_SECRET", "   ")
    assert envs.SGLANG_NSA_CP_PD_SECRET.get() is None  # blank reads as unset
    monkeypatch.delenv("SGLANG_NSA_CP_PD_SECRET")
    with envs.SGLANG_NSA_CP_TEST_SEED.override(7):
        assert envs.SGLANG_NSA_CP_TEST_SEED.get() == 7
    monkeypatch.setenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED", " 1")
    with pytest.raises(ValueError, match=r"SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED=' 1' has spaces around its value"):
        envs.SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED.get()
    monkeypatch.setenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED", "  ")
    assert envs.SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED.get() is False  # blank reads as unset
    with pytest.raises(RuntimeError, match=r"use SGLANG_NSA_CP_SHARED_KV.get\(\)"):
        bool(envs.SGLANG_NSA_CP_SHARED_KV)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
