"""The sharded KV store: per rank, per layer, physical storage for the pages this rank owns.

Two buffers per layer, laid out as SGLang's DSA pool lays them out so kernels and the PD
transfer can read them unchanged:
- MLA latent rows `[local_pages * page_size, row]`: either `kv_lora_rank + rope` values of a
  float dtype (bf16 in production, the model dtype in the oracle), or FlashMLA's 656-byte fp8 row
  (uint8), quantized on write.
- NSA index K pages `[local_pages, page_size * 132]` uint8: per page, page_size x 128 fp8 key
  bytes, then page_size fp32 scales.

A rank owns logical page p when p % N == rank and keeps it at local page p // N. Capacity is the
replicated pool's divided by N, plus slack pages for owner-class imbalance. The replicated store
(today's SGLang behaviour) is the same class with N = 1: every page owned, at its own id.
"""

from __future__ import annotations

import math

import torch

from sglang_nsa_cp import kernels
from sglang_nsa_cp.kernels.formats import INDEX_ROW_BYTES, MLA_FP8_ROW_BYTES, MLA_NOPE_DIM, MLA_ROPE_DIM


class KVStoreError(ValueError):
    """Input that would corrupt the store; raised before anything is written."""


class KVStore:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        cp_size: int,
        rank: int,
        latent_dim: int,
        latent_dtype: torch.dtype = torch.bfloat16,
        fp8_latent: bool = False,
        with_index: bool = True,
        slack_pages: int = 0,
        device: torch.device | str = "cpu",
    ):
        if not 0 <= rank < cp_size:
            raise KVStoreError(f"rank {rank} is outside the CP group of size {cp_size}")
        if fp8_latent and latent_dim != MLA_NOPE_DIM + MLA_ROPE_DIM:
            raise KVStoreError(f"the fp8 FlashMLA row needs latent_dim {MLA_NOPE_DIM + MLA_ROPE_DIM}, got {latent_dim}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.cp_size = cp_size
        self.rank = rank
        self.latent_dim = latent_dim
        self.latent_dtype = latent_dtype
        self.fp8_latent = fp8_latent
        self.local_pages = math.ceil(num_pages / cp_size) + slack_pages
        rows = self.local_pages * page_size
        if fp8_latent:
            shape, dtype = (rows, MLA_FP8_ROW_BYTES), torch.uint8
        else:
            shape, dtype = (rows, latent_dim), latent_dtype
        self.latent = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.index = (
            [
                torch.zeros((self.local_pages, page_size * INDEX_ROW_BYTES), dtype=torch.uint8, device=device)
                for _ in range(num_layers)
            ]
            if with_index
            else []
        )

    @classmethod
    def replicated(cls, **kwargs) -> "KVStore":
        """Today's SGLang pool: every rank stores every page."""
        return cls(cp_size=1, rank=0, **kwargs)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def nbytes(self) -> int:
        """Persistent bytes this rank holds (all layers, latent and index)."""
        return sum(t.numel() * t.element_size() for t in self.latent + self.index)

    def owns(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots // self.page_size) % self.cp_size == self.rank

    # ---- validation, once per batch ------------------------------------------------------------
    def check_slots(self, slots: torch.Tensor) -> None:
        """Reject slots outside the logical pool, naming them. Call once per batch, not per layer."""
        bad = ((slots < 0) | (slots >= self.num_slots)).nonzero().flatten()
        if bad.numel():
            shown = [(int(i), int(slots[i])) for i in bad[:8]]
            raise KVStoreError(
                f"{bad.numel()} slots are outside the pool of {self.num_slots} slots "
                f"(index, slot): {shown}; slots must come from this pool's allocator"
            )
        if self.cp_size > 1:
            local = (slots // self.page_size) // self.cp_size
            over = (local >= self.local_pages).nonzero().flatten()
            if over.numel():
                shown = [(int(i), int(slots[i])) for i in over[:8]]
                raise KVStoreError(f"slots {shown} map past this rank's {self.local_pages} local pages")

    def check_pages(self, pages: torch.Tensor) -> None:
        """Reject logical page ids that have no owner in this pool, naming them."""
        bad = ((pages < 0) | (pages >= self.num_pages)).nonzero().flatten()
        if bad.numel():
            shown = [(int(i), int(pages[i])) for i in bad[:8]]
            raise KVStoreError(f"pages (index, page) {shown} have no owner: the pool has pages 0..{self.num_pages - 1}")

    # ---- writes: direct (own computed rows) or from a gathered current tensor ------------------
    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        latent: torch.Tensor,
        index_key: torch.Tensor | None = None,
        index_scale: torch.Tensor | None = None,
    ) -> None:
        """Persist the rows at `slots` that this rank owns; rows of other owners are skipped.

        `latent` [T, latent_dim] (float; quantized here for the fp8 layout), `index_key` uint8
        [T, 128], `index_scale` float32 [T]. Slots must have passed `check_slots` for this batch.
        """
        if self.fp8_latent:
            kernels.store_owned_mla_fp8(self.latent[layer], slots, latent, self.rank, self.cp_size, self.page_size)
        else:
            self.write_rows(layer, slots, latent)
        if index_key is not None:
            kernels.store_owned_index_k(
                self.index[layer], slots, index_key, index_scale, self.rank, self.cp_size, self.page_size
            )

    def write_rows(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Persist latent rows already in this store's row format (bf16 rows, or 656-byte fp8
        rows quantized by the caller, e.g. by SGLang's own quantizer) at the owned `slots`. Rows of
        another dtype or width are refused by the kernel's own check, naming both."""
        kernels.store_owned_rows(self.latent[layer], slots, rows, self.rank, self.cp_size, self.page_size)

    # ---- reads for tests and the transfer layer ------------------------------------------------
    def page_rows(self, layer: int) -> torch.Tensor:
        """The latent buffer viewed as one row per local page (bytes of page_size rows)."""
        buf = self.latent[layer]
        return buf.view(self.local_pages, -1)
