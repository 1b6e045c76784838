"""Ownership and coverage checks, on when SGLANG_NSA_CP_DEBUG=1.

They synchronise with the device and issue extra collectives, so they are for diagnosing, never
for measuring. When off, callers read the variable once per batch and nothing else runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_nsa_cp.envs import envs


def enabled() -> bool:
    """SGLANG_NSA_CP_DEBUG, read now (callers read it once per batch)."""
    return envs.SGLANG_NSA_CP_DEBUG.get()


class CoverageError(AssertionError):
    """A page or slot without exactly one owner, or history with no source."""


def check_plan(plan, hist_pages: torch.Tensor, cur_pages: torch.Tensor) -> None:
    """Every history page is read from its owner's part of the gathered pages; every page of the
    chunk has a dense page of its own after them."""
    if hist_pages.numel():
        dense = plan.page_pos[hist_pages]
        owner_part = dense // plan.pages_per_rank
        bad = ((dense >= plan.num_gathered_pages) | (owner_part != hist_pages % plan.cp_size)).nonzero().flatten()
        if bad.numel():
            shown = [(int(hist_pages[i]), int(dense[i])) for i in bad[:8]]
            raise CoverageError(f"history pages (page, dense page) read outside their owner's gathered pages: {shown}")
    dense = plan.page_pos[cur_pages]
    expected = plan.num_gathered_pages + torch.arange(cur_pages.numel(), device=dense.device)
    if not torch.equal(dense, expected):
        raise CoverageError(
            f"chunk pages map to dense pages {dense[:8].tolist()}, expected {expected[:8].tolist()}: a page was given twice"
        )


def check_write_coverage(store, slots: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Across the group, every slot written must be owned by exactly one rank."""
    owned = store.owns(slots).to(torch.int64)
    dist.all_reduce(owned, group=group)
    bad = (owned != 1).nonzero().flatten()
    if bad.numel():
        shown = [(int(i), int(slots[i]), int(owned[i])) for i in bad[:8]]
        raise CoverageError(f"slots (index, slot, owners) without exactly one owner: {shown}")
