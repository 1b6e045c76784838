"""The per-batch dense plan: where every page of an extend batch sits in the dense view that
attention and the indexer read, and which history pages each rank sends to build it.

N = 2 ranks, page size 4; request A has 9 cached tokens on logical pages 6, 3, 9 and 6 new
tokens (the rest of page 9, then page 4); request B is new, on page 8:

    logical page    6   3   9   4   8
    owner (p % 2)   0   1   1   0   0
    history page    y   y   y   -   -      (page 9 holds cached tokens and new ones)

    rank 0 sends local pages [3, -1]   (page 6; padded to pages_per_rank = 2)
    rank 1 sends local pages [1, 4]    (pages 3 and 9)

    dense page   0      1     2     3     4     5     6
    holds        6      pad   3     9     4     8     trash
                 |-- rank 0 --|-- rank 1 --|-- current-only --|

The all-gather of owned history pages fills the first N * pages_per_rank dense pages (rank r's
at r * pages_per_rank, ascending page id), so history lands where kernels read it with no
scatter pass. Pages that hold only this chunk's tokens follow, request after request, then one
trash page: every logical page outside the batch translates there. The chunk's own rows are
written into the view by its user (the plugin's pool, or the reference CP path) once history has
landed, which also completes a history page that ends mid-page.

A batch without cached history gathers nothing (current reuse): its dense view is the chunk's
pages alone, and building its plan reads nothing back from the device.

The plan depends on the batch, not the layer: built once per batch on every rank from mirrored
scheduler data (so every rank derives the same collectives), used by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_nsa_cp.layout import host_to_device
from sglang_nsa_cp.shared_kv import debug


class PlanError(ValueError):
    """Slots or pages that the batch's plan cannot place; raised before anything is written."""


@dataclass(frozen=True, slots=True)
class DensePlan:
    page_size: int
    cp_size: int
    rank: int
    num_logical_pages: int
    # gather: rank r's owned history pages land at dense pages [r * pages_per_rank, (r+1) * ...)
    pages_per_rank: int  # 0: no history (current reuse)
    send_pages: torch.Tensor  # [pages_per_rank] int64 local pages this rank sends, -1 padding
    # the view: gathered pages, then current-only pages, then one trash page
    num_current_pages: int
    page_pos: torch.Tensor  # [num_logical_pages] int64 dense page of each logical page (trash if not in the batch)

    @property
    def has_history(self) -> bool:
        return self.pages_per_rank > 0

    @property
    def num_gathered_pages(self) -> int:
        return self.cp_size * self.pages_per_rank

    @property
    def num_dense_pages(self) -> int:
        return self.num_gathered_pages + self.num_current_pages + 1

    @property
    def trash_page(self) -> int:
        return self.num_dense_pages - 1

    @property
    def num_dense_rows(self) -> int:
        return self.num_dense_pages * self.page_size

    def translate(self, loc: torch.Tensor) -> torch.Tensor:
        """Logical slots -> rows of the dense view (same shape as `loc`, int64).

        Slots must lie in the logical pool; slots of pages outside the batch land in the trash page.
        """
        loc = loc.long()
        return self.page_pos[loc // self.page_size] * self.page_size + loc % self.page_size

    def dense_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Logical page ids -> dense page ids (what paged readers of the index get)."""
        return self.page_pos[pages.long()]

    def check_slots(self, loc: torch.Tensor) -> None:
        """Reject slots outside the logical pool or on pages the batch did not plan, naming them.

        One host read: call once per batch (it synchronises with the device), never per layer.
        """
        pages = loc.long() // self.page_size
        outside = (pages < 0) | (pages >= self.num_logical_pages)
        unplanned = ~outside & (self.page_pos[pages.clamp(0, self.num_logical_pages - 1)] == self.trash_page)
        bad = (outside | unplanned).nonzero().flatten()
        if bad.numel():
            shown = [(int(i), int(loc[i])) for i in bad[:8]]
            raise PlanError(
                f"{bad.numel()} slots (index, slot) {shown} are outside the pool of "
                f"{self.num_logical_pages * self.page_size} slots or on pages this batch did not "
                "allocate; slots must come from the batch's out_cache_loc"
            )


def build_dense_plan(
    page_table: torch.Tensor,
    prefix_lens: list[int],
    seq_lens: list[int],
    *,
    page_size: int,
    cp_size: int,
    rank: int,
    num_logical_pages: int,
) -> DensePlan:
    """The dense plan of one extend batch, on `page_table`'s device.

    `page_table[i, k]` is request i's k-th logical page id (SGLang's
    `req_to_token[req, ::page_size] // page_size`); columns past a request's last page are
    ignored. Lengths are host lists, as SGLang keeps them. A batch with history reads one small
    tensor back (the owners' page counts, which size the all-gather, and two invariant counts).
    """
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is not a rank of a CP group of size {cp_size}")
    if len(prefix_lens) != len(seq_lens) or any(not 0 <= p <= s for p, s in zip(prefix_lens, seq_lens)):
        raise ValueError(f"need 0 <= prefix <= seq for every request; got {prefix_lens=}, {seq_lens=}")
    device = page_table.device
    pages_per_req = torch.tensor([-(-s // page_size) for s in seq_lens])
    hist_per_req = torch.tensor([-(-p // page_size) for p in prefix_lens])
    if pages_per_req.numel() and int(pages_per_req.max()) > page_table.shape[1]:
        raise ValueError(
            f"page_table has {page_table.shape[1]} columns; the longest request needs {int(pages_per_req.max())}"
        )
    # Every (request, page) of the batch, in request order; history pages first in each request.
    flat_req = torch.repeat_interleave(torch.arange(len(seq_lens)), pages_per_req)
    flat_col = torch.arange(flat_req.numel()) - (torch.cumsum(pages_per_req, 0) - pages_per_req)[flat_req]
    is_hist = flat_col < hist_per_req[flat_req]
    # Positions picked on the host: a boolean mask on the device would wait for it to drain.
    order = torch.cat([is_hist.nonzero().flatten(), (~is_hist).nonzero().flatten()])
    req_d, col_d = (host_to_device(t[order], device) for t in (flat_req, flat_col))
    logical = page_table.long()[req_d, col_d]  # history pages, then current-only pages
    num_hist_refs = int(is_hist.sum())
    hist_pages, cur_pages = logical[:num_hist_refs], logical[num_hist_refs:]
    num_current_pages = cur_pages.numel()

    page_pos = torch.empty(num_logical_pages, dtype=torch.long, device=device)
    pages_per_rank = 0
    send_pages = torch.empty(0, dtype=torch.long, device=device)
    if num_hist_refs:
        # History pages, deduplicated (requests may share a cached prefix), grouped by owner;
        # within an owner, ascending page id (torch.unique sorts).
        unique_pages = torch.unique(hist_pages)
        owner = unique_pages % cp_size
        per_owner = torch.bincount(owner, minlength=cp_size)
        outside = ((logical < 0) | (logical >= num_logical_pages)).sum()
        in_use = torch.isin(cur_pages, unique_pages).sum()  # a fresh page that is also cached
        cur_sorted = torch.sort(cur_pages).values
        given_twice = (cur_sorted[1:] == cur_sorted[:-1]).sum()
        # The batch's one host read: the gather's size (owners' page counts) and three invariants.
        counts = torch.cat([per_owner, torch.stack([outside, in_use, given_twice]).to(per_owner.dtype)]).tolist()
        pages_per_rank = max(counts[:cp_size])
        outside, in_use, given_twice = counts[cp_size:]
        if outside:
            raise PlanError(
                f"{outside} pages of the batch's page table are outside the pool of {num_logical_pages} pages"
            )
        assert in_use == 0 and given_twice == 0, (
            f"pages of this chunk that are also cached pages: {in_use}, given twice: {given_twice}; "
            "the allocator handed out a page in use"
        )
        order = torch.argsort(owner, stable=True)
        group_start = torch.cumsum(per_owner, 0) - per_owner
        slot_in_owner = torch.empty_like(order)
        slot_in_owner[order] = torch.arange(order.numel(), device=device) - group_start[owner[order]]
        send = torch.full((pages_per_rank + 1,), -1, dtype=torch.long, device=device)
        mine = owner == rank
        send.scatter_(
            0, torch.where(mine, slot_in_owner, pages_per_rank), torch.where(mine, unique_pages // cp_size, -1)
        )
        send_pages = send[:pages_per_rank]
        num_gathered = cp_size * pages_per_rank
        page_pos.fill_(num_gathered + num_current_pages)  # the trash page
        page_pos[unique_pages] = owner * pages_per_rank + slot_in_owner
    else:
        num_gathered = 0
        page_pos.fill_(num_current_pages)  # the trash page
    page_pos[cur_pages] = num_gathered + torch.arange(num_current_pages, device=device)

    plan = DensePlan(
        page_size=page_size,
        cp_size=cp_size,
        rank=rank,
        num_logical_pages=num_logical_pages,
        pages_per_rank=pages_per_rank,
        send_pages=send_pages,
        num_current_pages=num_current_pages,
        page_pos=page_pos,
    )
    assert plan.num_dense_pages == num_gathered + num_current_pages + 1 and send_pages.numel() == pages_per_rank
    if debug.enabled():
        debug.check_plan(plan, hist_pages, cur_pages)
    return plan
