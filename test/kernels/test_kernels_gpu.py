"""Triton kernels, and the CUDA fp8 store, against their torch references on CUDA at GLM-5 sizes
(GPU, ~20 s on an H200 plus about a minute to build the CUDA kernel the first time).

Runs with TRITON_INTERPRET=0: scripts/run_suite.py --suite nsa-cp-test-1-gpu-h200 and this file's
own entry set it; plain pytest needs it in the environment (conftest.py turns the interpreter on).
Rows are GLM-5's: bf16 latent 576 values (1152 bytes), FlashMLA fp8 656 bytes, index K 128 fp8
bytes + fp32 scale (132 bytes), 64-token pages; batches of 8k to 128k tokens. Every comparison
is bitwise, including fp8 quantization (the kernel's fma division and hardware e4m3 conversion
against torch's division and rounding). Failure messages carry the seed;
SGLANG_NSA_CP_TEST_SEED=<seed> replays it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=95, suite="nsa-cp-test-1-gpu-h200")

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
from sglang_nsa_cp.kernels import copy_rows, formats, index_k_store, mla_fp8_owned_and_scratch, mla_fp8_store  # noqa: E402

from helpers import kernel_bytes  # noqa: E402
from helpers.kernel_bytes import POISON, assert_bytes_equal, every_bf16_block_value, seed_torch  # noqa: E402

DEV = torch.device("cuda")
PAGE = 64
ROW_KINDS = [
    ("bf16-latent-1152B", torch.bfloat16, 576),
    ("fp8-latent-656B", torch.uint8, 656),
    ("index-132B", torch.uint8, 132),
]
# (name, dtype, elements per row, tokens per row): token rows and 64-token page rows.
COPY_KINDS = [(name, dtype, width, 1) for name, dtype, width in ROW_KINDS] + [
    (f"{name}-page", dtype, PAGE * width, PAGE) for name, dtype, width in ROW_KINDS
]


@pytest.fixture(params=["triton", "cuda"])
def fp8_store(request):
    """The fp8 store under test: the Triton kernel, or the CUDA one (built on first use)."""
    if request.param == "triton":
        return mla_fp8_store.store_owned_mla_fp8_triton
    mla_fp8_store.build_cuda(DEV)  # a build failure fails the test: the GPU machine has nvcc and ninja
    return mla_fp8_store.store_owned_mla_fp8_cuda


@pytest.fixture
def seed() -> int:
    return seed_torch()


def random_rows(rows: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    return kernel_bytes.random_rows(rows, dtype, width, DEV)


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


@pytest.mark.parametrize("kind,dtype,width,tokens_per_row", COPY_KINDS, ids=[k[0] for k in COPY_KINDS])
@pytest.mark.parametrize("tokens", [8192, 131072])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_and_scatter(seed, kind, dtype, width, tokens_per_row, tokens, index_dtype):
    rows = tokens // tokens_per_row
    src = random_rows(rows, dtype, width)
    index = with_skips(torch.randperm(rows, device=DEV)).to(index_dtype)
    name = f"{kind} {tokens=} {index_dtype} {seed=}"
    got = copy_rows.gather_rows_triton(src, index, poisoned(rows, dtype, width))
    assert_bytes_equal(
        f"gather {name}", got, copy_rows.gather_rows_torch(src, index.long(), poisoned(rows, dtype, width))
    )
    got = copy_rows.scatter_rows_triton(poisoned(rows, dtype, width), index, src)
    assert_bytes_equal(
        f"scatter {name}", got, copy_rows.scatter_rows_torch(poisoned(rows, dtype, width), index.long(), src)
    )


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
@pytest.mark.parametrize("kind,dtype,width", ROW_KINDS[:2], ids=[k[0] for k in ROW_KINDS[:2]])
def test_store_owned_rows(seed, cp_size, kind, dtype, width):
    tokens, pages = 131072 - 37, 131072 // PAGE + cp_size
    pages += -pages % cp_size
    slots = logical_slots(tokens, pages)
    rows = random_rows(tokens, dtype, width)
    shard_rows = pages // cp_size * PAGE
    for rank in (0, cp_size - 1):
        got = copy_rows.store_owned_rows_triton(
            poisoned(shard_rows, dtype, width), slots.int(), rows, rank, cp_size, PAGE
        )
        want = copy_rows.store_owned_rows_torch(poisoned(shard_rows, dtype, width), slots, rows, rank, cp_size, PAGE)
        assert_bytes_equal(f"store {kind} {cp_size=} {rank=} {seed=}", got, want)


@pytest.mark.parametrize("cp_size,tokens", [(1, 8192), (4, 131072), (8, 131072 - 5)])
def test_store_owned_mla_fp8(fp8_store, seed, cp_size, tokens):
    pages = -(-(tokens + PAGE) // PAGE)
    pages += -pages % cp_size
    slots = logical_slots(tokens, pages)
    kv = torch.randn(tokens, 576, device=DEV) * torch.exp(torch.randn(tokens, 1, device=DEV) * 4)
    kv[torch.rand(kv.shape, device=DEV) < 0.02] = 0.0
    kv = kv.to(torch.bfloat16)
    shard_rows = pages // cp_size * PAGE
    for rank in (0, cp_size - 1):
        got = fp8_store(poisoned(shard_rows, torch.uint8, 656), slots, kv, rank, cp_size, PAGE)
        want = mla_fp8_store.store_owned_mla_fp8_torch(
            poisoned(shard_rows, torch.uint8, 656), slots, kv, rank, cp_size, PAGE
        )
        assert_bytes_equal(f"fp8 store {cp_size=} {tokens=} {rank=} {seed=}", got, want)


def test_fp8_rounding_of_every_bf16_value(fp8_store):
    kv = every_bf16_block_value().to(DEV)
    slots = torch.arange(kv.shape[0], device=DEV)
    got = fp8_store(poisoned(kv.shape[0], torch.uint8, 656), slots, kv, 0, 1, PAGE)
    assert_bytes_equal("fp8 rounding of every bf16 value in [2**-12, 448]", got, formats.quantize_mla_fp8(kv))


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


def test_fp8_division_of_every_bf16_value_by_every_scale(fp8_store):
    """The kernel divides with one reciprocal and one fma correction, not an IEEE division: its
    fp8 codes must equal torch's x / scale for every bf16 amax (the scale is amax * fp32(1/448))
    and every bf16 x with |x| <= amax, 1,065,402,240 pairs."""
    finite_positive = 0x7F7F
    for first in range(0, finite_positive + 1, 512):
        amax_bits = torch.arange(first, min(first + 512, finite_positive + 1), dtype=torch.int32, device=DEV)
        kv = every_scale_and_value_rows(amax_bits)
        slots = torch.arange(kv.shape[0], device=DEV)
        got = fp8_store(poisoned(kv.shape[0], torch.uint8, 656), slots, kv, 0, 1, PAGE)
        assert_bytes_equal(f"fp8 codes for bf16 amax bits {first:#x}..", got, formats.quantize_mla_fp8(kv))


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


@pytest.mark.parametrize("cp_size", [1, 2, 8])
def test_store_owned_index_k(seed, cp_size):
    tokens = 131072 - 11
    pages = tokens // PAGE + 2
    pages += -pages % cp_size
    slots = logical_slots(tokens, pages)
    key = random_rows(tokens, torch.uint8, 128)
    scale = torch.rand(tokens, device=DEV) * 10
    for rank in (0, cp_size - 1):
        got = index_k_store.store_owned_index_k_triton(
            poisoned(pages // cp_size, torch.uint8, PAGE * 132), slots, key, scale, rank, cp_size, PAGE
        )
        want = index_k_store.store_owned_index_k_torch(
            poisoned(pages // cp_size, torch.uint8, PAGE * 132), slots, key, scale, rank, cp_size, PAGE
        )
        name = f"index-K store {cp_size=} {rank=} {seed=}"
        assert_bytes_equal(name, got, want)
        rows = formats.owned_physical_rows(slots, rank, cp_size, PAGE)
        mine = rows >= 0
        back_key, back_scale = formats.read_index_k(got, rows[mine], PAGE)
        assert torch.equal(back_key, key[mine]) and torch.equal(back_scale, scale[mine]), name


def test_offsets_past_2_31(seed):
    """A 2.1 GB byte-row source (1-byte words): offsets need int64."""
    width = 1027
    rows = 2**31 // width + 64
    src = torch.empty((rows, width), dtype=torch.uint8, device=DEV)
    tail = src[-64:]
    tail.copy_(random_rows(64, torch.uint8, width))
    index = torch.arange(rows - 64, rows, device=DEV).flip(0)
    got = copy_rows.gather_rows_triton(src, index, poisoned(64, torch.uint8, width))
    assert_bytes_equal(f"gather past 2**31 bytes {seed=}", got, tail.flip(0))
    out = poisoned(rows, torch.uint8, width)
    copy_rows.scatter_rows_triton(out, index, got)
    assert_bytes_equal(f"scatter past 2**31 bytes {seed=}", out[-64:], tail)


def test_auto_dispatch_on_cuda_uses_the_cuda_fp8_store_and_triton_otherwise():
    kernels.kernel_mode.cache_clear()
    forced = kernels.kernel_mode()
    assert kernels.implementation("store_owned_rows", DEV) == ("torch" if forced == "torch" else "triton")
    assert kernels.implementation("store_owned_mla_fp8", DEV) == {"auto": "cuda"}.get(forced, forced)


def test_cuda_fp8_store_refuses_bad_input_before_launching():
    kv = torch.zeros(4, 576, dtype=torch.bfloat16, device=DEV)
    shard = torch.zeros(4, 656, dtype=torch.uint8, device=DEV)
    with pytest.raises(TypeError, match="kv must be bf16"):
        mla_fp8_store.store_owned_mla_fp8_cuda(shard, torch.arange(4, device=DEV), kv.float(), 0, 1, PAGE)
    with pytest.raises(ValueError, match="slots must be 1-D with 4 entries"):
        mla_fp8_store.store_owned_mla_fp8_cuda(shard, torch.arange(3, device=DEV), kv, 0, 1, PAGE)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        mla_fp8_store.store_owned_mla_fp8_cuda(shard.cpu(), torch.arange(4), kv.cpu(), 0, 1, PAGE)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
