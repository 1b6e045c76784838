"""The two CP prefill paths of the reference model, as KV contexts plus a prefill driver.

- Replicated CP (today's SGLang): every layer all-gathers the chunk's KV, every rank writes all
  of it into its full pool, and the tail gathers every token's hidden state.
- Shared-KV CP (this project): every layer all-gathers the chunk's KV (attention needs it), each
  rank persists only the pages it owns (direct write of what it computed when the split is
  page-aligned, otherwise its owned rows of the gathered chunk), the dense view is materialized
  from the owners (or is the gathered chunk itself under current reuse), and the tail gathers
  only each request's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter, gather_full_hidden, gather_last_token_hidden, start_all_gather_rerange
from sglang_nsa_cp.layout import ExtendBatch, SplitPlan
from sglang_nsa_cp.reference.model import DenseKV, DSAModel
from sglang_nsa_cp.shared_kv import HistoryPrefetcher, KVStore, add_current_index, add_current_latent, build_dense_plan


@dataclass
class _CPBatch:
    """What both CP contexts share: the chunk's KV is all-gathered between `begin_layer` and
    `finish_layer`, overlapping the queries and the indexer's work the model does in between
    (SGLang's `DSAInterleaveCPIndexerOverlap` does the same on a side stream)."""

    plan: SplitPlan
    batch: ExtendBatch
    rank: int
    group: dist.ProcessGroup
    counter: TrafficCounter | None

    def begin_layer(self, layer_id, latent, index_key, index_scale) -> None:
        self.persist_local(layer_id, latent, index_key, index_scale)
        start = lambda t, kind: start_all_gather_rerange(t, self.plan, self.group, self.counter, kind)  # noqa: E731
        self._pending = (
            layer_id,
            start(latent, "current_latent"),
            start(index_key, "current_index"),
            start(index_scale, "current_index"),
        )

    def finish_layer(self, layer_id: int) -> DenseKV:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != layer_id:
            raise RuntimeError(f"finish_layer({layer_id}) without a matching begin_layer")
        return self.dense_view(layer_id, *(finish() for finish in pending[1:]))

    def persist_local(self, layer_id, latent, index_key, index_scale) -> None:
        """Store what this rank computed before the exchange, where that is all it must store."""

    def dense_view(self, layer_id, latent, index_key, index_scale) -> DenseKV:
        """The layer's dense view from the chunk's gathered KV (flat-batch order)."""
        raise NotImplementedError


class ReplicatedCPKV(_CPBatch):
    """Today's behaviour: a full pool on every rank, written with every token of the chunk."""

    def __init__(self, store: KVStore, plan, batch, rank, group, counter=None):
        super().__init__(plan, batch, rank, group, counter)
        store.check_slots(batch.out_cache_loc)
        self.store = store
        device = store.latent[0].device
        self.slots = batch.out_cache_loc.to(device)
        self.req_rows = batch.req_to_token().to(device)
        self.all_slots = torch.arange(store.num_slots, device=device)  # the index read, once per batch

    def dense_view(self, layer_id, latent, index_key, index_scale) -> DenseKV:
        self.store.write(layer_id, self.slots, latent, index_key, index_scale)
        pages = self.store.index[layer_id]
        key, scale = kernels.read_index_k(pages, self.all_slots, self.store.page_size)
        return DenseKV(self.store.latent[layer_id], key, scale, self.req_rows)


class SharedCPKV(_CPBatch):
    """The shared KV cache: owned pages persisted, the dense view rebuilt per layer by the same
    plan and prefetcher the SGLang plugin's pool uses (`shared_kv.build_dense_plan`,
    `shared_kv.HistoryPrefetcher`).

    With `prefetch`, each layer's history is materialized one layer ahead (on a side stream on
    GPU); without it, when the layer needs it. A batch without history gathers nothing.
    """

    def __init__(self, store: KVStore, plan, batch, rank, group, counter=None, prefetch: bool = True, timings=None):
        super().__init__(plan, batch, rank, group, counter)
        device = store.latent[0].device
        self.store = store
        self.slots = batch.out_cache_loc.to(device)
        self.local_slots = self.slots[plan.device_tensor("token_indices", device, rank)]
        self.dense = build_dense_plan(
            batch.page_table().to(device), batch.prefix_lens, batch.seq_lens,
            page_size=store.page_size, cp_size=store.cp_size, rank=rank, num_logical_pages=store.num_pages,
        )  # fmt: skip
        self.dense.check_slots(self.slots)
        self.prefetcher = HistoryPrefetcher(store, group, enabled=prefetch, counter=counter)
        self.prefetcher.timings = timings
        self.prefetcher.begin(self.dense)
        # Row maps, once per batch: the chunk's tokens and every (request, position) in the view.
        self.current_rows = self.dense.translate(self.slots)
        req_to_token = batch.req_to_token().to(device)
        self.req_rows = torch.where(req_to_token >= 0, self.dense.translate(req_to_token.clamp(min=0)), -1)
        self.dense_rows = torch.arange(self.dense.num_dense_rows, device=device)

    def persist_local(self, layer_id, latent, index_key, index_scale) -> None:
        if self.batch.compute_owned:  # compute-owner pages: write what this rank computed, no exchange
            self.store.write(layer_id, self.local_slots, latent, index_key, index_scale)

    def dense_view(self, layer_id, latent, index_key, index_scale) -> DenseKV:
        view = self.prefetcher.acquire(layer_id)
        if not self.batch.compute_owned:  # owners persist their rows from the gathered chunk
            self.store.write(layer_id, self.slots, latent, index_key, index_scale)
        dense_latent = add_current_latent(view.latent, self.current_rows, latent)
        dense_index = add_current_index(view.index, self.current_rows, index_key, index_scale, self.store.page_size)
        key, scale = kernels.read_index_k(dense_index, self.dense_rows, self.store.page_size)
        return DenseKV(dense_latent, key, scale, self.req_rows)


@torch.no_grad()
def prefill_cp(
    model: DSAModel,
    input_ids: torch.Tensor,
    kv: _CPBatch,
    narrow_tail: bool,
    return_topk: bool = False,
):
    """This rank's share of a CP prefill; logits of each request's last token [bs, vocab].

    `input_ids` are the whole batch's new tokens in flat order (every rank has them, as SGLang's
    ForwardBatch does). `narrow_tail` gathers only last-token hidden states.
    """
    plan, rank = kv.plan, kv.rank
    device = input_ids.device
    mine = plan.device_tensor("token_indices", device, rank)
    out = model(
        input_ids[mine],
        plan.device_tensor("positions", device, rank),
        plan.device_tensor("request_ids", device, rank),
        kv,
        return_topk=return_topk,
    )
    hidden, topk = out if return_topk else (out, None)
    if narrow_tail:
        last = gather_last_token_hidden(hidden, plan, rank, kv.group, kv.counter)
    else:
        full = gather_full_hidden(hidden, plan, kv.group, kv.counter)
        last = full[torch.tensor(plan.extend_lens, device=device).cumsum(0) - 1]
    logits = model.logits(last)
    return (logits, topk) if return_topk else logits
