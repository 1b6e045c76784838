"""The installed package holds what the SGLang plugin runs and nothing else: every module imports,
none lies outside the allow-list, and importing the package, or the plugin's ledger, pulls in no
torch, SGLang or Mooncake (CPU: importing every module imports SGLang)."""

import importlib
import pkgutil
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

import sglang_nsa_cp

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

# Top-level modules and packages of sglang_nsa_cp (sglang_ext/ is the plugin: all of it belongs).
ALLOWED = {
    "sglang_nsa_cp.envs",  # every SGLANG_NSA_CP_* variable
    "sglang_nsa_cp.sglang_ext",  # the plugin
    "sglang_nsa_cp.kernels",  # the fused fp8 store the plugin's pool calls, its dispatch and checks
    "sglang_nsa_cp.kernels.checks",
    "sglang_nsa_cp.kernels.formats",
    "sglang_nsa_cp.kernels.mla_fp8_owned_and_scratch",
    "sglang_nsa_cp.kernels.triton_common",
    "sglang_nsa_cp.disagg",  # the owned-page PD rules: manifest, commit, auth
    "sglang_nsa_cp.disagg.auth",
    "sglang_nsa_cp.disagg.commit",
    "sglang_nsa_cp.disagg.manifest",
    "sglang_nsa_cp.disagg.listeners",  # Mooncake's unbindable listeners, for the start-up refusal
    "sglang_nsa_cp.comm",  # the narrow tail gather
    "sglang_nsa_cp.comm.collectives",
    "sglang_nsa_cp.comm.tail",
}
# Never imported by `import sglang_nsa_cp` or the ledger: the reference model and the standalone
# transport are gone, and the heavy dependencies load only when SGLang loads the plugin.
HEAVY = ("torch", "sglang", "mooncake", "zmq", "triton", "msgspec")  # top-level packages


def _all_modules():
    return sorted(m.name for m in pkgutil.walk_packages(sglang_nsa_cp.__path__, "sglang_nsa_cp."))


def test_no_module_outside_the_allow_list():
    extra = [m for m in _all_modules() if m not in ALLOWED and not m.startswith("sglang_nsa_cp.sglang_ext.")]
    assert not extra, (
        f"modules outside the allow-list (move them out of the package or add them with a reason): {extra}"
    )
    missing = sorted(m for m in ALLOWED if m not in _all_modules())
    assert not missing, f"allow-listed modules that no longer exist (drop them from ALLOWED): {missing}"


def test_every_module_imports():
    names = _all_modules()
    for part in ("comm", "disagg", "kernels", "sglang_ext.ledger", "sglang_ext.disaggregation.status_guard"):
        assert f"sglang_nsa_cp.{part}" in names, f"the walk missed sglang_nsa_cp.{part}: {names}"
    for name in names:
        assert importlib.import_module(name).__name__ == name


def test_the_package_and_the_ledger_import_nothing_heavy():
    code = (
        "import sys, sglang_nsa_cp, sglang_nsa_cp.sglang_ext.ledger; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"`import sglang_nsa_cp` + the ledger imported: {out}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
