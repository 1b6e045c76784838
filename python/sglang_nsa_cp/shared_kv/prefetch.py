"""One-layer-ahead prefetch of history: materialize layer L+1's cached prefix while layer L runs.

History pages of every layer exist before the batch starts, so their gather does not depend on
the layer's input. While layer L computes, layer L+1's history (MLA latent and index K/scale) is
packed, all-gathered and scattered into the other half of a double-buffered dense scratch on a
side stream; layer L+1 waits on an event only when it consumes that buffer, then adds its own
chunk's rows on the main stream.

- Index and MLA collectives go on one side stream, in one order, on every rank.
- A consumer whose layer was never launched launches it itself (never reads stale data).
- A side-stream write into a scratch half first waits for the main stream to finish the layer
  that read it last.
- The main stream may persist layer L's chunk rows into the shard while the side stream packs
  layer L's history pages: only a prefix page ending mid-page is touched by both, and only in
  rows that `consume` then overwrites with the chunk's values, so either order gives one result.
- Small prefixes skip prefetch (materialize in place at consume time): decided from the layout,
  which every rank shares.
- On CPU there are no streams: the same calls run synchronously.

The original design's Phase 8 prefetch (`cp_shared_kv_prefetch`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_nsa_cp.comm import TrafficCounter
from sglang_nsa_cp.shared_kv.materialize import DenseLayout, add_current_index, add_current_latent, gather_history_pages
from sglang_nsa_cp.shared_kv.store import KVStore

# Below this many history pages per rank, an early launch costs more than it hides.
MIN_PAGES_PER_RANK = 2


class HistoryPrefetcher:
    """Double-buffered dense scratch for one batch, filled one layer ahead."""

    def __init__(
        self,
        store: KVStore,
        layout: DenseLayout,
        group: dist.ProcessGroup,
        counter: TrafficCounter | None = None,
        enabled: bool = True,
        min_pages_per_rank: int = MIN_PAGES_PER_RANK,
        timings: list | None = None,
    ):
        if layout.current_reuse:
            raise ValueError("a batch without history has nothing to prefetch; use current reuse")
        self.store, self.layout, self.group, self.counter = store, layout, group, counter
        self.early = enabled and layout.pages_per_rank >= min_pages_per_rank
        device = store.latent[0].device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.early else None
        latent_row = store.page_rows(0).shape[1]
        index_row = store.index[0].shape[1]
        self.latent = [store.latent[0].new_empty((layout.num_dense_pages, latent_row)) for _ in range(2)]
        self.index = [store.index[0].new_empty((layout.num_dense_pages, index_row)) for _ in range(2)]
        # (layer, start, end) CUDA events around each consumer's wait: the exposed materialize time
        self.timings = timings if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event | None] = {}
        self._released: list[torch.cuda.Event | None] = [None, None]

    def scratch_bytes(self) -> int:
        """Memory the scratch holds for the batch (both halves)."""
        return sum(t.numel() * t.element_size() for t in self.latent + self.index)

    def launch(self, layer: int) -> None:
        """Start materializing `layer`'s history into its scratch half (no-op if already started)."""
        if layer in self._ready or layer >= self.store.num_layers:
            return
        half = layer % 2
        if self.stream is None:
            self._fill(layer, half)
            self._ready[layer] = None
            return
        released = torch.cuda.Event()
        released.record()  # the main stream's use of this half so far
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(released)
            self._fill(layer, half)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._ready[layer] = ready

    def _fill(self, layer: int, half: int) -> None:
        gather_history_pages(
            self.store.page_rows(layer), self.layout, self.group, self.counter, "materialize_latent", self.latent[half]
        )
        gather_history_pages(
            self.store.index[layer], self.layout, self.group, self.counter, "materialize_index", self.index[half]
        )

    def consume(
        self, layer: int, current_latent: torch.Tensor, current_key: torch.Tensor, current_scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense view of `layer`: its history plus this chunk's rows (latent rows, index pages).

        Launches the next layer first when prefetch is on, so it overlaps this layer's work; the
        next layer's side-stream work waits for this layer's earlier main-stream work, and runs
        alongside this layer's attention.
        """
        if self.early:
            self.launch(layer + 1)
        if self.timings is not None:  # from here to `end`: what this layer waits for its history
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        self.launch(layer)  # consume-time fallback: a layer nobody launched is launched here
        ready = self._ready.pop(layer)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        if self.timings is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timings.append((layer, start, end))
        half = layer % 2
        latent = add_current_latent(self.latent[half], self.layout, current_latent)
        index = add_current_index(self.index[half], self.layout, current_key, current_scale)
        return latent, index
