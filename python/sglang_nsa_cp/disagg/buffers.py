"""Paged KV buffers as the transfer sees them: raw bytes, one contiguous tensor per layer and kind.

A rank's prefill shard and the decode pool have the same per-layer shapes; only the number of
pages differs (a shard holds about 1/N of them)::

    kind    tensor (one per layer)                          one page
    kv      [num_pages * page_size, row] bf16 (576 values)  page_size rows = 64 x 1152 B
            [num_pages * page_size, 656] uint8 (fp8 FlashMLA)               = 64 x  656 B
    index   [num_pages, page_size * 132] uint8               one row       = 64 x (128 + 4) B

Page q of a buffer is the bytes [q * page_bytes, (q + 1) * page_bytes) from its data pointer, so a
run of consecutive pages is one contiguous range: one Mooncake transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

# The checksum (checksum.py) weights word i by i + 1 and stays within int64 for up to 2**16
# int32 words per page (256 KiB); DSA pages are 72 KiB (bf16), 41 KiB (fp8) and 8.25 KiB (index).
MAX_PAGE_WORDS = 1 << 16


@dataclass(frozen=True, eq=False)
class PagedBuffer:
    """One layer's buffer of one kind, addressed in pages of `rows_per_page` leading-dim rows."""

    name: str  # "kv[3]", "index[3]": used in error messages
    tensor: torch.Tensor = field(repr=False)
    rows_per_page: int

    @property
    def page_bytes(self) -> int:
        return self.tensor.nbytes // self.tensor.shape[0] * self.rows_per_page

    @property
    def num_pages(self) -> int:
        return self.tensor.shape[0] // self.rows_per_page

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def page_words(self) -> torch.Tensor:
        """[num_pages, page_bytes // 4] int32 view of the pages (no copy)."""
        flat = self.tensor.view(-1).view(torch.uint8)
        return flat[: self.num_pages * self.page_bytes].view(torch.int32).view(self.num_pages, -1)


def _check_tensor(name: str, t: torch.Tensor, rows_per_page: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2 or t.shape[0] == 0:
        raise ValueError(f"{name} must be [rows, ...] with rows > 0, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (pages are sent as byte ranges)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other buffers on {device}")
    if t.shape[0] % rows_per_page:
        raise ValueError(f"{name} has {t.shape[0]} rows, not a multiple of {rows_per_page} rows per page")
    page_bytes = t.nbytes // t.shape[0] * rows_per_page
    if page_bytes % 4 or page_bytes // 4 > MAX_PAGE_WORDS:
        raise ValueError(
            f"{name}: a page is {page_bytes} B; the checksum needs a multiple of 4 B and at most {4 * MAX_PAGE_WORDS} B"
        )


@dataclass(frozen=True, repr=False, eq=False)
class KVBuffers:
    """All layers' latent (kv) and index-K buffers of one rank's shard or of the decode pool.

    kv[l]:    [num_pages * page_size, ...] any dtype, contiguous (page_size rows per page)
    index[l]: [num_pages, page_size * 132] uint8, contiguous (one row per page)
    """

    kv: tuple[torch.Tensor, ...]
    index: tuple[torch.Tensor, ...]
    page_size: int

    def __init__(self, kv: Sequence[torch.Tensor], index: Sequence[torch.Tensor], page_size: int):
        kv, index = tuple(kv), tuple(index)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not kv or len(kv) != len(index):
            raise ValueError(
                f"need one kv and one index buffer per layer, got {len(kv)} kv and {len(index)} index buffers"
            )
        device = kv[0].device
        for layer, (k, i) in enumerate(zip(kv, index)):
            _check_tensor(f"kv[{layer}]", k, page_size, device)
            _check_tensor(f"index[{layer}]", i, 1, device)
        object.__setattr__(self, "kv", kv)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "page_size", page_size)
        for kind in ("kv", "index"):
            sizes = {b.page_bytes for b in self.flat() if b.name.startswith(kind)}
            if len(sizes) != 1:
                raise ValueError(f"{kind} page sizes differ across layers: {sorted(sizes)} B")

    def __repr__(self) -> str:
        return (
            f"KVBuffers(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, kv_page_bytes={self.kv_page_bytes}, "
            f"index_page_bytes={self.index_page_bytes}, device={self.device})"
        )

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    @property
    def num_pages(self) -> int:
        """Pages addressable in every buffer (SGLang's index pool may hold a page more)."""
        return min(b.num_pages for b in self.flat())

    @property
    def kv_page_bytes(self) -> int:
        return self.flat()[0].page_bytes

    @property
    def index_page_bytes(self) -> int:
        return self.flat()[1].page_bytes

    @property
    def device(self) -> torch.device:
        return self.kv[0].device

    def flat(self) -> list[PagedBuffer]:
        """[kv[0], index[0], kv[1], index[1], ...]: the order of transfers and checksums."""
        out = []
        for layer, (k, i) in enumerate(zip(self.kv, self.index)):
            out.append(PagedBuffer(f"kv[{layer}]", k, self.page_size))
            out.append(PagedBuffer(f"index[{layer}]", i, 1))
        return out

    def bytes_per_page(self) -> int:
        """Bytes one request page costs over all layers and both kinds."""
        return self.num_layers * (self.kv_page_bytes + self.index_page_bytes)

    def layout(self) -> dict:
        """What the two sides must agree on before any byte moves (sent in the handshake)."""
        return {
            "num_layers": self.num_layers,
            "page_size": self.page_size,
            "kv_page_bytes": self.kv_page_bytes,
            "index_page_bytes": self.index_page_bytes,
        }


def check_same_layout(local: dict, remote: dict, local_name: str, remote_name: str) -> None:
    """Raise ValueError naming every field where the two buffer layouts differ."""
    diffs = [
        f"{key}: {local_name} {local.get(key)} vs {remote_name} {remote.get(key)}"
        for key in sorted(set(local) | set(remote))
        if local.get(key) != remote.get(key)
    ]
    if diffs:
        raise ValueError(
            "prefill shard and decode pool layouts differ (" + "; ".join(diffs) + "); both sides "
            "need the same layers, page size and per-page bytes for kv and index buffers"
        )
