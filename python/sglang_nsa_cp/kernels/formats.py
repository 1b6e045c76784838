"""Row formats of the shared-KV path and their constants, defined here once.

- MLA latent, bf16: [T, 576] = 512 nope values + 64 rope values per token.
- MLA latent, FlashMLA fp8: uint8 [T, 656] = 512 float8_e4m3fn nope codes (each 128-value block
  divided by its scale), four fp32 scales (block amax * fp32(1/448)), the 64 rope values as bf16.
- Index key (SGLang's index-K pages): per page, page_size x 128 fp8 key bytes, then page_size
  fp32 scales: 132 bytes per token.
- Ownership of a logical slot: page = slot // page_size, owner = page % cp_size, stored by the
  owner at physical row (page // cp_size) * page_size + slot % page_size of its shard.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_DIM = MLA_NOPE_DIM + MLA_ROPE_DIM  # 576
MLA_FP8_BLOCK = 128
MLA_FP8_ROW_BYTES = MLA_NOPE_DIM + 4 * (MLA_NOPE_DIM // MLA_FP8_BLOCK) + 2 * MLA_ROPE_DIM  # 656
INDEX_HEAD_DIM = 128
INDEX_ROW_BYTES = INDEX_HEAD_DIM + 4  # fp8 key bytes + one fp32 scale, per token


def owned_physical_rows(slots: torch.Tensor, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    """Physical shard row of each logical slot owned by `rank`; -1 for slots it does not own."""
    page = slots // page_size
    row = (page // cp_size) * page_size + slots % page_size
    return torch.where((page % cp_size == rank) & (slots >= 0), row, torch.full_like(row, -1))


def quantize_mla_fp8(kv: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 576] latent rows to FlashMLA's fp8 rows, uint8 [T, 656] (format above)."""
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


def index_page_offsets(rows: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For physical rows of an index-K page buffer: (page, key byte offset, scale byte offset)."""
    page = rows // page_size
    within = rows % page_size
    return page, within * INDEX_HEAD_DIM, page_size * INDEX_HEAD_DIM + within * 4


def read_index_k(pages: torch.Tensor, rows: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (uint8 [T, 128]) and scales (float32 [T]) at physical rows of an index-K page buffer."""
    page, key_off, scale_off = index_page_offsets(rows, page_size)
    key = pages[page[:, None], key_off[:, None] + torch.arange(INDEX_HEAD_DIM, device=pages.device)]
    scale = pages[page[:, None], scale_off[:, None] + torch.arange(4, device=pages.device)]
    return key, scale.contiguous().view(torch.float32).view(-1)
