"""Plain-torch references for every kernel: the semantics the Triton kernels must reproduce.

Conventions shared by all row operations:
- Tensors are 2-D (rows x row elements); any dtype, since rows are moved as they are.
- An index of -1 means "no row": that element is skipped (never read, never written).
- Ownership of a logical slot: page = slot // page_size, owner = page % cp_size, and the owner
  stores it at physical row (page // cp_size) * page_size + slot % page_size of its shard.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_FP8_BLOCK = 128
MLA_FP8_ROW_BYTES = MLA_NOPE_DIM + 4 * (MLA_NOPE_DIM // MLA_FP8_BLOCK) + 2 * MLA_ROPE_DIM  # 656
INDEX_HEAD_DIM = 128
INDEX_ROW_BYTES = INDEX_HEAD_DIM + 4  # fp8 key bytes + one fp32 scale, per token


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]] for every i with index[i] >= 0; other rows of `out` untouched."""
    keep = index >= 0
    out[keep] = src[index[keep]]
    return out


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = src[i] for every i with index[i] >= 0. Indices must be distinct."""
    keep = index >= 0
    dst[index[keep]] = src[keep]
    return dst


def owned_physical_rows(slots: torch.Tensor, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    """Physical shard row of each logical slot owned by `rank`; -1 for slots it does not own."""
    page = slots // page_size
    row = (page // cp_size) * page_size + slots % page_size
    return torch.where((page % cp_size == rank) & (slots >= 0), row, torch.full_like(row, -1))


def store_owned_rows(
    shard: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused store: write rows[i] to the shard row of slots[i] where `rank` owns that slot."""
    return scatter_rows(shard, owned_physical_rows(slots, rank, cp_size, page_size), rows)


def quantize_mla_fp8(kv: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 576] latent rows to FlashMLA's 656-byte fp8 rows (uint8 [T, 656]).

    Bytes 0..511: the 512 nope values as float8_e4m3fn, each 128-value block divided by its
    scale; bytes 512..527: the four fp32 scales (block amax * fp32(1/448)); bytes 528..655: the
    64 rope values as bf16.
    """
    t = kv.shape[0]
    nope = kv[:, :MLA_NOPE_DIM].float().view(t, MLA_NOPE_DIM // MLA_FP8_BLOCK, MLA_FP8_BLOCK)
    # Times the fp32 reciprocal, not "/ FP8_MAX": torch on CUDA divides by a Python scalar that
    # way and on CPU exactly, so a division would make the scales differ by device (1 ulp).
    scale = nope.abs().amax(dim=-1).clamp_min(1e-12) * (1.0 / FP8_MAX)
    q = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(t, MLA_NOPE_DIM)
    rope = kv[:, MLA_NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([q, scale.contiguous().view(torch.uint8), rope], dim=1)


def dequantize_mla_fp8(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_mla_fp8` up to fp8 rounding: uint8 [T, 656] to float32 [T, 576]."""
    t = rows.shape[0]
    q = rows[:, :MLA_NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    q = q.view(t, MLA_NOPE_DIM // MLA_FP8_BLOCK, MLA_FP8_BLOCK)
    scale = rows[:, MLA_NOPE_DIM : MLA_NOPE_DIM + 16].contiguous().view(torch.float32)
    rope = rows[:, MLA_NOPE_DIM + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scale[..., None]).view(t, MLA_NOPE_DIM), rope], dim=1)


def store_owned_mla_fp8(
    shard: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused quantize + store of bf16 latent rows into a uint8 [R, 656] shard."""
    return store_owned_rows(shard, slots, quantize_mla_fp8(kv), rank, cp_size, page_size)


def index_page_offsets(rows: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For physical rows of an index-K page buffer: (page, key byte offset, scale byte offset).

    A page holds page_size x 128 key bytes, then page_size fp32 scales (SGLang's index-K layout).
    """
    page = rows // page_size
    within = rows % page_size
    return page, within * INDEX_HEAD_DIM, page_size * INDEX_HEAD_DIM + within * 4


def store_owned_index_k(
    pages: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    cp_size: int,
    page_size: int,
) -> torch.Tensor:
    """Write fp8 index keys (uint8 [T, 128]) and fp32 scales ([T]) of owned slots into
    `pages` (uint8 [local_pages, page_size * 132])."""
    rows = owned_physical_rows(slots, rank, cp_size, page_size)
    keep = rows >= 0
    page, key_off, scale_off = index_page_offsets(rows[keep], page_size)
    cols = torch.arange(INDEX_HEAD_DIM, device=pages.device)
    pages[page[:, None], key_off[:, None] + cols] = key[keep]
    scale_bytes = scale[keep].float().contiguous().view(torch.uint8).view(-1, 4)
    pages[page[:, None], scale_off[:, None] + torch.arange(4, device=pages.device)] = scale_bytes
    return pages


def read_index_k(pages: torch.Tensor, rows: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (uint8 [T, 128]) and scales (float32 [T]) at physical rows of an index-K page buffer."""
    page, key_off, scale_off = index_page_offsets(rows, page_size)
    key = pages[page[:, None], key_off[:, None] + torch.arange(INDEX_HEAD_DIM, device=pages.device)]
    scale = pages[page[:, None], scale_off[:, None] + torch.arange(4, device=pages.device)]
    return key, scale.contiguous().view(torch.float32).view(-1)
