"""Decode destination pages grouped by prefill owner, so each prefill CP rank writes one run.

A shared-KV prefill of CP size N stores logical page p on rank p % N at local page p // N. A
request's logical pages are mostly consecutive (SGLang's paged allocator hands out a sorted free
list), so the positions a rank owns are one residue class k = c (mod N), with local pages that
rise by one from one owned position to the next. If the decode hands out its pages in request
order, those positions land N pages apart and every page becomes its own Mooncake batch entry per
layer and kind. Handing the same pages out grouped by residue class (all k = 0 (mod N) first,
then k = 1, ...) puts each class on consecutive decode pages: one run per rank, which SGLang's
`group_concurrent_contiguous` coalesces into one entry per layer and kind.

N = 2, six positions, allocated decode pages [40..45]::

    position k       0   1   2   3   4   5
    in order        40  41  42  43  44  45     rank owning k = 0, 2, 4 writes 3 runs
    owner-grouped   40  43  41  44  42  45     that rank writes 40, 41, 42: one run

Which class belongs to which rank does not matter (the request's first logical page decides it):
each class is one run. Where the allocated pages are not consecutive (a fragmented free list),
runs break at the gaps, and a prefill whose logical pages are not consecutive breaks them on its
side; either way every position still gets exactly one page, so only the entry count changes.
Attention on the decode reads pages through `req_to_token`, which holds the grouped order.
"""

from __future__ import annotations

import numpy as np
import torch


def owner_grouped_pages(pages, cp_size: int) -> np.ndarray:
    """The decode page of each request position: `pages` (the pages allocated for the request,
    any order) sorted, then dealt out to positions k = 0 (mod N) first, k = 1 (mod N) next, ..."""
    pages = np.sort(np.asarray(pages, dtype=np.int64))
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    positions = np.arange(len(pages))
    slot_order = np.argsort(positions % cp_size, kind="stable")  # positions in the order they get pages
    out = np.empty_like(pages)
    out[slot_order] = pages
    return out


def regroup_token_slots(kv_loc: torch.Tensor, page_size: int, cp_size: int) -> torch.Tensor:
    """`kv_loc` (token slots of a request from position 0, whole pages as the paged allocator
    returns them: slot = page * page_size + offset) with its pages re-dealt by
    `owner_grouped_pages`. Returns `kv_loc` itself when there is nothing to regroup (one page, N
    = 1) or when its slots are not whole pages in that layout (then they are not ours to move)."""
    n_tokens = int(kv_loc.numel())
    n_pages = -(-n_tokens // page_size)
    if cp_size <= 1 or n_pages <= 1:
        return kv_loc
    slots = kv_loc.detach().to("cpu", torch.int64)
    offsets = torch.arange(n_tokens) % page_size
    pages = slots[::page_size] // page_size
    if not torch.equal(slots, pages.repeat_interleave(page_size)[:n_tokens] * page_size + offsets):
        return kv_loc
    grouped = torch.from_numpy(owner_grouped_pages(pages.numpy(), cp_size))
    out = grouped.repeat_interleave(page_size)[:n_tokens] * page_size + offsets
    return out.to(device=kv_loc.device, dtype=kv_loc.dtype)
