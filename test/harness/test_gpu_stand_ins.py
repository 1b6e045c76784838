"""CPU (four interpreters importing torch): the GPU harness's import-time stand-ins (test/helpers/gpu_stand_ins.py) on a fake
sgl_kernel package laid out like the real one (its load_utils.py loads the op library at import).
Each case runs in a fresh interpreter: the stand-ins change sys.meta_path and torch.ops."""

import os
import subprocess
import sys
import textwrap

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu-unit")

TEST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds helpers/

FAKE_INIT = """
from sgl_kernel.load_utils import _load_architecture_specific_ops
common_ops = _load_architecture_specific_ops()
"""
FAKE_LOAD_UTILS = """
def _load_architecture_specific_ops():
    raise ImportError("the real op library needs torch 2.14's C++ ABI")
"""


def _run(
    tmp_path, body: str, env_extra: dict | None = None, with_sgl_kernel: bool = True
) -> subprocess.CompletedProcess:
    if with_sgl_kernel:
        pkg = tmp_path / "sgl_kernel"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(FAKE_INIT)
        (pkg / "load_utils.py").write_text(FAKE_LOAD_UTILS)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_JIT_DEEPGEMM"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), TEST_DIR])
    env.update(env_extra or {})
    code = "from helpers import gpu_stand_ins as g\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_imports_pass_and_calls_raise_naming_the_op(tmp_path):
    out = _run(
        tmp_path,
        """
        import os
        g.install()
        assert os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"
        import sgl_kernel, torch, deep_gemm
        from deep_gemm.utils import layout
        assert not hasattr(torch.ops.sgl_kernel, "rmsnorm"), "SGLang's hasattr probes must see no op"
        calls = [lambda: sgl_kernel.common_ops.rmsnorm(1), lambda: torch.ops.sgl_kernel.rmsnorm.default(1),
                 lambda: deep_gemm.fp8_mqa_logits(1), lambda: layout.get_tma_aligned_size(2)]
        for call in calls:
            try:
                call()
            except NotImplementedError as exc:
                print("raised:", exc)
            else:
                raise AssertionError("a stand-in returned")
        names = [(name, kind) for name, _, kind in g.uses()]
        print(names)
        assert ("sgl_kernel.common_ops.rmsnorm", "call") in names
        assert ("torch.ops.sgl_kernel.rmsnorm", "lookup") in names
        assert ("deep_gemm.fp8_mqa_logits", "call") in names
        assert ("deep_gemm.utils.layout.get_tma_aligned_size", "call") in names
        assert all(caller.startswith("<string>:") for _, caller, _ in g.uses()), g.uses()
        g.install()  # idempotent
        print(g.report())
    """,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "raised: sgl_kernel.common_ops.rmsnorm is a stand-in" in out.stdout
    assert "raised: torch.ops.sgl_kernel.rmsnorm is not loaded" in out.stdout


def test_install_after_import_is_refused(tmp_path):
    out = _run(tmp_path, "import sys, types\nsys.modules['sgl_kernel'] = types.ModuleType('sgl_kernel')\ng.install()\n")
    assert out.returncode != 0
    assert "must run before anything imports sgl_kernel" in out.stderr, out.stderr


def test_deep_gemm_flag_on_is_refused(tmp_path):
    out = _run(tmp_path, "g.install()\n", env_extra={"SGLANG_ENABLE_JIT_DEEPGEMM": "1"})
    assert out.returncode != 0
    assert "SGLANG_ENABLE_JIT_DEEPGEMM='1'" in out.stderr, out.stderr


def test_missing_sgl_kernel_names_the_fix(tmp_path):
    out = _run(tmp_path, "g.install()\n", with_sgl_kernel=False)
    assert out.returncode != 0
    assert "source scripts/gpu_unpack.sh" in out.stderr, out.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
