"""`SharedKVDSATokenToKVPool`: SGLang's DSA pool backed by one rank's shard of a CP group's KV.

Mirrors `sglang/srt/mem_cache/memory_pool.py::DSATokenToKVPool`. Built by the hook in
`kv_cache_configurator.py` when `--enable-nsa-prefill-cp-shared-kv` is on.

N = 4 ranks, page size 64, a logical pool of 12 pages (page 0 is SGLang's padding page):

    logical page   0  1  2  3  4  5  6  7  8  9 10 11
    owner (p % 4)  0  1  2  3  0  1  2  3  0  1  2  3
    local (p // 4) 0  0  0  0  1  1  1  1  2  2  2  2     + one trash page per rank (local 3)

Every rank stores 3 + 1 pages of MLA latent rows and of index K/scale pages
(`shared_kv.KVStore`), a quarter of `DSATokenToKVPool`'s, while SGLang's allocator hands out
logical slots over all 12 pages. `size` is the logical capacity; `kv_buffer` and the index buffers
are the rank's local shards (what `get_contiguous_buf_infos` / `get_state_buf_infos` report).

One extend batch (every call below happens on every CP rank in the same order):

1. `begin_shard_extend` (called by `DeepseekSparseAttnBackend.init_forward_metadata`):
   the dense plan: `shared_kv`'s dense view (owners' history pages as the all-gather lays them
   out, then the chunk's own pages), a logical-page -> dense-page map, and the history layout
   (`shared_kv.build_dense_layout`).
2. `translate_loc_to_scratch(page_table)`: SGLang rewrites the attention page table to dense rows.
3. index-K writes (`index_key_cache.write_targets`, from the indexer): the layer's history index
   pages are materialized (one all-gather of owned pages), then SGLang's own kernel writes the
   chunk's keys into that dense buffer and into the local shard (owned tokens at their local
   slot, the others in the trash page).
4. `set_mla_kv_buffer` (from `forward_extend`, with the chunk's gathered latent): owned rows are
   persisted (`KVStore.write`), the history latent is materialized, the chunk's rows are put on top.
5. `get_key_buffer` / `get_index_k_scale_buffer`: the dense views of step 3 and 4.

This is the contract of SGLang's own logical-page-sharded pools (`PageInterleaveKVPoolMixin`):
`dsa_backend` and `dsa_indexer` already call steps 1-3 for any pool of that type, so the forward
path needs no patch. Only the current layer's dense views are kept.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter
from sglang_nsa_cp.shared_kv import DenseLayout, KVStore, build_dense_layout, debug
from sglang_nsa_cp.shared_kv.materialize import gather_history_pages

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExtendPlan:
    """Per-batch dense plan, identical on every rank (built from mirrored scheduler data)."""

    epoch: int
    page_size: int
    num_dense_pages: int
    page_pos: torch.Tensor  # [num_logical_pages] int64: dense page of each page of the batch, 0 elsewhere
    history: Optional[DenseLayout]  # history-only layout (current_rows empty); None: no cached prefix

    def translate(self, loc: torch.Tensor) -> torch.Tensor:
        """Logical slots -> rows of the dense view (same shape as `loc`, int64)."""
        loc = loc.long()
        return self.page_pos[loc // self.page_size] * self.page_size + loc % self.page_size


def build_extend_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    seq_lens: list[int],
    page_size: int,
    num_logical_pages: int,
    cp_size: int,
    rank: int,
    epoch: int,
) -> ExtendPlan:
    """The dense plan of one extend batch.

    With history, the dense view is `shared_kv.build_dense_layout`'s: owners' history pages where
    the all-gather puts them, then the pages holding only this chunk's tokens; a logical page
    shared by several requests (a cached prefix) is one dense page. Without history, the batch's
    pages request after request. Host work is on lengths only; the page table stays on the device.
    """
    device = req_to_token.device
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    max_pages = max(pages_per_req)
    rows = req_to_token.index_select(0, req_pool_indices.to(device).long())
    page_table = rows[:, : max_pages * page_size : page_size].long() // page_size  # [bs, max_pages]
    counts = torch.tensor(pages_per_req)
    flat_req = torch.repeat_interleave(torch.arange(len(seq_lens)), counts).to(device)
    flat_col = (torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[flat_req.cpu()]).to(device)
    logical = page_table[flat_req, flat_col]
    page_pos = torch.zeros(num_logical_pages, dtype=torch.long, device=device)

    history = None
    if any(prefix_lens):
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        layout = build_dense_layout(page_table, list(prefix_lens), extend_lens, page_size, cp_size, rank)
        page_pos[logical] = layout.dense_page_table[flat_req, flat_col]
        history = dataclasses.replace(layout, current_rows=layout.current_rows[:0])
        num_dense_pages = layout.num_dense_pages
    else:
        page_pos[logical] = torch.arange(logical.numel(), device=device)
        num_dense_pages = logical.numel()
    return ExtendPlan(epoch, page_size, num_dense_pages, page_pos, history)


class SharedKVDSATokenToKVPool(PageInterleaveKVPoolMixin, DSATokenToKVPool):
    """A `DSATokenToKVPool` over one CP rank's owned pages; see the module docstring.

    Takes `DSATokenToKVPool`'s arguments (`size` is the logical capacity in tokens) plus the CP
    group: `cp_rank`, `cp_size` and `cp_group` (a torch.distributed group: SGLang's
    `attn_cp_group.device_group` in a server, gloo in CPU tests).
    """

    def __init__(self, size: int, *args, cp_rank: int, cp_size: int, cp_group: dist.ProcessGroup, **kwargs):
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} is not a rank of a CP group of size {cp_size}")
        unsupported = {
            k: kwargs[k]
            for k, ok in (("index_kpool", 1), ("index_kpool_compress", False), ("dcp_replicated", False), ("index_buf_size", None))
            if k in kwargs and kwargs[k] != ok
        }
        if unsupported:
            raise ValueError(f"SharedKVDSATokenToKVPool does not support {unsupported} yet")
        self.cp_rank, self.cp_size, self.cp_group = cp_rank, cp_size, cp_group
        self.counter: TrafficCounter | None = None  # bytes of the materialize all-gathers, when set
        self._plan: ExtendPlan | None = None
        self._epoch = 0
        self._dense_latent: dict[int, torch.Tensor] = {}
        self._dense_index: dict[int, torch.Tensor] = {}
        self._loc_cache: dict[tuple, torch.Tensor] = {}
        self._checked_epoch = -1
        super().__init__(size, *args, **kwargs)
        logger.info(
            "Shared-KV DSA pool: CP rank %d/%d stores %d of %d logical pages (+1 trash page) per layer",
            cp_rank, cp_size, self.store.local_pages - 1, self.num_logical_pages,
        )

    # ---- storage: the rank's KVStore shard, seen through SGLang's buffer attributes -------------
    @property
    def num_logical_pages(self) -> int:
        return self.size // self.page_size + 1  # SGLang's pool rows are size + page_size

    def _create_buffers(self):
        if self.dsa_kv_cache_store_fp8:
            raise ValueError("SharedKVDSATokenToKVPool stores the bf16 latent only; use --kv-cache-dtype bfloat16")
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            with torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext():
                # One slack local page past every owned one: the trash page non-owned index-K
                # writes land in, so owner filtering needs no host sync.
                self.store = KVStore(
                    num_layers=self.layer_num,
                    num_pages=self.num_logical_pages,
                    page_size=self.page_size,
                    cp_size=self.cp_size,
                    rank=self.cp_rank,
                    latent_dim=self.kv_cache_dim,
                    latent_dtype=self.store_dtype,
                    slack_pages=1,
                    device=self.device,
                )
        self.kv_buffer = [t.unsqueeze(1) for t in self.store.latent]

    def _create_index_key_cache(self):
        from sglang_nsa_cp.sglang_ext.mem_cache.index_key_cache import SharedKVIndexKeyCache

        for i, skip in enumerate(self.skip_topk_layers):
            if skip:  # layers that reuse the previous top-k never store index keys: free their pages
                full = self.store.index[i]
                self.store.index[i] = full.new_empty((0, full.shape[1]))
        return SharedKVIndexKeyCache(self)

    @property
    def trash_page(self) -> int:
        return self.store.local_pages - 1

    # ---- the per-batch plan (PageInterleaveKVPoolMixin contract) ---------------------------------
    @property
    def _shard_extend_active(self) -> bool:
        return self._plan is not None

    def begin_shard_extend(self, req_to_token, req_pool_indices, prefix_lens_cpu, seq_lens_cpu) -> None:
        """Build the batch's dense plan. Called once per extend batch, on every rank."""
        self._epoch += 1
        self._dense_latent.clear()
        self._dense_index.clear()
        self._loc_cache.clear()
        self._plan = build_extend_plan(
            req_to_token,
            req_pool_indices,
            [int(n) for n in prefix_lens_cpu],
            [int(n) for n in seq_lens_cpu],
            self.page_size,
            self.num_logical_pages,
            self.cp_size,
            self.cp_rank,
            self._epoch,
        )

    def end_shard_extend(self) -> None:
        self._plan = None
        self._dense_latent.clear()
        self._dense_index.clear()
        self._loc_cache.clear()

    def translate_loc_to_scratch(self, loc: torch.Tensor) -> torch.Tensor:
        """Logical slots -> rows of this batch's dense view."""
        if self._plan is None:
            raise RuntimeError("translate_loc_to_scratch outside an extend batch (begin_shard_extend not called)")
        return self._plan.translate(loc)

    def _cached_loc(self, kind: str, loc: torch.Tensor) -> torch.Tensor:
        """`translate` or `local_rows` of `loc`, once per batch: every layer passes the same
        out_cache_loc tensor. Keyed by the tensor object, which the cache keeps alive until the
        batch ends, so a freed temporary's id or memory can never alias another loc tensor."""
        hit = self._loc_cache.get((kind, id(loc)))
        if hit is not None and hit[0] is loc:
            return hit[1]
        out = self._plan.translate(loc) if kind == "dense" else self.local_rows(loc)
        self._loc_cache[(kind, id(loc))] = (loc, out)
        return out

    def local_rows(self, loc: torch.Tensor) -> torch.Tensor:
        """Local shard row of each logical slot; slots of other owners go to the trash page."""
        rows = kernels.owned_physical_rows(loc.long(), self.cp_rank, self.cp_size, self.page_size)
        return torch.where(rows >= 0, rows, self.trash_page * self.page_size + loc.long() % self.page_size)

    def _check_batch_slots(self, loc: torch.Tensor) -> None:
        """Once per batch: slots inside the logical pool; with SGLANG_NSA_CP_DEBUG=1, one owner each."""
        if self._checked_epoch == self._epoch:
            return
        self._checked_epoch = self._epoch
        self.store.check_slots(loc)
        if debug.ENABLED:
            debug.check_write_coverage(self.store, loc, self.cp_group)

    def _history_pages(self, pages: torch.Tensor, kind: str) -> torch.Tensor:
        """[num_dense_pages, page row] of one layer: owners' history pages gathered (a collective on
        every rank) or, without history, an empty buffer the chunk's rows fill."""
        plan = self._plan
        if plan.history is None:
            return pages.new_empty((plan.num_dense_pages, pages.shape[1]))
        return gather_history_pages(pages, plan.history, self.cp_group, self.counter, kind)

    # ---- MLA latent ------------------------------------------------------------------------------
    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        """Persist the owned rows of the chunk; during an extend, also materialize the layer's dense
        latent (history of the owners + this chunk). `cache_k_*` hold the whole chunk (SGLang's CP
        strategy all-gathers it before the write), identical on every rank."""
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local_layer = layer_id - self.start_layer
        if cache_k_nope.shape[0] != loc.shape[0] or cache_k_rope.shape[0] != loc.shape[0]:
            raise ValueError(
                f"set_mla_kv_buffer got {cache_k_nope.shape[0]} latent rows for {loc.shape[0]} slots; the "
                "shared-KV pool needs the whole chunk (gathered by the CP strategy) at out_cache_loc"
            )
        rows = torch.cat([cache_k_nope.reshape(loc.shape[0], -1), cache_k_rope.reshape(loc.shape[0], -1)], dim=1)
        rows = rows.to(self.dtype).view(self.store_dtype)
        if self._plan is None:
            self.store.write(local_layer, loc, rows)
            return
        self._check_batch_slots(loc)
        self.store.write(local_layer, loc, rows)
        dense = self._history_pages(self.store.page_rows(local_layer), "materialize_latent")
        dense = dense.view(-1, self.kv_cache_dim)
        kernels.scatter_rows(dense, self._cached_loc("dense", loc), rows)
        self._dense_latent.clear()  # keep only the current layer's view
        self._dense_latent[layer_id] = dense.unsqueeze(1)

    def dense_latent(self, layer_id: int) -> torch.Tensor:
        dense = self._dense_latent.get(layer_id)
        if dense is None:
            raise RuntimeError(
                f"layer {layer_id}'s latent KV was read before it was written in this extend batch; the "
                "shared-KV pool materializes the dense view in set_mla_kv_buffer (save_kv_cache=False "
                "is not supported)"
            )
        return dense

    def get_key_buffer(self, layer_id: int):
        if self._plan is None:
            return super().get_key_buffer(layer_id)
        return self.dense_latent(layer_id)

    def get_value_buffer(self, layer_id: int):
        if self._plan is None:
            return super().get_value_buffer(layer_id)
        return self.dense_latent(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer_shape(self):
        k = self.kv_buffer[0]  # shape probes must not touch the per-batch views
        return k.shape, k[..., : self.kv_lora_rank].shape

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        if self._plan is None:
            raise RuntimeError("the shared-KV pool reads logical rows only inside an extend batch")
        kv = self.dense_latent(layer.layer_id)[self._cached_loc("dense", loc)]
        kv = kv.to(dst_dtype or self.dtype)
        return kv[..., : self.kv_lora_rank].contiguous(), kv[..., self.kv_lora_rank :].contiguous()

    # ---- index K: see SharedKVIndexKeyCache --------------------------------------------------------
    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        # During an extend the paged readers get the dense pages; their page tables are dense too.
        return self.index_key_cache.get_buffer(layer_id)

    def dense_index(self, layer_id: int) -> torch.Tensor:
        """The layer's dense index pages [num_dense_pages, page_size * 132], materialized on the
        layer's first index write of the batch (a collective: every rank writes every layer)."""
        dense = self._dense_index.get(layer_id)
        if dense is None:
            pages = self.store.index[layer_id - self.start_layer]
            dense = self._history_pages(pages, "materialize_index")
            self._dense_index.clear()
            self._dense_index[layer_id] = dense
        return dense

    # ---- what a sharded pool cannot do (yet) -------------------------------------------------------
    def set_kv_buffer(self, *args, **kwargs):
        raise NotImplementedError("the shared-KV DSA pool is written through set_mla_kv_buffer")

    def move_kv_cache(self, tgt_loc, src_loc):
        raise NotImplementedError("moving KV between slots needs a transfer between page owners (speculative decoding is not supported)")

    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("CPU offload of a shared-KV pool is not supported (each rank holds only its own pages)")

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("CPU restore of a shared-KV pool is not supported (each rank holds only its own pages)")
