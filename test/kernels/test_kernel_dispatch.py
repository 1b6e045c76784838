"""The kernels' dispatcher falls back to the torch reference only for named reasons and raises
everything else; the references check their input like the kernels (CPU, ~5 s, no Triton launch:
the kernels are replaced by stand-ins that raise)."""

import sys
import warnings

import pytest
import torch

from sglang_nsa_cp import kernels
from sglang_nsa_cp.kernels import copy_rows, index_k_store, mla_fp8_store
from sglang_nsa_cp.kernels.checks import KernelUnsupported

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")


@pytest.fixture
def auto_on_cuda(monkeypatch):
    """Auto mode, every op dispatched as if its tensors were on a GPU without a CUDA build."""
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    kernels.kernel_mode.cache_clear()
    monkeypatch.setattr(kernels, "implementation", lambda op, device: "torch" if op in kernels._failed else "triton")
    yield
    kernels.kernel_mode.cache_clear()
    kernels._failed.clear()
    kernels._warned_unsupported.clear()


def _rows(n, width=8):
    return torch.arange(n * width, dtype=torch.uint8).view(n, width)


def test_an_illegal_address_is_raised_not_swallowed(auto_on_cuda, monkeypatch):
    def crash(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(copy_rows, "gather_rows_triton", crash)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="illegal memory access"):
            kernels.gather_rows(_rows(4), torch.tensor([1, 0]), _rows(2))
    assert not kernels._failed, "a crash must not switch the op to the reference"


def test_a_layout_the_kernel_cannot_take_uses_the_reference_for_that_call(auto_on_cuda, monkeypatch):
    calls = []

    def unsupported(*args):
        calls.append(args)
        raise KernelUnsupported("needs contiguous rows")

    monkeypatch.setattr(copy_rows, "scatter_rows_triton", unsupported)
    src, index = _rows(3), torch.tensor([2, -1, 0])
    with pytest.warns(
        RuntimeWarning, match="scatter_rows: the triton kernel cannot take this input .*needs contiguous rows"
    ):
        got = kernels.scatter_rows(torch.zeros(4, 8, dtype=torch.uint8), index, src)
    assert torch.equal(got, copy_rows.scatter_rows_torch(torch.zeros(4, 8, dtype=torch.uint8), index, src))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op
        kernels.scatter_rows(torch.zeros(4, 8, dtype=torch.uint8), index, src)
    assert len(calls) == 2, "only that call falls back: the next one tries the kernel again"
    assert not kernels._failed


def test_the_kernels_name_strided_rows_as_unsupported_not_as_bad_input():
    pytest.importorskip("triton")
    src = _rows(4).t()
    with pytest.raises(KernelUnsupported, match="src needs contiguous rows"):
        copy_rows.gather_rows_triton(src, torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.uint8))
    # The reference takes the same strided rows.
    out = copy_rows.gather_rows_torch(src, torch.tensor([3, -1]), torch.zeros(2, 4, dtype=torch.uint8))
    assert torch.equal(out[0], src[3]) and not out[1].any()


BAD_REFERENCE_CALLS = {
    "gather dtype": (
        lambda: copy_rows.gather_rows_torch(_rows(4), torch.tensor([0]), torch.zeros(1, 8)),
        TypeError, "src is torch.uint8 but out is torch.float32",
    ),
    "scatter index length": (
        lambda: copy_rows.scatter_rows_torch(_rows(4), torch.tensor([0, 1]), _rows(3)),
        ValueError, "index must be 1-D with 3 entries",
    ),
    "store rank": (
        lambda: copy_rows.store_owned_rows_torch(_rows(4), torch.arange(4), _rows(4), 2, 2, 64),
        ValueError, "0 <= rank < cp_size",
    ),
    "fp8 kv dtype": (
        lambda: mla_fp8_store.store_owned_mla_fp8_torch(
            torch.zeros(4, 656, dtype=torch.uint8), torch.arange(4), torch.zeros(4, 576), 0, 1, 64),
        TypeError, "kv must be bf16",
    ),
    "index pages width": (
        lambda: index_k_store.store_owned_index_k_torch(
            torch.zeros(2, 100, dtype=torch.uint8), torch.arange(3), torch.zeros(3, 128, dtype=torch.uint8),
            torch.ones(3), 0, 1, 4),
        TypeError, r"pages must be uint8 \[P, 528\]",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_REFERENCE_CALLS)
def test_references_check_their_input(case):
    call, error, message = BAD_REFERENCE_CALLS[case]
    with pytest.raises(error, match=message):
        call()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
