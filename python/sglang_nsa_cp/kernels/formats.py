"""The row format of the fused fp8 store and page ownership, defined here once.

- MLA latent, bf16: [T, 576] = 512 nope values + 64 rope values per token.
- MLA latent, FlashMLA fp8: uint8 [T, 656] = 512 float8_e4m3fn nope codes (each 128-value block
  divided by its scale), four fp32 scales, the 64 rope values as bf16.
- Ownership of a logical slot: page = slot // page_size, owner = page % cp_size, stored by the
  owner at physical row (page // cp_size) * page_size + slot % page_size of its shard.
"""

from __future__ import annotations

import torch

MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_DIM = MLA_NOPE_DIM + MLA_ROPE_DIM  # 576
MLA_FP8_BLOCK = 128
MLA_FP8_ROW_BYTES = MLA_NOPE_DIM + 4 * (MLA_NOPE_DIM // MLA_FP8_BLOCK) + 2 * MLA_ROPE_DIM  # 656


def owned_physical_rows(slots: torch.Tensor, rank: int, cp_size: int, page_size: int) -> torch.Tensor:
    """Physical shard row of each logical slot owned by `rank`; -1 for slots it does not own."""
    page = slots // page_size
    row = (page // cp_size) * page_size + slots % page_size
    return torch.where((page % cp_size == rank) & (slots >= 0), row, torch.full_like(row, -1))
