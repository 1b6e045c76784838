"""Materialize: the steps that fill one layer's dense view from the owners' shards.

1. history (the cached prefix): each rank packs the history pages it owns (the plan's
   `send_pages`) into a send buffer, and one all-gather of owned pages writes them straight into
   the dense view's first cp_size * pages_per_rank pages (never an all-reduce of zero-filled
   buffers, which moves twice the bytes);
2. current (this chunk's tokens, all-gathered for attention anyway) is written at its dense rows
   after history, so a prefix page that ends mid-page gets its new tokens from the chunk.

`HistoryPrefetcher` (prefetch.py) runs step 1 one layer ahead into its scratch; step 2 is the
caller's: the plugin's pool lets SGLang's own kernels write the chunk into the view, the
reference CP path uses `add_current_latent` / `add_current_index`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter, all_gather_rows
from sglang_nsa_cp.shared_kv.plan import DensePlan


def gather_history_pages(
    pages: torch.Tensor,
    plan: DensePlan,
    group: dist.ProcessGroup,
    out: torch.Tensor,
    counter: TrafficCounter | None = None,
    kind: str = "materialize",
) -> torch.Tensor:
    """Owned history pages of every rank into `out`'s first cp_size * pages_per_rank rows.

    `pages` is one layer's shard viewed as one row per local page; `out` [>= num_gathered_pages,
    page row] of the same dtype. A collective: every rank of `group` calls it in the same order.
    """
    # Padding pages (-1: this rank owns fewer history pages than another) are sent as zeros. SGLang's
    # readers touch dense row 0 for padded entries, as they touch their own pool's reserved slot 0,
    # and rank 0's padding lands there when it owns no history page. Traced on CPU with SGLang's
    # forward: NaN in rank 0's padding changed the logits; NaN in other ranks' padding, in the trash
    # page or in the unwritten tail rows of the chunk's last page did not.
    send = kernels.gather_rows(pages, plan.send_pages, pages.new_zeros((plan.pages_per_rank, pages.shape[1])))
    all_gather_rows(send, plan.pages_per_rank, group, counter, kind, out=out[: plan.num_gathered_pages])
    return out


def add_current_latent(dense_pages: torch.Tensor, rows: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Write the chunk's latent rows (`current` [T, row]) at dense `rows` [T]; returns the dense
    view as rows [num_dense_rows, row]."""
    dense = dense_pages.view(-1, current.shape[1])
    return kernels.scatter_rows(dense, rows, current)


def add_current_index(
    dense_pages: torch.Tensor, rows: torch.Tensor, key: torch.Tensor, scale: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Write the chunk's index keys (uint8 [T, 128]) and scales (fp32 [T]) at dense `rows` of
    the index pages [num_dense_pages, page_size * 132]."""
    return kernels.store_owned_index_k(dense_pages, rows, key, scale, 0, 1, page_size)
