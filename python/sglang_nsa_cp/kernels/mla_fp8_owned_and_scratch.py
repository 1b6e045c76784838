"""The fused fp8 store of SGLang's page-interleaved DSA pool (`store_mla_fp8_owned_and_scratch`):
its Triton kernel and launcher (`_triton`), the torch reference (`_torch`) and the input check
both run. The public function, with the full contract, is in `kernels/__init__.py`.

SGLang's `PageInterleaveDSATokenToKVPool.set_mla_kv_buffer` quantizes each chunk twice with
`quantize_k_cache_separate`: once to stage every row into the layer's scratch, once for the rows
this rank owns. This op quantizes once and writes both, in one pass, with no host sync:

    N = 2, page_size = 2, slots = [4 5 6 7 2]  (pages 2 2 3 3 1; owners 0 0 1 1 1)
    scratch[scratch_rows[i]] = row_i                for every i   (scratch_rows[i] >= 0)
    rank 0: shard[(slot // 4) * 2 + slot % 2]       for i = 0, 1  -> shard rows 2, 3
    rank 1: the same rows of its own shard          for i = 2, 3, 4 -> shard rows 2, 3, 0

Rounding is SGLang's: scale = amax / 448 (not amax x fp32(1/448)), codes =
clamp(x * (1 / scale), -448, 448) cast to e4m3 (an all-zero block: scale 0, its codes the cast of
clamp(NaN)). The kernel spells the quantization with the very Triton operations of SGLang's
`_quantize_k_cache_fast_kernel`, so each compiles to the same instructions: on a GPU Triton's
approximate fp32 division (`div.full.f32`) and hardware e4m3 conversion, under the interpreter
numpy's division and the interpreter's cast. Equal bytes come from equal operations, on either.
The reference calls `quantize_k_cache_separate` itself, where SGLang's DSA pools look it up
(`mem_cache.memory_pool`), so it needs what SGLang's quantizer needs: a GPU, or TRITON_INTERPRET=1
(CPU tests).
"""

from __future__ import annotations

import torch

from sglang_nsa_cp.kernels.checks import KernelUnsupported, check_aligned, check_index, check_owner_args
from sglang_nsa_cp.kernels.formats import (
    MLA_FP8_BLOCK,
    MLA_FP8_ROW_BYTES,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
    owned_physical_rows,
)
from sglang_nsa_cp.kernels.triton_common import jit, owned_rows, require_triton, tl, triton, wide

FP8_ROWS_PER_PROGRAM = 4  # launch shape: docs/kernels.md (4 rows beat 8, 16 and 32 at CP 2 on an H200)
FP8_NUM_WARPS = 4


def _as_rows(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] or [T, 1, width] bf16 -> a [T, width] view."""
    if t.dim() == 3 and t.shape[1] == 1:
        t = t.squeeze(1)
    if t.dim() != 2 or t.shape[1] != width or t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bf16 [T, {width}] or [T, 1, {width}], got {t.dtype} {tuple(t.shape)}")
    return t


def check_store_mla_fp8_owned_and_scratch(
    scratch, scratch_rows, shard, slots, k_nope, k_rope, rank: int, cp_size: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Named checks; returns k_nope and k_rope as [T, 512] and [T, 64] views."""
    k_nope = _as_rows("k_nope", k_nope, MLA_NOPE_DIM)
    k_rope = _as_rows("k_rope", k_rope, MLA_ROPE_DIM)
    tokens = k_nope.shape[0]
    if k_rope.shape[0] != tokens:
        raise ValueError(f"k_nope has {tokens} tokens but k_rope has {k_rope.shape[0]}")
    for name, dst in (("scratch", scratch), ("shard", shard)):
        if dst.dim() != 2 or dst.dtype != torch.uint8 or dst.shape[1] != MLA_FP8_ROW_BYTES:
            raise TypeError(f"{name} must be uint8 [R, {MLA_FP8_ROW_BYTES}], got {dst.dtype} {tuple(dst.shape)}")
        if dst.device != k_nope.device:
            raise ValueError(f"k_nope is on {k_nope.device} but {name} is on {dst.device}")
    if k_rope.device != k_nope.device:
        raise ValueError(f"k_nope is on {k_nope.device} but k_rope is on {k_rope.device}")
    check_index("scratch_rows", scratch_rows, tokens, k_nope.device)
    check_index("slots", slots, tokens, k_nope.device)
    check_owner_args(cp_size, page_size, rank)
    return k_nope, k_rope


def _check_kernel_layout(scratch: torch.Tensor, shard: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor):
    """Contiguous destinations, unit-stride source rows; 4-byte aligned destinations and rope
    rows (the rope and the scales move as 32-bit words)."""
    for name, dst in (("scratch", scratch), ("shard", shard)):
        if not dst.is_contiguous():
            raise KernelUnsupported(
                f"store_mla_fp8_owned_and_scratch's kernel needs a contiguous {name}, got strides {dst.stride()}"
            )
    for name, src in (("k_nope", k_nope), ("k_rope", k_rope)):
        if src.stride(1) != 1:
            raise KernelUnsupported(f"{name} needs contiguous rows (stride(1) == 1), got strides {src.stride()}")
    check_aligned("store_mla_fp8_owned_and_scratch", "4-byte aligned destinations and rope rows", bytes_=4,
                  offsets=(scratch.data_ptr(), shard.data_ptr(), k_rope.data_ptr(), k_rope.stride(0) * 2))  # fmt: skip


# ---- torch reference -------------------------------------------------------------------------
def store_mla_fp8_owned_and_scratch_torch(
    scratch, scratch_rows, shard, slots, k_nope, k_rope, rank: int, cp_size: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.mem_cache import memory_pool  # the quantizer as SGLang's DSA pools look it up

    k_nope, k_rope = check_store_mla_fp8_owned_and_scratch(
        scratch, scratch_rows, shard, slots, k_nope, k_rope, rank, cp_size, page_size
    )
    nope, rope = memory_pool.quantize_k_cache_separate(k_nope, k_rope)
    rows = torch.cat([nope.squeeze(1), rope.squeeze(1)], dim=1)
    staged = scratch_rows >= 0
    scratch[scratch_rows[staged].long()] = rows[staged]
    local = owned_physical_rows(slots.long(), rank, cp_size, page_size)
    owned = local >= 0
    shard[local[owned]] = rows[owned]
    return scratch, shard


# ---- Triton kernel ---------------------------------------------------------------------------
@jit
def _store_kernel(
    k_nope,
    k_rope_words,
    scratch,
    scratch_f32,
    scratch_words,
    shard,
    shard_f32,
    shard_words,
    scratch_rows,
    slots,
    n_rows,
    rank,
    NOPE_STRIDE: tl.constexpr,  # bf16 values between k_nope rows
    ROPE_STRIDE: tl.constexpr,  # 32-bit words between k_rope rows
    CP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDE: tl.constexpr,
    ROWS: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    FP8_MIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    NBLK: tl.constexpr = NOPE // QBLOCK
    ROW_WORDS: tl.constexpr = ROW_BYTES // 4
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)

    # Rope: 64 bf16 values copied as 32 words to both destinations.
    row = pid * ROWS + tl.arange(0, ROWS)
    in_batch = row < n_rows
    srow = tl.load(scratch_rows + row, mask=in_batch, other=-1).to(row.dtype)
    drow, owned = owned_rows(tl.load(slots + row, mask=in_batch, other=-1), rank, CP_SIZE, PAGE_SIZE)
    drow = drow.to(row.dtype)
    staged = srow >= 0
    words = tl.arange(0, ROPE // 2)
    rope = tl.load(k_rope_words + (row * ROPE_STRIDE)[:, None] + words[None, :], mask=in_batch[:, None])
    rope_at = (NOPE + 4 * NBLK) // 4 + words[None, :]
    tl.store(scratch_words + (srow * ROW_WORDS)[:, None] + rope_at, rope, mask=staged[:, None])
    tl.store(shard_words + (drow * ROW_WORDS)[:, None] + rope_at, rope, mask=owned[:, None])

    # Nope: one tile row per (token, 128-value block).
    blocks = pid * (ROWS * NBLK) + tl.arange(0, ROWS * NBLK)
    brow = blocks // NBLK
    blk = blocks % NBLK
    b_in = brow < n_rows
    bsrow = tl.load(scratch_rows + brow, mask=b_in, other=-1).to(brow.dtype)
    bdrow, bowned = owned_rows(tl.load(slots + brow, mask=b_in, other=-1), rank, CP_SIZE, PAGE_SIZE)
    bdrow = bdrow.to(brow.dtype)
    bstaged = bsrow >= 0
    cols = tl.arange(0, QBLOCK)
    y = tl.load(k_nope + (brow * NOPE_STRIDE + blk * QBLOCK)[:, None] + cols[None, :], mask=b_in[:, None], other=0.0)
    y = y.to(tl.float32)
    # SGLang's `_quantize_k_cache_fast_kernel`, operation for operation (no eps, no fma): the
    # same instructions give the same bytes, amax == 0 (scale 0, codes of clamp(NaN)) included.
    y_s = tl.max(tl.abs(y), axis=1) / FP8_MAX
    y_s_inv = 1.0 / y_s
    y_q = tl.clamp(y * y_s_inv[:, None], FP8_MIN, FP8_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    code_at = blk * QBLOCK
    tl.store(scratch + (bsrow * ROW_BYTES + code_at)[:, None] + cols[None, :], y_q, mask=bstaged[:, None])
    tl.store(shard + (bdrow * ROW_BYTES + code_at)[:, None] + cols[None, :], y_q, mask=bowned[:, None])
    tl.store(scratch_f32 + bsrow * ROW_WORDS + NOPE // 4 + blk, y_s, mask=bstaged)
    tl.store(shard_f32 + bdrow * ROW_WORDS + NOPE // 4 + blk, y_s, mask=bowned)


def store_mla_fp8_owned_and_scratch_triton(
    scratch, scratch_rows, shard, slots, k_nope, k_rope, rank: int, cp_size: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k_nope, k_rope = check_store_mla_fp8_owned_and_scratch(
        scratch, scratch_rows, shard, slots, k_nope, k_rope, rank, cp_size, page_size
    )
    require_triton()
    _check_kernel_layout(scratch, shard, k_nope, k_rope)
    n = k_nope.shape[0]
    if n == 0:
        return scratch, shard
    rows = FP8_ROWS_PER_PROGRAM
    fp8 = torch.finfo(torch.float8_e4m3fn)  # SGLang passes these two constants
    _store_kernel[(triton.cdiv(n, rows),)](
        k_nope,
        k_rope.view(torch.int32),
        scratch,
        scratch.view(torch.float32),
        scratch.view(torch.int32),
        shard,
        shard.view(torch.float32),
        shard.view(torch.int32),
        scratch_rows,
        slots,
        n,
        rank,
        NOPE_STRIDE=k_nope.stride(0),
        ROPE_STRIDE=k_rope.stride(0) // 2,
        CP_SIZE=cp_size,
        PAGE_SIZE=page_size,
        WIDE=wide(k_nope, scratch, shard),
        ROWS=rows,
        NOPE=MLA_NOPE_DIM,
        ROPE=MLA_ROPE_DIM,
        QBLOCK=MLA_FP8_BLOCK,
        ROW_BYTES=MLA_FP8_ROW_BYTES,
        FP8_MIN=fp8.min,
        FP8_MAX=fp8.max,
        num_warps=FP8_NUM_WARPS,
    )
    return scratch, shard
