"""The kernels' dispatcher picks the implementation from the device and SGLANG_NSA_CP_KERNELS,
falls back to the torch reference only for named reasons and raises everything else (CPU,
no Triton launch: the op's kernel and reference are replaced by stand-ins that record or raise)."""

import sys
import warnings

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp import kernels
from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as op
from sglang_nsa_cp.kernels.checks import KernelUnsupported
from sglang_nsa_cp.kernels.triton_common import TritonError

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

OP = "store_mla_fp8_owned_and_scratch"
ARGS = (torch.zeros(2, 656, dtype=torch.uint8), torch.arange(2), torch.zeros(2, 656, dtype=torch.uint8),
        torch.arange(2), torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16),
        0, 1, 64)  # fmt: skip


@pytest.fixture
def mode(monkeypatch):
    """Set SGLANG_NSA_CP_KERNELS (None: unset) and re-read it; the dispatcher's state is reset after."""

    def set_mode(value):
        if value is None:
            monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
        else:
            monkeypatch.setenv(kernels.KERNELS_ENV, value)
        kernels.kernel_mode.cache_clear()

    yield set_mode
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    kernels.kernel_mode.cache_clear()
    kernels._failed.clear()
    kernels._warned_unsupported.clear()


@pytest.fixture
def calls(monkeypatch):
    """The reference records its calls; the kernel is whatever a test sets with `monkeypatch`."""
    made = []
    monkeypatch.setattr(op, f"{OP}_torch", lambda *a: made.append("torch") or "reference")
    monkeypatch.setattr(op, f"{OP}_triton", lambda *a: made.append("triton") or "kernel")
    return made


@pytest.fixture
def auto_on_cuda(mode, monkeypatch):
    """Auto mode, the op dispatched as if its tensors were on a GPU."""
    mode(None)
    monkeypatch.setattr(kernels, "implementation", lambda o, device: "torch" if o in kernels._failed else "triton")


def test_dispatch_rule(mode):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    mode(None)
    assert kernels.implementation(OP, cpu) == "torch"
    assert kernels.implementation(OP, cuda) == "triton"
    mode("torch")
    assert kernels.implementation(OP, cuda) == "torch"
    mode("triton")
    assert kernels.implementation(OP, cpu) == "triton"
    mode("cuda")
    with pytest.raises(ValueError, match="expected one of"):
        kernels.implementation(OP, cpu)


def test_forced_triton_on_cpu_runs_the_kernel(mode, calls):
    mode("triton")
    assert kernels.store_mla_fp8_owned_and_scratch(*ARGS) == "kernel"
    mode("auto")
    assert kernels.store_mla_fp8_owned_and_scratch(*ARGS) == "reference"
    assert calls == ["triton", "torch"], calls


def test_an_illegal_address_is_raised_not_swallowed(auto_on_cuda, calls, monkeypatch):
    def crash(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(op, f"{OP}_triton", crash)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="illegal memory access"):
            kernels.store_mla_fp8_owned_and_scratch(*ARGS)
    assert not kernels._failed and not calls, "a crash must not switch the op to the reference"


def test_a_layout_the_kernel_cannot_take_uses_the_reference_for_that_call(auto_on_cuda, calls, monkeypatch):
    def unsupported(*args):
        calls.append("triton")
        raise KernelUnsupported("needs 4-byte aligned destinations")

    monkeypatch.setattr(op, f"{OP}_triton", unsupported)
    with pytest.warns(RuntimeWarning, match=f"{OP}: the triton kernel cannot take this input .*4-byte aligned"):
        assert kernels.store_mla_fp8_owned_and_scratch(*ARGS) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op
        kernels.store_mla_fp8_owned_and_scratch(*ARGS)
    assert calls == ["triton", "torch"] * 2, "only that call falls back: the next one tries the kernel again"
    assert not kernels._failed


def test_a_failed_compile_falls_back_from_then_on_with_one_warning(auto_on_cuda, calls, monkeypatch):
    def broken(*args):
        calls.append("triton")
        raise TritonError("no compiler")

    monkeypatch.setattr(op, f"{OP}_triton", broken)
    with pytest.warns(RuntimeWarning, match=f"{OP}: the Triton kernel failed .*no compiler.* from now on"):
        assert kernels.store_mla_fp8_owned_and_scratch(*ARGS) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.store_mla_fp8_owned_and_scratch(*ARGS)
    assert kernels._failed == {OP} and calls == ["triton", "torch", "torch"], calls


def test_bad_input_is_not_a_launch_failure(auto_on_cuda, monkeypatch):
    monkeypatch.setattr(op, f"{OP}_triton", lambda *a: op.check_store_mla_fp8_owned_and_scratch(*a))
    bad = list(ARGS)
    bad[3] = torch.arange(2).short()
    with pytest.raises(TypeError, match="slots must be int32 or int64"):
        kernels.store_mla_fp8_owned_and_scratch(*bad)
    assert not kernels._failed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
