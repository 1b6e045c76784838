"""One-layer-ahead prefetch of history: materialize layer l+1's cached prefix while layer l runs.

History pages of every layer exist before the batch starts, so their gather does not depend on
the layer's input. One `HistoryPrefetcher` lives as long as its store (the plugin's pool holds
one; the reference CP path builds one per batch) and keeps a double-buffered dense scratch:
layer l's view is half l % 2.

One batch with history, prefetch on (side: a CUDA side stream; main: whatever stream calls):

    begin(plan)    side: pack + all-gather history of layer 0 -> half 0, record ready[0]
    acquire(0)     side: layer 1 -> half 1 (after main's use of half 1 so far)
                   main: wait ready[0]; chunk rows into half 0; attention of layer 0 reads half 0
    acquire(1)     side: layer 2 -> half 0, after main's work so far (layer 0 is done with it)
                   main: wait ready[1]; chunk rows into half 1; attention of layer 1 ...

- Every rank calls `begin` and `acquire(l)` for every layer in the same order, so the
  collectives (one all-gather of latent pages, one of index pages, per layer with history) are
  issued in one order on every rank; the decisions (prefetch or not, how many pages) come from
  the plan, which every rank shares.
- The main stream never waits on the host: `acquire` makes the calling stream wait on an event.
  Every call waits (layer l's writes may come from two streams), only the first launches.
- A layer that was never launched is launched (synchronously) by its `acquire`; so is every
  layer when prefetch is off (`enabled=False`, the diagnosis switch) or the history is smaller
  than `min_pages_per_rank` pages per rank.
- The main stream may persist layer l's chunk rows into the shard while the side stream packs
  layer l's history: only a prefix page that ends mid-page is touched by both, and only in rows
  that the chunk then overwrites in the dense view, so either order gives one result.
- A batch without history gathers nothing: `acquire` hands out the scratch for the chunk's pages.
- On CPU there are no streams: the same calls run synchronously.

The original design's Phase 8 prefetch (`cp_shared_kv_prefetch`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from sglang_nsa_cp.comm import TrafficCounter
from sglang_nsa_cp.shared_kv.materialize import gather_history_pages
from sglang_nsa_cp.shared_kv.plan import DensePlan
from sglang_nsa_cp.shared_kv.store import KVStore

# Below this many history pages per rank, an early launch costs more than it hides.
MIN_PAGES_PER_RANK = 2


class LayerView(NamedTuple):
    """One layer's dense view: rows of the plan's dense pages, in the store's formats."""

    latent: torch.Tensor  # [num_dense_pages, page_size * latent row] (store dtype)
    index: torch.Tensor | None  # [num_dense_pages, page_size * 132] uint8; None: the layer keeps no index keys


class HistoryPrefetcher:
    def __init__(
        self,
        store: KVStore,
        group: dist.ProcessGroup,
        *,
        enabled: bool = True,
        min_pages_per_rank: int = MIN_PAGES_PER_RANK,
        counter: TrafficCounter | None = None,
        shard_ready: Callable[[int], None] | None = None,
    ):
        self.store, self.group = store, group
        # Called with a layer on the stream that is about to read its shard, before it reads:
        # the plugin's pool makes it wait for a host-tier load of that layer (HiCache).
        self.shard_ready = shard_ready
        self.enabled, self.min_pages_per_rank = enabled, min_pages_per_rank
        self.counter = counter  # bytes and calls of the history all-gathers, when set
        self.device = store.latent[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._halves: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._capacity = 0  # dense pages per half
        self.plan: DensePlan | None = None
        self.early = False
        # CUDA only: when a list, receives (layer, start, end) events around each layer's first
        # wait for its history, i.e. the exposed materialize time (benchmarks set it)
        self.timings: list | None = None
        self._ready: dict[int, torch.cuda.Event | None] = {}
        self._current: tuple[int, LayerView] | None = None  # the latest acquired layer and its view

    # ---- scratch -------------------------------------------------------------------------------
    @staticmethod
    def scratch_bytes_for(store: KVStore, num_dense_pages: int) -> int:
        """Bytes of the double-buffered scratch for a batch of `num_dense_pages` dense pages."""
        latent = store.page_rows(0)
        page_bytes = latent.shape[1] * latent.element_size()
        if store.index:
            page_bytes += store.index[0].shape[1]
        return 2 * num_dense_pages * page_bytes

    @property
    def capacity(self) -> int:
        """Dense pages each half of the scratch holds now."""
        return self._capacity

    def scratch_bytes(self) -> int:
        """Bytes the scratch holds now (both halves)."""
        return sum(t.numel() * t.element_size() for half in self._halves for t in half)

    def reserve(self, num_dense_pages: int) -> None:
        """Grow both halves to hold `num_dense_pages` pages (they never shrink)."""
        if num_dense_pages <= self._capacity:
            return
        if self.stream is not None:  # the old halves may still be side-stream targets
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._halves = []  # free before allocating: two layers' scratch at most, never four
        latent = self.store.page_rows(0)
        index_row = self.store.index[0].shape[1] if self.store.index else 0
        self._halves = [
            (
                latent.new_empty((num_dense_pages, latent.shape[1])),
                latent.new_empty((num_dense_pages, index_row), dtype=torch.uint8),
            )
            for _ in range(2)
        ]
        self._capacity = num_dense_pages

    # ---- one batch ------------------------------------------------------------------------------
    def begin(self, plan: DensePlan) -> None:
        """Start a batch: size the scratch and launch layer 0's history. Same call on every rank."""
        self.reserve(plan.num_dense_pages)
        self.plan = plan
        self._ready, self._current = {}, None
        self.early = self.enabled and plan.pages_per_rank >= self.min_pages_per_rank
        if self.early:
            self._launch(0)

    def end(self) -> None:
        self.plan = None
        self._ready, self._current = {}, None

    def acquire(self, layer: int) -> LayerView:
        """The dense view of `layer` with its history in place (the chunk's rows are the caller's
        to add). Layers are acquired in increasing order (a layer may be skipped, never revisited
        once a later one was acquired: the double buffer holds two). The first call per layer
        launches layer + 1 when prefetching; every call makes the current stream wait for the
        layer's history."""
        if self.plan is None:
            raise RuntimeError("HistoryPrefetcher.acquire outside a batch (begin was not called)")
        latest = self._current[0] if self._current else -1
        if layer < latest:
            raise RuntimeError(f"layer {layer} acquired after layer {latest}: the double buffer no longer holds it")
        first = layer != latest
        if first:
            if self.early:
                self._launch(layer + 1)
            start = self._event()
            self._launch(layer)  # consume-time fallback: a layer nobody launched is launched here
            self._current = (layer, self._view(layer))
        view = self._current[1]
        ready = self._ready[layer]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        if first and start is not None:
            self.timings.append((layer, start, self._event()))
        return view

    # ---- internals -------------------------------------------------------------------------------
    def _event(self):
        if self.timings is None or self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _view(self, layer: int) -> LayerView:
        latent, index = self._halves[layer % 2]
        n = self.plan.num_dense_pages
        return LayerView(latent[:n], index[:n] if self._has_index(layer) else None)

    def _has_index(self, layer: int) -> bool:
        return bool(self.store.index) and self.store.index[layer].shape[0] > 0

    def _launch(self, layer: int) -> None:
        """Start materializing `layer`'s history into its half (no-op if started or past the end)."""
        if layer in self._ready or layer >= self.store.num_layers:
            return
        if not self.plan.has_history or not self.early or self.stream is None:
            if self.plan.has_history:
                self._fill(layer)  # on the calling stream, in program order
            self._ready[layer] = None
            return
        released = torch.cuda.Event()
        released.record(torch.cuda.current_stream(self.device))  # the calling stream's use of this half so far
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(released)
            self._fill(layer)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._ready[layer] = ready

    def _fill(self, layer: int) -> None:
        latent, index = self._halves[layer % 2]
        plan, group, counter = self.plan, self.group, self.counter
        if self.shard_ready is not None:
            self.shard_ready(layer)
        gather_history_pages(self.store.page_rows(layer), plan, group, latent, counter, "materialize_latent")
        if self._has_index(layer):
            gather_history_pages(self.store.index[layer], plan, group, index, counter, "materialize_index")
