"""Ownership and coverage checks, on when SGLANG_NSA_CP_DEBUG=1.

They synchronise with the device and issue extra collectives, so they are for diagnosing, never
for measuring. When off, callers test one module attribute and nothing else runs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

ENABLED = os.environ.get("SGLANG_NSA_CP_DEBUG", "0") not in ("", "0", "false", "False")


class CoverageError(AssertionError):
    """A page or slot without exactly one owner, or history with no source."""


def check_layout(layout, hist_pages: torch.Tensor, hist_dense_pages: torch.Tensor, cp_size: int) -> None:
    """Every history page must be read from its owner's part of the gathered pages."""
    owner_part = hist_dense_pages // max(layout.pages_per_rank, 1)
    bad = (owner_part != hist_pages % cp_size).nonzero().flatten()
    if bad.numel():
        shown = [(int(hist_pages[i]), int(hist_dense_pages[i])) for i in bad[:8]]
        raise CoverageError(f"history pages (page, dense page) read outside their owner's gathered pages: {shown}")


def check_write_coverage(store, slots: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Across the group, every slot written must be owned by exactly one rank."""
    owned = store.owns(slots).to(torch.int64)
    dist.all_reduce(owned, group=group)
    bad = (owned != 1).nonzero().flatten()
    if bad.numel():
        shown = [(int(i), int(slots[i]), int(owned[i])) for i in bad[:8]]
        raise CoverageError(f"slots (index, slot, owners) without exactly one owner: {shown}")
