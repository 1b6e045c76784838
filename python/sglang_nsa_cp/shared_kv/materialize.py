"""Materialize: rebuild, for one layer, the dense KV view the attention and indexer kernels read.

The dense view is a buffer of pages, and the page table handed to kernels is rewritten to it
(`req_rows[i, p]` is the dense row of request i's position p). Its first part *is* the
all-gather of owned history pages, rank-major (owner r's j-th page at r * pages_per_rank + j), so
history lands where kernels read it with no scatter pass; pages that hold only this chunk's
tokens follow. It is filled in two steps:

1. history (the cached prefix): each rank packs the history pages it owns into a send buffer
   and one all-gather of owned pages (never an all-reduce of zero-filled buffers, which moves
   twice the bytes) writes them into the dense view;
2. current (this chunk's tokens, already all-gathered for attention) is written at its rows,
   after history, so a prefix page that ends mid-page gets its new tokens from the chunk.

A batch without history skips both (current reuse): the gathered current tensor already is the
dense view, in flat-batch order. The choice comes from prefix lengths every rank shares.

`DenseLayout` (the slot remap) depends on the batch, not the layer: built once per batch, used by
every layer, so the per-layer path issues no host reads and builds no host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter, all_gather_rows
from sglang_nsa_cp.shared_kv import debug
from sglang_nsa_cp.shared_kv.store import KVStore


@dataclass(frozen=True)
class DenseLayout:
    """Per-batch remap from owners' shards and the current chunk to the dense view."""

    current_reuse: bool
    page_size: int
    req_rows: torch.Tensor  # [bs, max_seq_len] dense row of each (request, position), -1 past the end
    current_rows: torch.Tensor  # [num_tokens] dense row of each flat-batch current token
    num_dense_pages: int  # gathered history pages (cp_size * pages_per_rank), then current-only pages
    send_pages: torch.Tensor  # [pages_per_rank] this rank's local pages to send, -1 padding
    pages_per_rank: int
    dense_page_table: torch.Tensor  # [bs, max_pages] dense page of each request page, -1 past the end

    @property
    def num_dense_rows(self) -> int:
        return self.num_dense_pages * self.page_size


def build_dense_layout(
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    cp_size: int,
    rank: int,
) -> DenseLayout:
    """The batch's slot remap, computed on `page_table`'s device.

    `page_table[i, k]` is request i's k-th logical page id (SGLang's req_to_token[:, ::ps] // ps).
    Lengths are host lists, as SGLang keeps them. One host read per batch sizes the page
    all-gather (the largest number of history pages one rank owns).
    """
    device = page_table.device
    bs = len(extend_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    max_len = max(seq_lens)
    lens = torch.tensor(seq_lens)
    prefix = torch.tensor(prefix_lens)
    # Flat (request, position) index of every current token, host math on lengths only.
    req_of_token = torch.repeat_interleave(torch.arange(bs), torch.tensor(extend_lens))
    pos_of_token = torch.cat([torch.arange(p, n) for p, n in zip(prefix_lens, seq_lens)])
    current_flat = (req_of_token * max_len + pos_of_token).to(device)

    if not any(prefix_lens):
        starts = torch.cumsum(torch.tensor(extend_lens), 0) - torch.tensor(extend_lens)
        pos = torch.arange(max_len)
        req_rows = torch.where(pos < lens[:, None], starts[:, None] + pos, -1)
        empty = torch.empty(0, dtype=torch.long, device=device)
        return DenseLayout(
            current_reuse=True,
            page_size=page_size,
            req_rows=req_rows.to(device),
            current_rows=torch.arange(sum(extend_lens), device=device),
            num_dense_pages=0,
            send_pages=empty,
            pages_per_rank=0,
            dense_page_table=empty.view(bs, 0),
        )

    # Every request page in flat order (request, page); history pages first hold cached tokens.
    pages_per_req = -(-lens // page_size)
    hist_per_req = -(-prefix // page_size)
    max_pages = int(pages_per_req.max())
    flat_req = torch.repeat_interleave(torch.arange(bs), pages_per_req)
    flat_col = torch.arange(int(pages_per_req.sum())) - (torch.cumsum(pages_per_req, 0) - pages_per_req)[flat_req]
    is_hist = flat_col < hist_per_req[flat_req]
    hist_flat = (flat_req * max_pages + flat_col)[is_hist].to(device)
    cur_flat = (flat_req * max_pages + flat_col)[~is_hist].to(device)

    # History pages, deduplicated (requests may share a cached prefix), grouped by owner.
    hist_pages = page_table[:, :max_pages].reshape(-1)[hist_flat]
    unique_pages, inverse = torch.unique(hist_pages, sorted=True, return_inverse=True)
    owner = unique_pages % cp_size
    per_owner = torch.bincount(owner, minlength=cp_size)
    pages_per_rank = int(per_owner.max())  # the one host read of the batch
    # unique_pages is sorted, so within each owner's group the order is ascending page id.
    order = torch.argsort(owner, stable=True)
    group_start = torch.cumsum(per_owner, 0) - per_owner
    slot_in_owner = torch.empty_like(order)
    slot_in_owner[order] = torch.arange(order.numel(), device=device) - group_start[owner[order]]
    gathered_page = owner * pages_per_rank + slot_in_owner

    send = torch.full((pages_per_rank + 1,), -1, dtype=torch.long, device=device)
    target = torch.where(owner == rank, slot_in_owner, torch.full_like(slot_in_owner, pages_per_rank))
    send.scatter_(0, target, torch.where(owner == rank, unique_pages // cp_size, -1))

    # The rewritten page table: history pages at their gathered page, the others after them.
    num_gathered = cp_size * pages_per_rank
    dense_pt = torch.full((bs * max_pages,), -1, dtype=torch.long, device=device)
    dense_pt[hist_flat] = gathered_page[inverse]
    dense_pt[cur_flat] = num_gathered + torch.arange(cur_flat.numel(), device=device)
    dense_pt = dense_pt.view(bs, max_pages)
    pos = torch.arange(max_len, device=device)
    rows = dense_pt[:, pos // page_size] * page_size + pos % page_size
    req_rows = torch.where(pos < lens.to(device)[:, None], rows, -1)

    layout = DenseLayout(
        current_reuse=False,
        page_size=page_size,
        req_rows=req_rows,
        current_rows=req_rows.reshape(-1)[current_flat],
        num_dense_pages=num_gathered + cur_flat.numel(),
        send_pages=send[:pages_per_rank],
        pages_per_rank=pages_per_rank,
        dense_page_table=dense_pt,
    )
    if debug.ENABLED:
        debug.check_layout(layout, hist_pages, dense_pt.reshape(-1)[hist_flat], cp_size)
    return layout


def gather_history_pages(
    pages: torch.Tensor,
    layout: DenseLayout,
    group: dist.ProcessGroup,
    counter: TrafficCounter | None,
    kind: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Owned history pages of every rank into the dense view: pack, one all-gather.

    `pages` is one layer's shard viewed as one row per local page; returns (or fills `out`)
    [num_dense_pages, page row]. The all-gather writes straight into the view's first
    cp_size * pages_per_rank pages; the current-only pages after them are left as they were.
    """
    send = kernels.gather_rows(pages, layout.send_pages, pages.new_empty((layout.pages_per_rank, pages.shape[1])))
    if out is None:
        out = pages.new_empty((layout.num_dense_pages, pages.shape[1]))
    num_gathered = dist.get_world_size(group) * layout.pages_per_rank
    all_gather_rows(send, layout.pages_per_rank, group, counter, kind, out=out[:num_gathered])
    return out


def add_current_latent(dense_pages: torch.Tensor, layout: DenseLayout, current: torch.Tensor) -> torch.Tensor:
    """Write the chunk's latent rows into materialized history pages; returns the dense rows."""
    dense = dense_pages.view(layout.num_dense_rows, current.shape[1])
    return kernels.scatter_rows(dense, layout.current_rows, current)


def add_current_index(dense_pages: torch.Tensor, layout: DenseLayout, key: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Write the chunk's index keys and scales into materialized history index pages."""
    return kernels.store_owned_index_k(dense_pages, layout.current_rows, key, scale, 0, 1, layout.page_size)


def materialize_latent(
    store: KVStore,
    layer: int,
    layout: DenseLayout,
    current: torch.Tensor,
    group: dist.ProcessGroup,
    counter: TrafficCounter | None = None,
) -> torch.Tensor:
    """Dense latent rows for `layer` [num_dense_rows, row] in the store's row format.

    `current` is the chunk's latent in flat-batch order, already in the store's row format
    (quantized with `kernels.quantize_mla_fp8` for the fp8 layout).
    """
    if layout.current_reuse:
        return current
    history = gather_history_pages(store.page_rows(layer), layout, group, counter, "materialize_latent")
    return add_current_latent(history, layout, current)


def materialize_index(
    store: KVStore,
    layer: int,
    layout: DenseLayout,
    current_key: torch.Tensor,
    current_scale: torch.Tensor,
    group: dist.ProcessGroup,
    counter: TrafficCounter | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense index-K pages for `layer` [num_dense_pages, page_size * 132] (SGLang's page layout).

    Under current reuse there are no pages to rebuild: returns the chunk's (key, scale) as is.
    """
    if layout.current_reuse:
        return current_key, current_scale
    history = gather_history_pages(store.index[layer], layout, group, counter, "materialize_index")
    return add_current_index(history, layout, current_key, current_scale)
