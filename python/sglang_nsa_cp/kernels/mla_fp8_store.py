"""The fused fp8 quantize + store of owned MLA latent rows (`store_owned_mla_fp8`): its Triton
kernel and launcher (`_triton`), its CUDA kernel's loader and launcher (`_cuda`, source in
`cuda/store_owned_mla_fp8.cu`), the torch reference (`_torch`) and the input check all share.
The public function, with the full contract, is in `kernels/__init__.py`.

The Triton kernel quantizes in registers: amax per 128 values, scale = amax * fp32(1/448), codes
= RN(x / scale) through the hardware e4m3 conversion, bitwise equal to torch. Under Triton's
interpreter (CPU tests) the division is div_rn and the e4m3 rounding is done in integers,
because the interpreter neither fuses fma nor rounds fp32 -> fp8 correctly.

The CUDA kernel is faster on GPUs where the Triton one is short of memory bandwidth
(docs/kernels.md). It is built on first use with torch's cpp_extension for the device's
architecture (needs `nvcc` and `ninja`, which SGLang's own JIT kernels need too; about a minute),
cached under torch's extension directory (TORCH_EXTENSIONS_DIR) so later processes load it in
about a second; concurrent builds wait on one another through the cache's lock.
"""

from __future__ import annotations

import functools
import os
import subprocess
from types import ModuleType

import torch

from sglang_nsa_cp.kernels.checks import (
    KernelUnsupported,
    check_aligned,
    check_contiguous_rows,
    check_index,
    check_owner_args,
    check_rows,
)
from sglang_nsa_cp.kernels.formats import (
    FP8_MAX,
    MLA_DIM,
    MLA_FP8_BLOCK,
    MLA_FP8_ROW_BYTES,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
    owned_physical_rows,
    quantize_mla_fp8,
)
from sglang_nsa_cp.kernels.triton_common import jit, owned_rows, program_owned_rows, require_triton, tl, triton, wide

FP8_ROWS_PER_PROGRAM = 8  # launch shape (bench_kernels.py --sweep sets it)
FP8_NUM_WARPS = 4

CUDA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "store_owned_mla_fp8.cu")
# What building the CUDA kernel raises when this machine cannot build it: no nvcc or ninja
# (OSError, RuntimeError from cpp_extension), a compiler error (CalledProcessError, RuntimeError).
CUDA_BUILD_ERRORS = (OSError, ImportError, RuntimeError, subprocess.CalledProcessError)


def check_store_owned_mla_fp8(shard, slots, kv, rank: int, cp_size: int, page_size: int) -> None:
    """bf16 [T, 576] kv, uint8 [R, 656] shard on one device, slots [T]."""
    check_rows("kv", kv)
    check_rows("shard", shard)
    if kv.dtype != torch.bfloat16 or kv.shape[1] != MLA_DIM:
        raise TypeError(f"kv must be bf16 [T, {MLA_DIM}], got {kv.dtype} {tuple(kv.shape)}")
    if shard.dtype != torch.uint8 or shard.shape[1] != MLA_FP8_ROW_BYTES:
        raise TypeError(f"shard must be uint8 [R, {MLA_FP8_ROW_BYTES}], got {shard.dtype} {tuple(shard.shape)}")
    if shard.device != kv.device:
        raise ValueError(f"kv is on {kv.device} but shard is on {shard.device}")
    check_index("slots", slots, kv.shape[0], kv.device)
    check_owner_args(cp_size, page_size, rank)


def _check_kernel_layout(shard: torch.Tensor, kv: torch.Tensor) -> None:
    """Both kernels: a contiguous 16-byte aligned shard and 16-byte aligned kv rows."""
    check_contiguous_rows("kv", kv)
    check_contiguous_rows("shard", shard)
    if shard.stride(0) != MLA_FP8_ROW_BYTES:
        raise KernelUnsupported(f"store_owned_mla_fp8's kernel needs a contiguous shard, got strides {shard.stride()}")
    check_aligned("store_owned_mla_fp8", "16-byte aligned shard and kv rows", bytes_=16,
                  offsets=(shard.data_ptr(), kv.data_ptr(), kv.stride(0) * 2))  # fmt: skip


# ---- torch reference -------------------------------------------------------------------------
def store_owned_mla_fp8_torch(shard, slots, kv, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_mla_fp8(shard, slots, kv, rank, cp_size, page_size)
    rows = owned_physical_rows(slots, rank, cp_size, page_size)
    keep = rows >= 0
    shard[rows[keep]] = quantize_mla_fp8(kv[keep])
    return shard


# ---- Triton kernel ---------------------------------------------------------------------------
@jit
def _e4m3_bits_rne(q):
    """float32 -> float8_e4m3fn bits, rounding to nearest even as torch does, in integer
    arithmetic. Only for Triton's interpreter, whose fp32->fp8 cast mis-rounds (see tests)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits.
    normal = (mag + (-120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # Subnormal range (|q| < 2**-6): adding 2**14 rounds to the subnormal step 2**-9.
    denorm_bias = 141 << 23
    shifted = (tl.abs(q) + 16384.0).to(tl.int32, bitcast=True) - denorm_bias
    code = tl.where(mag < (121 << 23), shifted, normal)
    code = tl.where(mag >= (1087 << 20), 0x7F, code)  # |q| >= 480: NaN, as torch
    return (code | sign).to(tl.uint8)


@jit
def _div_rn_by_row(x, d):
    """x / d[:, None] rounded as an IEEE division would be, for bf16 values x, from one
    reciprocal per row: q = x * RN(1/d), then one fma correction. For every bf16 x and every
    scale d = amax * fp32(1/448) of a bf16 amax >= |x|, the fp8 code of q equals that of the
    exact division (all 1,065,402,240 pairs checked on an H200: test_kernels_gpu.py); x * RN(1/d)
    alone misses 11,086 of them. ~3 instructions per value instead of div.rn's ~10."""
    r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)[:, None]
    d = d[:, None]
    q = x * r
    q = tl.fma(tl.fma(-q, d, x), r, q)
    # The correction turns -0 into +0; the division keeps the sign of x.
    sign = (x.to(tl.uint32, bitcast=True) >> 31) << 31
    return (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@jit
def _store_mla_fp8_kernel(
    kv,
    kv_words,
    shard,
    shard_f32,
    shard_words,
    slots,
    n_rows,
    rank,
    KV_STRIDE: tl.constexpr,  # bf16 values between kv rows
    CP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDE: tl.constexpr,
    HW_CAST: tl.constexpr,  # compiled for a GPU (False under the interpreter)
    ROWS: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    NBLK: tl.constexpr = NOPE // QBLOCK
    ROW_WORDS: tl.constexpr = ROW_BYTES // 4
    pid, row, dst, keep = program_owned_rows(slots, n_rows, rank, CP_SIZE, PAGE_SIZE, WIDE, ROWS)
    # A gathered batch holds mostly other owners' rows: skip their quantization.
    if tl.max(keep.to(tl.int32), axis=0) > 0:
        # Rope: 64 bf16 values copied as 32 words.
        words = tl.arange(0, ROPE // 2)
        rope = tl.load(kv_words + (row * (KV_STRIDE // 2) + NOPE // 2)[:, None] + words[None, :], mask=keep[:, None])
        out = (dst * ROW_WORDS + (NOPE + 4 * NBLK) // 4)[:, None] + words[None, :]
        tl.store(shard_words + out, rope, mask=keep[:, None])

        # Nope: one tile row per (token, 128-value block). New names: a runtime `if` may not
        # change the shape of a variable defined before it.
        blocks = pid * (ROWS * NBLK) + tl.arange(0, ROWS * NBLK)
        brow = blocks // NBLK
        blk = blocks % NBLK
        bdst, bkeep = owned_rows(tl.load(slots + brow, mask=brow < n_rows, other=-1), rank, CP_SIZE, PAGE_SIZE)
        bdst = bdst.to(brow.dtype)
        cols = tl.arange(0, QBLOCK)
        x = tl.load(kv + (brow * KV_STRIDE + blk * QBLOCK)[:, None] + cols[None, :], mask=bkeep[:, None], other=0.0)
        x = x.to(tl.float32)
        # amax times the fp32 reciprocal of 448, as the reference; an exact division for the codes.
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) * (1.0 / FP8_MAX)
        if HW_CAST:
            code = _div_rn_by_row(x, scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            # The interpreter neither fuses fma nor rounds fp32->fp8 correctly.
            code = _e4m3_bits_rne(tl.math.div_rn(x, scale[:, None]))
        tl.store(shard + (bdst * ROW_BYTES + blk * QBLOCK)[:, None] + cols[None, :], code, mask=bkeep[:, None])
        tl.store(shard_f32 + bdst * ROW_WORDS + NOPE // 4 + blk, scale, mask=bkeep)


def store_owned_mla_fp8_triton(shard, slots, kv, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_mla_fp8(shard, slots, kv, rank, cp_size, page_size)
    require_triton()
    _check_kernel_layout(shard, kv)
    n = kv.shape[0]
    if n == 0:
        return shard
    rows = FP8_ROWS_PER_PROGRAM
    _store_mla_fp8_kernel[(triton.cdiv(n, rows),)](
        kv,
        kv.view(torch.int32),
        shard,
        shard.view(torch.float32),
        shard.view(torch.int32),
        slots,
        n,
        rank,
        KV_STRIDE=kv.stride(0),
        CP_SIZE=cp_size,
        PAGE_SIZE=page_size,
        WIDE=wide(kv, shard),
        HW_CAST=not triton.knobs.runtime.interpret,
        ROWS=rows,
        NOPE=MLA_NOPE_DIM,
        ROPE=MLA_ROPE_DIM,
        QBLOCK=MLA_FP8_BLOCK,
        ROW_BYTES=MLA_FP8_ROW_BYTES,
        FP8_MAX=FP8_MAX,
        num_warps=FP8_NUM_WARPS,
    )
    return shard


# ---- CUDA kernel -----------------------------------------------------------------------------
@functools.cache
def _cuda_module(major: int, minor: int) -> ModuleType:
    from torch.utils.cpp_extension import load

    arch = f"{major}{minor}"
    return load(
        name=f"sglang_nsa_cp_store_owned_mla_fp8_sm{arch}",
        sources=[CUDA_SOURCE],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        verbose=False,
    )


def build_cuda(device: torch.device) -> ModuleType:
    """The compiled CUDA kernel for `device` (built or loaded from the cache on first call).
    Raises what the build raises (CUDA_BUILD_ERRORS: no nvcc, no ninja, a compiler error)."""
    return _cuda_module(*torch.cuda.get_device_capability(device))


def store_owned_mla_fp8_cuda(shard, slots, kv, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_mla_fp8(shard, slots, kv, rank, cp_size, page_size)
    if kv.device.type != "cuda":
        raise ValueError(f"the CUDA fp8 store needs CUDA tensors, got {kv.device}")
    _check_kernel_layout(shard, kv)
    build_cuda(kv.device).store_owned_mla_fp8(shard, slots, kv, rank, cp_size, page_size)
    return shard
