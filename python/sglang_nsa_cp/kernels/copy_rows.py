"""Row copies: `gather_rows`, `scatter_rows` and the fused `store_owned_rows`, one Triton kernel
(`_copy_rows_kernel`), its launcher per op (`<op>_triton`) and the torch reference (`<op>_torch`).
The public functions, with the full contracts, are in `kernels/__init__.py`.

Rows move as raw bytes. A row copy views both tensors as the widest words their row bytes,
row strides and base addresses allow (32-bit words in every layout we use) and groups them into
vectors of up to 16 bytes. Each program takes BLOCK consecutive vectors of the flattened
(rows x vectors-per-row) space, so rows of any width (1152-byte bf16 latent rows, 656-byte
FlashMLA fp8 rows, 132-byte index rows, whole 64-token pages) fill every lane with no padding
to a power of two. Row widths and strides are compile-time constants, so the compiler proves
16-byte alignment and emits 128-bit accesses (132-byte rows are only 4-byte aligned: 4-byte
accesses). Each vector looks its row up in the index itself (an L1 hit): no launch depends on a
host read. The fused store maps logical slots to shard rows in the kernel and skips, per
program, blocks that hold no slot of this rank.

Indices must be in range (not checked: an out-of-range index reads or writes out of bounds).
Offsets are int32 when every tensor has fewer than 2**31 words, else int64.
"""

from __future__ import annotations

import torch

from sglang_nsa_cp.kernels.checks import (
    check_contiguous_rows,
    check_index,
    check_owner_args,
    check_rows,
    check_same,
)
from sglang_nsa_cp.kernels.formats import owned_physical_rows
from sglang_nsa_cp.kernels.triton_common import jit, owned_rows, require_triton, tl, triton, wide

# Launch shapes, read at each launch (the benchmark's --sweep sets them); the values are the
# best of benchmark/bench_kernels.py --sweep on an H200 (docs/kernels.md).
COPY_BYTES_PER_PROGRAM = 4096
STORE_BYTES_PER_PROGRAM = 8192  # fused store: fewer, larger programs skip other owners' rows cheaper
COPY_NUM_WARPS = 4
COPY_VECTORS_PER_THREAD = 4  # caps rows of 4-byte words: their loads need more registers per byte

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


# ---- checks ----------------------------------------------------------------------------------
def check_gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    check_rows("src", src)
    check_rows("out", out)
    check_same("src", src, "out", out)
    check_index("index", index, out.shape[0], out.device)


def check_scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    check_rows("dst", dst)
    check_rows("src", src)
    check_same("src", src, "dst", dst)
    check_index("index", index, src.shape[0], src.device)


def check_store_owned_rows(shard, slots, rows, rank, cp_size, page_size) -> None:
    check_rows("shard", shard)
    check_rows("rows", rows)
    check_same("rows", rows, "shard", shard)
    check_index("slots", slots, rows.shape[0], rows.device)
    check_owner_args(cp_size, page_size, rank)


# ---- torch references ------------------------------------------------------------------------
def gather_rows_torch(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    check_gather_rows(src, index, out)
    keep = index >= 0
    out[keep] = src[index[keep]]
    return out


def scatter_rows_torch(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    check_scatter_rows(dst, index, src)
    keep = index >= 0
    dst[index[keep]] = src[keep]
    return dst


def store_owned_rows_torch(shard, slots, rows, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_rows(shard, slots, rows, rank, cp_size, page_size)
    return scatter_rows_torch(shard, owned_physical_rows(slots, rank, cp_size, page_size), rows)


# ---- Triton kernel ---------------------------------------------------------------------------
@jit
def _row_index(
    index, row, n_rows, rank, OWNED: tl.constexpr, CP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr
):
    """The index entry of each row (mapped to a shard row when OWNED), whether to move it, and
    the row itself, in the offset type."""
    live = row < n_rows
    idx = tl.load(index + row, mask=live, other=-1)
    if OWNED:
        idx, keep = owned_rows(idx, rank, CP_SIZE, PAGE_SIZE)
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


@jit
def _move(src, dst, src_base, dst_base, cols, mask):
    """dst[dst_base[r] + cols[c]] = src[src_base[r] + cols[c]] where mask[r, c]."""
    values = tl.load(src + src_base[:, None] + cols[None, :], mask=mask)
    tl.store(dst + dst_base[:, None] + cols[None, :], values, mask=mask)


@jit
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


def _copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    index: torch.Tensor,
    *,
    index_dst: bool,
    owned: tuple[int, int, int] | None = None,
) -> None:
    """One row-copy launch; `owned` is (rank, cp_size, page_size) for the fused store."""
    require_triton()
    check_contiguous_rows("src", src)
    check_contiguous_rows("dst", dst)
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
        WIDE=wide(src_w, dst_w),
    )
    block_bytes = STORE_BYTES_PER_PROGRAM if owned is not None else COPY_BYTES_PER_PROGRAM
    block = max(min(block_bytes // unit, COPY_VECTORS_PER_THREAD * 32 * COPY_NUM_WARPS), 1)
    grid = (triton.cdiv(n * (width // vec), block),)
    _copy_rows_kernel[grid](src_w, dst_w, index, n, rank, VEC=vec, BLOCK=block, num_warps=COPY_NUM_WARPS, **common)


def gather_rows_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    check_gather_rows(src, index, out)
    _copy_rows(src, out, index, index_dst=False)
    return out


def scatter_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    check_scatter_rows(dst, index, src)
    _copy_rows(src, dst, index, index_dst=True)
    return dst


def store_owned_rows_triton(shard, slots, rows, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_rows(shard, slots, rows, rank, cp_size, page_size)
    _copy_rows(rows, shard, slots, index_dst=True, owned=(rank, cp_size, page_size))
    return shard
