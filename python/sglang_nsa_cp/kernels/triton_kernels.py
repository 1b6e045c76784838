"""Triton kernels for the shared-KV store, materialize and rerange (the original design's
tai-kernel fused store and materialize), each with the signature of its reference in
`reference.py`. Measured on an H200 in docs/kernels.md.

Rows move as raw bytes. A row copy views both tensors as the widest words their row bytes,
row strides and base addresses allow (32-bit words in every layout we use) and groups them into
vectors of up to 16 bytes. Each program takes BLOCK consecutive vectors of the flattened
(rows x vectors-per-row) space, so rows of any width (1152-byte bf16 latent rows, 656-byte
FlashMLA fp8 rows, 132-byte index rows, whole 64-token pages) fill every lane with no padding
to a power of two. Row widths and strides are compile-time constants, so the compiler proves
16-byte alignment and emits 128-bit accesses (132-byte rows are only 4-byte aligned: 4-byte
accesses). Each vector looks its row up in the index itself (an L1 hit): no launch depends on a
host read. The fused stores map logical slots to shard rows in the kernel and skip, per
program, blocks that hold no slot of this rank.

The fp8 store quantizes in registers: amax per 128 values, scale = amax * fp32(1/448), codes
= RN(x / scale) through the hardware e4m3 conversion, bitwise equal to torch. Under Triton's
interpreter (CPU tests) the division is div_rn and the e4m3 rounding is done in integers,
because the interpreter neither fuses fma nor rounds fp32 -> fp8 correctly.

Index tensors are int32 or int64 on the tensors' device; a negative index skips its row.
Indices must be in range (not checked: an out-of-range index reads or writes out of bounds).
Offsets are int32 when every tensor has fewer than 2**31 words, else int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_nsa_cp.kernels.checks import check_index, check_mla_fp8_store, check_owner_args, check_rows, check_same
from sglang_nsa_cp.kernels.reference import (
    FP8_MAX,
    INDEX_HEAD_DIM,
    MLA_FP8_BLOCK,
    MLA_FP8_ROW_BYTES,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
)

# Launch shapes, read at each launch (the benchmark's --sweep sets them); the values are the
# best of benchmark/bench_kernels.py --sweep on an H200 (docs/kernels.md).
COPY_BYTES_PER_PROGRAM = 4096
STORE_BYTES_PER_PROGRAM = 8192  # fused store: fewer, larger programs skip other owners' rows cheaper
COPY_NUM_WARPS = 4
COPY_VECTORS_PER_THREAD = 4  # caps rows of 4-byte words: their loads need more registers per byte
FP8_ROWS_PER_PROGRAM = 8
FP8_NUM_WARPS = 4
INDEX_ROWS_PER_PROGRAM = 64
INDEX_NUM_WARPS = 4

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
_INT32_LIMIT = 2**31


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _owned_rows(slot, rank, CP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Shard row of each logical slot and whether `rank` owns it (reference.owned_physical_rows)."""
    page = slot // PAGE_SIZE
    owned = (slot >= 0) & (page % CP_SIZE == rank)
    return (page // CP_SIZE) * PAGE_SIZE + slot % PAGE_SIZE, owned


@triton.jit
def _row_index(
    index, row, n_rows, rank, OWNED: tl.constexpr, CP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr
):
    """The index entry of each row (mapped to a shard row when OWNED), whether to move it, and
    the row itself, in the offset type."""
    live = row < n_rows
    idx = tl.load(index + row, mask=live, other=-1)
    if OWNED:
        idx, keep = _owned_rows(idx, rank, CP_SIZE, PAGE_SIZE)
        keep = keep & live
    else:
        keep = live & (idx >= 0)
    if WIDE:
        idx = idx.to(tl.int64)
        row = row.to(tl.int64)
    else:
        idx = idx.to(tl.int32)
        row = row.to(tl.int32)
    return idx, keep, row


@triton.jit
def _move(src, dst, src_base, dst_base, cols, mask):
    """dst[dst_base[r] + cols[c]] = src[src_base[r] + cols[c]] where mask[r, c]."""
    values = tl.load(src + src_base[:, None] + cols[None, :], mask=mask)
    tl.store(dst + dst_base[:, None] + cols[None, :], values, mask=mask)


@triton.jit
def _copy_rows_kernel(
    src,
    dst,
    index,
    n_rows,
    rank,
    WIDTH: tl.constexpr,  # words per row
    SRC_STRIDE: tl.constexpr,  # words between rows of src
    DST_STRIDE: tl.constexpr,
    VEC: tl.constexpr,  # words per vector
    INDEX_DST: tl.constexpr,  # False: dst[i] = src[index[i]]; True: dst[index[i]] = src[i]
    OWNED: tl.constexpr,  # index holds logical slots: map to shard rows, skip other owners' slots
    CP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDE: tl.constexpr,  # int64 offsets
    BLOCK: tl.constexpr,  # vectors per program
):
    VECS: tl.constexpr = WIDTH // VEC
    start = tl.program_id(0).to(tl.int64) * BLOCK
    first_row = start // VECS
    # Offsets inside the block stay int32: the division by the constant VECS is then cheap.
    local = (start - first_row * VECS).to(tl.int32) + tl.arange(0, BLOCK)
    row_in_block = local // VECS
    col = (local - row_in_block * VECS) * VEC
    idx, keep, row = _row_index(index, first_row + row_in_block, n_rows, rank, OWNED, CP_SIZE, PAGE_SIZE, WIDE)
    if INDEX_DST:
        src_base = row * SRC_STRIDE + col
        dst_base = idx * DST_STRIDE + col
    else:
        src_base = idx * SRC_STRIDE + col
        dst_base = row * DST_STRIDE + col
    words = tl.arange(0, VEC)
    if OWNED:
        # Most blocks of a gathered batch belong to other owners: skip their masked accesses.
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            _move(src, dst, src_base, dst_base, words, keep[:, None])
    else:
        _move(src, dst, src_base, dst_base, words, keep[:, None])


@triton.jit
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


@triton.jit
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


@triton.jit
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
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    row = pid * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots + row, mask=row < n_rows, other=-1)
    dst, keep = _owned_rows(slot, rank, CP_SIZE, PAGE_SIZE)
    dst = dst.to(row.dtype)
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
        bdst, bkeep = _owned_rows(tl.load(slots + brow, mask=brow < n_rows, other=-1), rank, CP_SIZE, PAGE_SIZE)
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


@triton.jit
def _store_index_k_kernel(
    key_words,
    scale_words,
    page_words,
    slots,
    n_rows,
    rank,
    KEY_STRIDE: tl.constexpr,  # words between key rows
    CP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDE: tl.constexpr,
    ROWS: tl.constexpr,
    KEY_WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    row = pid * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots + row, mask=row < n_rows, other=-1)
    dst, keep = _owned_rows(slot, rank, CP_SIZE, PAGE_SIZE)
    dst = dst.to(row.dtype)
    if tl.max(keep.to(tl.int32), axis=0) > 0:
        # A page holds PAGE_SIZE keys, then PAGE_SIZE fp32 scales (SGLang's index-K layout).
        page_base = (dst // PAGE_SIZE) * (PAGE_SIZE * (KEY_WORDS + 1))
        within = dst % PAGE_SIZE
        words = tl.arange(0, KEY_WORDS)
        key = tl.load(key_words + (row * KEY_STRIDE)[:, None] + words[None, :], mask=keep[:, None])
        tl.store(page_words + (page_base + within * KEY_WORDS)[:, None] + words[None, :], key, mask=keep[:, None])
        scale = tl.load(scale_words + row, mask=keep)
        tl.store(page_words + page_base + PAGE_SIZE * KEY_WORDS + within, scale, mask=keep)


# ---- launchers -------------------------------------------------------------------------------
def _vector_bytes(*tensors: torch.Tensor) -> int:
    """Largest power of two <= 16 that divides every row size, row stride and base address."""
    unit = 16
    for t in tensors:
        size = t.element_size()
        for n in (t.shape[1] * size, t.stride(0) * size if t.shape[0] > 1 else 0, t.data_ptr()):
            while n % unit:
                unit //= 2
    return unit


def _as_words(t: torch.Tensor, word: int) -> torch.Tensor:
    return t.view(torch.uint8).view(_WORD_DTYPES[word])


def _wide(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into one of these 2-D tensors can reach 2**31."""
    return any(t.shape[0] * max(t.stride(0), t.shape[1]) >= _INT32_LIMIT for t in tensors)


def _copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    index: torch.Tensor,
    *,
    index_dst: bool,
    owned: tuple[int, int, int] | None = None,
) -> None:
    """One row-copy launch; `owned` is (rank, cp_size, page_size) for the fused store."""
    n = index.numel()
    if n == 0 or src.shape[1] == 0:
        return
    unit = _vector_bytes(src, dst)
    word = min(unit, 4)
    src_w, dst_w = _as_words(src, word), _as_words(dst, word)
    vec = unit // word
    rank, cp_size, page_size = owned if owned is not None else (0, 1, 1)
    width = src_w.shape[1]
    common = dict(
        WIDTH=width,
        SRC_STRIDE=src_w.stride(0),
        DST_STRIDE=dst_w.stride(0),
        INDEX_DST=index_dst,
        OWNED=owned is not None,
        CP_SIZE=cp_size,
        PAGE_SIZE=page_size,
        WIDE=_wide(src_w, dst_w),
    )
    block_bytes = STORE_BYTES_PER_PROGRAM if owned is not None else COPY_BYTES_PER_PROGRAM
    block = max(min(block_bytes // unit, COPY_VECTORS_PER_THREAD * 32 * COPY_NUM_WARPS), 1)
    grid = (triton.cdiv(n * (width // vec), block),)
    _copy_rows_kernel[grid](src_w, dst_w, index, n, rank, VEC=vec, BLOCK=block, num_warps=COPY_NUM_WARPS, **common)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]] for every i with index[i] >= 0; other rows of `out` untouched.

    src [S, W] and out [N, W] of one dtype (rows are copied as bytes); index [N] int32/int64.
    """
    check_rows("src", src)
    check_rows("out", out)
    check_same("src", src, "out", out)
    check_index("index", index, out.shape[0], out.device)
    _copy_rows(src, out, index, index_dst=False)
    return out


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = src[i] for every i with index[i] >= 0. Indices must be distinct.

    dst [D, W] and src [N, W] of one dtype; index [N] int32/int64.
    """
    check_rows("dst", dst)
    check_rows("src", src)
    check_same("src", src, "dst", dst)
    check_index("index", index, src.shape[0], src.device)
    _copy_rows(src, dst, index, index_dst=True)
    return dst


def store_owned_rows(
    shard: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused store: write rows[i] to the shard row of slots[i] where `rank` owns that slot.

    shard [R, W] and rows [T, W] of one dtype; slots [T] int32/int64 logical slots (-1: none).
    Owner of a slot: (slot // page_size) % cp_size; see reference.owned_physical_rows.
    """
    check_rows("shard", shard)
    check_rows("rows", rows)
    check_same("rows", rows, "shard", shard)
    check_index("slots", slots, rows.shape[0], rows.device)
    check_owner_args(cp_size, page_size, rank)
    _copy_rows(rows, shard, slots, index_dst=True, owned=(rank, cp_size, page_size))
    return shard


def store_owned_mla_fp8(
    shard: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused quantize + store of owned bf16 latent rows into FlashMLA's 656-byte fp8 rows.

    kv [T, 576] bf16; shard [R, 656] uint8; slots [T] int32/int64. Each row: 512 nope values
    as float8_e4m3fn, one fp32 scale (amax * fp32(1/448)) per 128 values, then the 64 rope
    values as bf16 bytes (reference.quantize_mla_fp8), bitwise equal to the reference.
    """
    check_mla_fp8_store(shard, slots, kv, rank, cp_size, page_size)
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
        WIDE=_wide(kv, shard),
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


def store_owned_index_k(
    pages: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    cp_size: int,
    page_size: int,
) -> torch.Tensor:
    """Write fp8 index keys and fp32 scales of owned slots into SGLang's index-K pages.

    pages uint8 [local_pages, page_size * 132]: per page, page_size x 128 key bytes, then
    page_size fp32 scales. key uint8 [T, 128]; scale [T] (stored as fp32); slots [T].
    """
    check_rows("pages", pages)
    check_rows("key", key)
    if pages.dtype != torch.uint8 or pages.shape[1] != page_size * (INDEX_HEAD_DIM + 4):
        raise TypeError(
            f"pages must be uint8 [P, {page_size * (INDEX_HEAD_DIM + 4)}], got {pages.dtype} {tuple(pages.shape)}"
        )
    if key.dtype != torch.uint8 or key.shape[1] != INDEX_HEAD_DIM:
        raise TypeError(f"key must be uint8 [T, {INDEX_HEAD_DIM}], got {key.dtype} {tuple(key.shape)}")
    if scale.shape != (key.shape[0],) or not scale.is_floating_point():
        raise TypeError(
            f"scale must be a float tensor of shape ({key.shape[0]},), got {scale.dtype} {tuple(scale.shape)}"
        )
    if pages.stride(0) != pages.shape[1] or pages.data_ptr() % 4 or key.stride(0) % 4 or key.data_ptr() % 4:
        raise ValueError("store_owned_index_k needs contiguous 4-byte aligned pages and 4-byte aligned key rows")
    if not pages.device == key.device == scale.device:
        raise ValueError(f"pages, key and scale are on {pages.device}, {key.device}, {scale.device}")
    check_index("slots", slots, key.shape[0], key.device)
    check_owner_args(cp_size, page_size, rank)
    n = key.shape[0]
    if n == 0:
        return pages
    scale = scale.to(torch.float32).contiguous()
    rows = INDEX_ROWS_PER_PROGRAM
    _store_index_k_kernel[(triton.cdiv(n, rows),)](
        key.view(torch.int32),
        scale.view(torch.int32),
        pages.view(torch.int32),
        slots,
        n,
        rank,
        KEY_STRIDE=key.stride(0) // 4,
        CP_SIZE=cp_size,
        PAGE_SIZE=page_size,
        WIDE=_wide(key, pages),
        ROWS=rows,
        KEY_WORDS=INDEX_HEAD_DIM // 4,
        num_warps=INDEX_NUM_WARPS,
    )
    return pages
