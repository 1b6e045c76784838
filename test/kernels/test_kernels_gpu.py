"""The fused fp8 store's Triton kernel against its torch reference (SGLang's own quantizer,
compiled) on CUDA at GLM-5 sizes (GPU, ~20 s on an H200).

Runs with TRITON_INTERPRET=0: scripts/run_suite.py --suite nsa-cp-test-1-gpu-h200 and this file's
own entry set it; plain pytest needs it in the environment (conftest.py turns the interpreter on).
Rows are GLM-5's: bf16 latent 576 values in, FlashMLA fp8 656 bytes out, 64-token pages; batches
of 8k to 128k tokens. Every comparison is bitwise, fp8 codes included. Failure messages carry the seed;
SGLANG_NSA_CP_TEST_SEED=<seed> replays it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=40, suite="nsa-cp-test-1-gpu-h200")

from helpers.gpu_only import skip_unless_compiled_triton_on_cuda  # noqa: E402

skip_unless_compiled_triton_on_cuda()


def _sgl_kernel_without_op_library() -> bool:
    """The GPU bundle's sgl_kernel: its Python files only (docs/gpu_bundle.md)."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "**", "common_ops.*"), recursive=True)


if _sgl_kernel_without_op_library():
    # The fp8 store's reference runs SGLang's quantizer, whose module imports sgl_kernel; the
    # bundle's has no op library, so the stand-ins of helpers/gpu_stand_ins.py go in first.
    from helpers import gpu_stand_ins  # noqa: E402

    gpu_stand_ins.install()

from sglang_nsa_cp import kernels  # noqa: E402
from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch  # noqa: E402

from helpers.kernel_bytes import POISON, assert_bytes_equal, seed_torch  # noqa: E402

DEV = torch.device("cuda")
PAGE = 64


@pytest.fixture
def seed() -> int:
    return seed_torch()


def poisoned(rows: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    out = torch.empty((rows, width), dtype=dtype, device=DEV)
    out.view(torch.uint8).fill_(POISON)
    return out


def with_skips(index: torch.Tensor) -> torch.Tensor:
    index = index.clone()
    index[torch.rand(index.shape, device=DEV) < 0.1] = -1
    return index


def logical_slots(tokens: int, pages: int) -> torch.Tensor:
    order = torch.randperm(pages, device=DEV)
    slots = (order[:, None] * PAGE + torch.arange(PAGE, device=DEV)).reshape(-1)
    start = int(torch.randint(0, PAGE, ()))
    slots = slots[start : start + tokens].clone()
    slots[torch.rand(slots.shape, device=DEV) < 0.02] = -1
    return slots


def every_scale_and_value_rows(amax_bits: torch.Tensor) -> torch.Tensor:
    """Latent rows whose 128-value blocks each hold one amax (a bf16 value, so one fp8 scale)
    followed by 127 of the bf16 values x with |x| <= amax; for each amax in amax_bits, every
    such x appears (blocks padded with zeros)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEV).to(torch.int16).view(torch.bfloat16)
    per_block = 127
    blocks = -(-x.numel() // per_block)
    blocks += -blocks % 4  # whole rows of four blocks
    amax = amax_bits.to(torch.int16).view(torch.bfloat16)[:, None]
    values = torch.where(
        x.float().abs()[None, :] <= amax.float(), x[None, :], torch.zeros((), dtype=torch.bfloat16, device=DEV)
    )
    values = torch.nn.functional.pad(values, (0, blocks * per_block - x.numel()))
    tile = torch.cat([amax.expand(-1, blocks).reshape(-1, 1), values.reshape(-1, per_block)], 1)
    nope = tile.reshape(-1, 512)
    return torch.cat([nope, torch.zeros(nope.shape[0], 64, dtype=torch.bfloat16, device=DEV)], 1)


# ---- SGLang's fp8 rounding: store_mla_fp8_owned_and_scratch -----------------------------------
def store_sglang_fp8(impl, kv, scratch_rows, slots, rank, cp_size, shard_rows):
    fn = getattr(mla_fp8_owned_and_scratch, f"store_mla_fp8_owned_and_scratch_{impl}")
    scratch = poisoned(int(scratch_rows.max()) + 2, torch.uint8, 656)
    shard = poisoned(shard_rows, torch.uint8, 656)
    return fn(scratch, scratch_rows, shard, slots, kv[:, :512], kv[:, 512:], rank, cp_size, PAGE)


@pytest.mark.parametrize("cp_size,tokens", [(1, 8192), (4, 131072), (8, 131072 - 5)])
def test_store_mla_fp8_owned_and_scratch(seed, cp_size, tokens):
    """Triton kernel (run first) against the reference, i.e. SGLang's quantize_k_cache_separate,
    compiled: scratch and shard, every rank."""
    pages = tokens // PAGE + 2
    pages += -pages % cp_size
    slots = logical_slots(tokens, pages)
    scratch_rows = with_skips(torch.randperm(tokens, device=DEV) + 1)
    kv = torch.randn(tokens, 576, device=DEV) * torch.exp(torch.randn(tokens, 1, device=DEV) * 4)
    kv[torch.rand(kv.shape, device=DEV) < 0.02] = 0.0
    kv[:3, 128:256] = 0.0
    kv = kv.to(torch.bfloat16)
    for rank in range(cp_size):
        name = f"SGLang-rounding fp8 store {cp_size=} {rank=} {tokens=} {seed=}"
        got = store_sglang_fp8("triton", kv, scratch_rows, slots, rank, cp_size, pages // cp_size * PAGE)
        want = store_sglang_fp8("torch", kv, scratch_rows, slots, rank, cp_size, pages // cp_size * PAGE)
        assert_bytes_equal(f"{name} scratch", got[0], want[0])
        assert_bytes_equal(f"{name} shard", got[1], want[1])


def test_sglang_fp8_rounding_of_every_bf16_value_by_every_scale():
    """Same Triton operations as SGLang's quantizer, so the same bytes, for every bf16 amax
    (zero, subnormal and huge scales included) and every bf16 x with |x| <= amax."""
    finite_positive = 0x7F7F
    for first in range(0, finite_positive + 1, 512):
        amax_bits = torch.arange(first, min(first + 512, finite_positive + 1), dtype=torch.int32, device=DEV)
        kv = every_scale_and_value_rows(amax_bits)
        rows = torch.arange(kv.shape[0], device=DEV)
        got = store_sglang_fp8("triton", kv, rows, rows, 0, 1, kv.shape[0])
        want = store_sglang_fp8("torch", kv, rows, rows, 0, 1, kv.shape[0])
        assert_bytes_equal(f"SGLang fp8 codes for bf16 amax bits {first:#x}.. (scratch)", got[0], want[0])
        assert_bytes_equal(f"SGLang fp8 codes for bf16 amax bits {first:#x}.. (shard)", got[1], want[1])


def test_auto_dispatch_on_cuda_uses_the_triton_kernel():
    kernels.kernel_mode.cache_clear()
    forced = kernels.kernel_mode()
    assert kernels.implementation("store_mla_fp8_owned_and_scratch", DEV) == (
        "torch" if forced == "torch" else "triton"
    )


def test_sglang_fp8_rounding_of_non_finite_values():
    kv = torch.randn(6, 576, device=DEV)
    kv[0] = 0.0
    kv[1] = -0.0
    kv[2, 7] = float("inf")
    kv[3, 300] = float("-inf")
    kv[4, 200] = float("nan")
    kv[5, :128] = float("nan")
    kv = kv.to(torch.bfloat16)
    rows = torch.arange(6, device=DEV)
    got = store_sglang_fp8("triton", kv, rows, rows, 0, 1, 6)
    want = store_sglang_fp8("torch", kv, rows, rows, 0, 1, 6)
    assert_bytes_equal("SGLang fp8 of zero, inf and NaN blocks (scratch)", got[0], want[0])
    assert_bytes_equal("SGLang fp8 of zero, inf and NaN blocks (shard)", got[1], want[1])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
