"""The store of owned fp8 index keys and their scales into SGLang's index-K pages
(`store_owned_index_k`): its Triton kernel and launcher (`_triton`), the torch reference
(`_torch`) and the input check both share. The public function, with the full contract, is in
`kernels/__init__.py`; the page layout is in `formats.py`.
"""

from __future__ import annotations

import torch

from sglang_nsa_cp.kernels import checks
from sglang_nsa_cp.kernels.formats import INDEX_HEAD_DIM, INDEX_ROW_BYTES, index_page_offsets, owned_physical_rows
from sglang_nsa_cp.kernels.triton_common import jit, program_owned_rows, require_triton, tl, triton, wide

INDEX_ROWS_PER_PROGRAM = 64  # launch shape (bench_kernels.py --sweep sets it)
INDEX_NUM_WARPS = 4


def check_store_owned_index_k(pages, slots, key, scale, rank: int, cp_size: int, page_size: int) -> None:
    """uint8 [P, page_size * 132] pages, uint8 [T, 128] key, float [T] scale, one device, slots [T]."""
    checks.check_rows("pages", pages)
    checks.check_rows("key", key)
    checks.check_owner_args(cp_size, page_size, rank)
    if pages.dtype != torch.uint8 or pages.shape[1] != page_size * INDEX_ROW_BYTES:
        raise TypeError(
            f"pages must be uint8 [P, {page_size * INDEX_ROW_BYTES}], got {pages.dtype} {tuple(pages.shape)}"
        )
    if key.dtype != torch.uint8 or key.shape[1] != INDEX_HEAD_DIM:
        raise TypeError(f"key must be uint8 [T, {INDEX_HEAD_DIM}], got {key.dtype} {tuple(key.shape)}")
    if scale.shape != (key.shape[0],) or not scale.is_floating_point():
        raise TypeError(
            f"scale must be a float tensor of shape ({key.shape[0]},), got {scale.dtype} {tuple(scale.shape)}"
        )
    if not pages.device == key.device == scale.device:
        raise ValueError(f"pages, key and scale are on {pages.device}, {key.device}, {scale.device}")
    checks.check_index("slots", slots, key.shape[0], key.device)


# ---- torch reference -------------------------------------------------------------------------
def store_owned_index_k_torch(pages, slots, key, scale, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_index_k(pages, slots, key, scale, rank, cp_size, page_size)
    rows = owned_physical_rows(slots, rank, cp_size, page_size)
    keep = rows >= 0
    page, key_off, scale_off = index_page_offsets(rows[keep], page_size)
    cols = torch.arange(INDEX_HEAD_DIM, device=pages.device)
    pages[page[:, None], key_off[:, None] + cols] = key[keep]
    scale_bytes = scale[keep].float().contiguous().view(torch.uint8).view(-1, 4)
    pages[page[:, None], scale_off[:, None] + torch.arange(4, device=pages.device)] = scale_bytes
    return pages


# ---- Triton kernel ---------------------------------------------------------------------------
@jit
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
    pid, row, dst, keep = program_owned_rows(slots, n_rows, rank, CP_SIZE, PAGE_SIZE, WIDE, ROWS)
    if tl.max(keep.to(tl.int32), axis=0) > 0:
        # A page holds PAGE_SIZE keys, then PAGE_SIZE fp32 scales (SGLang's index-K layout).
        page_base = (dst // PAGE_SIZE) * (PAGE_SIZE * (KEY_WORDS + 1))
        within = dst % PAGE_SIZE
        words = tl.arange(0, KEY_WORDS)
        key = tl.load(key_words + (row * KEY_STRIDE)[:, None] + words[None, :], mask=keep[:, None])
        tl.store(page_words + (page_base + within * KEY_WORDS)[:, None] + words[None, :], key, mask=keep[:, None])
        scale = tl.load(scale_words + row, mask=keep)
        tl.store(page_words + page_base + PAGE_SIZE * KEY_WORDS + within, scale, mask=keep)


def store_owned_index_k_triton(pages, slots, key, scale, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    check_store_owned_index_k(pages, slots, key, scale, rank, cp_size, page_size)
    require_triton()
    checks.check_contiguous_rows("key", key)
    if pages.stride(0) != pages.shape[1]:
        raise checks.KernelUnsupported(
            f"store_owned_index_k's kernel needs contiguous pages, got strides {pages.stride()}"
        )
    checks.check_aligned("store_owned_index_k", "4-byte aligned pages and key rows", bytes_=4,
                  offsets=(pages.data_ptr(), key.data_ptr(), key.stride(0)))  # fmt: skip
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
        WIDE=wide(key, pages),
        ROWS=rows,
        KEY_WORDS=INDEX_HEAD_DIM // 4,
        num_warps=INDEX_NUM_WARPS,
    )
    return pages
