"""`SharedKVIndexKeyCache`: the NSA index K/scale pages of one CP rank's shard.

Mirrors `sglang/srt/mem_cache/index_key_cache.py::IndexKeyCache` (same page layout: per 64-token
page, 64 x 128 fp8 key bytes then 64 fp32 scales), with the write/read contract SGLang's indexer
uses for logical-page-sharded pools (`_PageInterleaveIndexKeyCache` in
`mem_cache/page_interleave_pool.py`):

- `write_targets(layer, loc)` -> [(buffer, token slots, rows or None)]: the indexer's own store
  kernels (fused RoPE + quantize + store, or `SetKAndS`) write every target. During an extend the
  targets are the layer's dense pages (`pool.layer_view`: its history landed) at the chunk's dense
  slots, and the local shard at each token's local slot (other owners' tokens go to the trash page).
- `get_k_and_scale(layer, seq_lens, page_indices, ...)` takes logical page ids (the indexer's
  `indexer_logical_page_table`) and reads them from the dense pages.
"""

from __future__ import annotations

from sglang.kernels.ops.kvcache import dsa_index_k_cache
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache


class SharedKVIndexKeyCache(IndexKeyCache):
    def __init__(self, pool):
        # No allocation: the buffers are the pool's KVStore index shards.
        self.pool = pool
        self.buffer = pool.store.index
        self._written: tuple[int, object] | None = None  # (layer id, dense pages) handed to the writers

    def begin_batch(self) -> None:
        """Forget the previous batch's view (the pool calls this at every batch boundary)."""
        self._written = None

    def get_buffer(self, layer_id: int):
        if not self.pool.in_extend:
            return self.get_local_buffer(layer_id)
        return self._kernel_view(self._written_dense(layer_id))

    def _written_dense(self, layer_id: int):
        # Reads never acquire a layer: acquiring launches the next layer's all-gather, a
        # collective, and only writes are known to happen on every rank (a rank without local
        # queries skips the indexer's reads).
        if self._written is None or self._written[0] != layer_id:
            raise RuntimeError(
                f"layer {layer_id}'s index keys were read before they were written in this extend batch; "
                "the shared-KV pool builds the dense index pages at the layer's first index write"
            )
        return self._written[1]

    def get_k_and_scale(self, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        plan = self.pool.plan
        self._written_dense(layer_id)
        return super().get_k_and_scale(
            layer_id, seq_len_tensor, plan.dense_pages(page_indices), seq_len_sum, max_seq_len
        )

    def write_targets(self, layer_id: int, loc):
        if loc.numel() == 0:
            return []
        pool = self.pool
        local = self._kernel_view(self.buffer[layer_id - pool.start_layer])
        if local.shape[0] == 0:
            raise RuntimeError(f"layer {layer_id} reuses the previous layer's top-k and stores no index keys")
        if not pool.in_extend:
            return [(local, pool.local_rows(loc), None)]
        pool.debug_check_slots(loc)
        dense = pool.layer_view(layer_id).index  # the writing stream waits for the layer's history
        self._written = (layer_id, dense)
        return [(self._kernel_view(dense), pool.dense_rows(loc), None), (local, pool.local_rows(loc), None)]

    def store_quantized(self, layer_id, loc, index_k, index_k_scale) -> None:
        for buf, slots, rows in self.write_targets(layer_id, loc):
            dsa_index_k_cache.SetKAndS.execute(
                pool=self.pool,
                buf=buf,
                loc=slots,
                index_k=index_k if rows is None else index_k.index_select(0, rows),
                index_k_scale=index_k_scale if rows is None else index_k_scale.index_select(0, rows),
            )

    def move(self, tgt_loc, src_loc) -> None:
        raise NotImplementedError("moving index keys between slots needs a transfer between page owners")

    def cpu_copy(self, indices):
        raise NotImplementedError("CPU offload of a shared-KV pool is not supported")

    def load_cpu_copy(self, index_k_cpu, indices) -> None:
        raise NotImplementedError("CPU restore of a shared-KV pool is not supported")
