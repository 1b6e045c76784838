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

One extend batch runs the core's code, the same the reference CP path, the oracle and the
benchmark run (every call below happens on every CP rank in the same order):

1. `begin_shard_extend` (called by `DeepseekSparseAttnBackend.init_forward_metadata`): the
   batch's `shared_kv.DensePlan` (where each page sits in the dense view, which history pages
   this rank sends), then `HistoryPrefetcher.begin`, which launches layer 0's history all-gather
   on a side stream.
2. `translate_loc_to_scratch(page_table)`: SGLang rewrites the attention page table to dense rows.
3. A layer's first write (the indexer's index-K store through `index_key_cache.write_targets`,
   or attention's `set_mla_kv_buffer`) acquires the layer's view: the writing stream waits for
   its history to land and layer l+1's history all-gather starts. SGLang's own kernel then writes
   the chunk's index keys into the dense pages and, for owned tokens, into the local shard (the
   others land in one trash page per rank, so owner filtering needs no host sync);
   `set_mla_kv_buffer` persists the owned latent rows (`KVStore.write`) and puts the chunk's rows
   on top of the history.
4. `get_key_buffer` / `get_index_k_scale_buffer` / `get_index_k_with_scale_buffer`: the view.

With `--kv-cache-dtype fp8_e4m3` the latent rows are FlashMLA's 656-byte rows, as in
`DSATokenToKVPool`: `set_mla_kv_buffer` quantizes the chunk once with SGLang's own quantizer, the
shard and the dense view get those bytes, history moves as fp8 pages, and the getters type the
view float8_e4m3fn as SGLang's do (its flashmla_sparse prefill dequantizes a prefix batch's KV
from that view through the dense page table).

This is the contract of SGLang's own logical-page-sharded pools (`PageInterleaveKVPoolMixin`):
`dsa_backend` and `dsa_indexer` already call steps 1-3 for any pool of that type, so the forward
path needs no patch. The scratch holds two layers' dense views (double buffer), reserved at
start-up for one context of history plus one chunk and grown if a batch needs more.
`SGLANG_NSA_CP_PREFETCH=0` materializes each layer when it is first written instead (diagnosis).

For SGLang's owner-sharded HiCache host tier the pool carries `placement` (SGLang's arithmetic for
the same layout) and `host_capacity_tokens` (the rank's rows, which size its host pool), and its
history gather waits for a layer's host load (`layer_transfer_counter`). With HiCache the plugin
builds SGLang's owner-classed allocator over this pool (`kv_cache_configurator.build_allocator`),
which hands out logical pages up to the end of its last row of N: `num_logical_pages` covers them.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.distributed as dist
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache import memory_pool as sglang_memory_pool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc
from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import TrafficCounter
from sglang_nsa_cp.shared_kv import DensePlan, HistoryPrefetcher, KVStore, LayerView, build_dense_plan, debug
from sglang_nsa_cp.envs import envs

logger = logging.getLogger(__name__)


def dense_scratch_pages(context_len: int, chunk_tokens: int, page_size: int, cp_size: int) -> int:
    """Dense pages of a batch holding one full context of history and one chunk: the scratch a
    pool reserves at start-up (owners' history pages evenly spread, one trash page)."""
    history_pages = -(-context_len // page_size)
    return cp_size * -(-history_pages // cp_size) + -(-chunk_tokens // page_size) + 1


class SharedKVDSATokenToKVPool(PageInterleaveKVPoolMixin, DSATokenToKVPool):
    """A `DSATokenToKVPool` over one CP rank's owned pages; see the module docstring.

    Takes `DSATokenToKVPool`'s arguments (`size` is the logical capacity in tokens) plus the CP
    group: `cp_rank`, `cp_size` and `cp_group` (a torch.distributed group: SGLang's
    `attn_cp_group.device_group` in a server, gloo in CPU tests), and `scratch_pages`, the dense
    pages to reserve for the double-buffered scratch at start-up (0: grow on first use).
    """

    def __init__(
        self,
        size: int,
        *args,
        cp_rank: int,
        cp_size: int,
        cp_group: dist.ProcessGroup,
        scratch_pages: int = 0,
        **kwargs,
    ):
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} is not a rank of a CP group of size {cp_size}")
        unsupported = {
            k: kwargs[k]
            for k, ok in (
                ("index_kpool", 1),
                ("index_kpool_compress", False),
                ("dcp_replicated", False),
                ("index_buf_size", None),
            )
            if k in kwargs and kwargs[k] != ok
        }
        if unsupported:
            raise ValueError(f"SharedKVDSATokenToKVPool does not support {unsupported} yet")
        self.cp_rank, self.cp_size, self.cp_group = cp_rank, cp_size, cp_group
        self._plan: DensePlan | None = None
        self._latent_view: tuple[int, torch.Tensor] | None = None  # (layer id, dense rows) with the chunk written
        self._loc_cache: dict[tuple, torch.Tensor] = {}
        self._slots_checked = False
        super().__init__(size, *args, **kwargs)
        # What SGLang's HiCache reads from a page-interleaved pool (docs/sglang_plugin.md, "HiCache"):
        # the placement arithmetic, which is ours (its host-pool assembler wraps the host pool in a
        # PageInterleaveHostPool with it), and the rank's own rows, which size the rank's host pool.
        self.placement = PageInterleavePlacement(
            PageShardSpec(
                shard_rank=cp_rank, shard_size=cp_size, page_size=self.page_size, max_prefix_tokens=0, chunk_tokens=0
            )
        )
        self.host_capacity_tokens = size // cp_size
        self.prefetcher = HistoryPrefetcher(
            self.store, cp_group, enabled=envs.SGLANG_NSA_CP_PREFETCH.get(), shard_ready=self._wait_for_layer_load
        )
        if scratch_pages:
            with self._alloc_context():
                self.prefetcher.reserve(scratch_pages)
        self._reserved_pages = scratch_pages
        logger.info(
            "Shared-KV DSA pool: CP rank %d/%d stores %d of %d logical pages (+1 trash page) per layer; "
            "dense scratch %.1f MiB for %d pages (two layers); prefetch %s",
            cp_rank, cp_size, self.store.local_pages - 1, self.size // self.page_size + 1,  # SGLang's pages
            self.prefetcher.scratch_bytes() / 2**20, scratch_pages, "on" if self.prefetcher.enabled else "off",
        )  # fmt: skip

    def _wait_for_layer_load(self, local_layer: int) -> None:
        """HiCache loads a layer's pages into the shard on its own stream, and the history gather
        reads the shard directly (not through the getters that wait for it): wait first, on the
        gathering stream. No-op without HiCache (no counter registered)."""
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local_layer)

    @property
    def counter(self) -> TrafficCounter | None:
        """Bytes and calls of the history all-gathers, when set (tests, benchmarks)."""
        return self.prefetcher.counter

    @counter.setter
    def counter(self, value: TrafficCounter | None) -> None:
        self.prefetcher.counter = value

    # ---- storage: the rank's KVStore shard, seen through SGLang's buffer attributes -------------
    @property
    def num_logical_pages(self) -> int:
        """SGLang's pool rows (size + page_size) rounded up to whole rows of N pages: SGLang's
        owner-classed allocator (HiCache) hands out pages up to the end of its last row. The
        local pages are the same either way."""
        pages = self.size // self.page_size + 1
        return self.cp_size * -(-pages // self.cp_size)

    def _alloc_context(self):
        return torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext()

    def _create_buffers(self):
        if self.dtype == torch.float8_e4m3fn and not self.dsa_kv_cache_store_fp8:
            raise ValueError(
                "SharedKVDSATokenToKVPool stores bf16 rows or FlashMLA's 656-byte fp8 rows; an fp8 pool with "
                f"the raw {self.kv_cache_dim}-byte row (trtllm's layout) is not supported: use "
                "--dsa-prefill-backend flashmla_sparse"
            )
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), self._alloc_context():
            # One slack local page past every owned one: the trash page non-owned index-K
            # writes land in, so owner filtering needs no host sync.
            self.store = KVStore(
                num_layers=self.layer_num,
                num_pages=self.num_logical_pages,
                page_size=self.page_size,
                cp_size=self.cp_size,
                rank=self.cp_rank,
                latent_dim=self.kv_lora_rank + self.qk_rope_head_dim,
                latent_dtype=self.store_dtype,
                fp8_latent=self.dsa_kv_cache_store_fp8,
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
    def in_extend(self) -> bool:
        """Between `begin_shard_extend` and the next batch boundary: the getters serve the dense view."""
        return self._plan is not None

    @property
    def _shard_extend_active(self) -> bool:  # the name PageInterleaveKVPoolMixin's contract uses
        return self.in_extend

    @property
    def plan(self) -> DensePlan:
        if self._plan is None:
            raise RuntimeError(
                "the shared-KV pool's dense view exists only inside an extend batch (begin_shard_extend not called)"
            )
        return self._plan

    def begin_shard_extend(self, req_to_token, req_pool_indices, prefix_lens_cpu, seq_lens_cpu) -> None:
        """Build the batch's dense plan and launch layer 0's history. Once per extend batch, on every rank."""
        prefix_lens, seq_lens = [int(n) for n in prefix_lens_cpu], [int(n) for n in seq_lens_cpu]
        max_pages = max(-(-n // self.page_size) for n in seq_lens)
        rows = req_to_token.index_select(0, req_pool_indices.to(req_to_token.device).long())
        page_table = rows[:, : max_pages * self.page_size : self.page_size].long() // self.page_size
        self._reset_batch()
        self._plan = build_dense_plan(
            page_table, prefix_lens, seq_lens, page_size=self.page_size, cp_size=self.cp_size,
            rank=self.cp_rank, num_logical_pages=self.num_logical_pages,
        )  # fmt: skip
        if self._plan.num_dense_pages > self.prefetcher.capacity:  # the scratch is about to grow
            logger.warning(
                "Shared-KV DSA pool: a batch needs %d dense pages, more than the %d reserved at start-up; "
                "the scratch grows to %.1f MiB outside the KV budget",
                self._plan.num_dense_pages, self._reserved_pages,
                HistoryPrefetcher.scratch_bytes_for(self.store, self._plan.num_dense_pages) / 2**20,
            )  # fmt: skip
        with self._alloc_context():
            self.prefetcher.begin(self._plan)

    def end_shard_extend(self) -> None:
        self._reset_batch()
        self.prefetcher.end()

    def _reset_batch(self) -> None:
        self._plan = None
        self._latent_view = None
        self.index_key_cache.begin_batch()
        self._loc_cache.clear()
        self._slots_checked = False

    def translate_loc_to_scratch(self, loc: torch.Tensor) -> torch.Tensor:
        """Logical slots -> rows of this batch's dense view."""
        return self.plan.translate(loc)

    def layer_view(self, layer_id: int) -> LayerView:
        """The layer's dense view with its history landed (the calling stream waits for it); the
        first call per layer launches the next layer's history. Every rank calls it for every
        layer in order: through the writes, which every rank makes."""
        return self.prefetcher.acquire(layer_id - self.start_layer)

    def dense_rows(self, loc: torch.Tensor) -> torch.Tensor:
        """Rows of this batch's dense view for logical slots `loc` (once per batch and tensor)."""
        return self._once_per_batch("dense", loc, self.plan.translate)

    def local_rows(self, loc: torch.Tensor) -> torch.Tensor:
        """Local shard row of each logical slot; slots of other owners go to the trash page."""
        return self._once_per_batch("local", loc, self._local_rows) if self.in_extend else self._local_rows(loc)

    def _local_rows(self, loc: torch.Tensor) -> torch.Tensor:
        rows = kernels.owned_physical_rows(loc.long(), self.cp_rank, self.cp_size, self.page_size)
        return torch.where(rows >= 0, rows, self.trash_page * self.page_size + loc.long() % self.page_size)

    def _once_per_batch(self, kind: str, loc: torch.Tensor, fn) -> torch.Tensor:
        """`fn(loc)`, computed once per batch: every layer passes the same out_cache_loc tensor.
        Keyed by the tensor object, which the cache keeps alive until the batch ends, so a freed
        temporary's id or memory can never alias another loc tensor."""
        hit = self._loc_cache.get((kind, id(loc)))
        if hit is not None and hit[0] is loc:
            return hit[1]
        out = fn(loc)
        self._loc_cache[(kind, id(loc))] = (loc, out)
        return out

    def debug_check_slots(self, loc: torch.Tensor) -> None:
        """With SGLANG_NSA_CP_DEBUG=1, once per batch: the written slots lie on the batch's planned
        pages and each has exactly one owner across the group (host reads and a collective).
        Off, nothing runs: the plan's builder already refused pages outside the pool, and a slot
        of SGLang's out_cache_loc is one of the pages its req_to_token (the plan's input) holds."""
        if self._slots_checked or not debug.enabled():
            return
        self._slots_checked = True
        self.plan.check_slots(loc)
        debug.check_write_coverage(self.store, loc, self.cp_group)

    # ---- MLA latent ------------------------------------------------------------------------------
    def stored_rows(self, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> torch.Tensor:
        """The chunk's latent in the pool's row format, [T, kv_cache_dim] of store_dtype: bf16
        rows, or FlashMLA's 656-byte fp8 rows quantized once by SGLang's own quantizer (the one
        `DSATokenToKVPool.set_mla_kv_buffer` calls), so owned, dense and replicated rows are the
        same bytes."""
        t = cache_k_nope.shape[0]
        if self.dsa_kv_cache_store_fp8:
            nope, rope = sglang_memory_pool.quantize_k_cache_separate(cache_k_nope, cache_k_rope)
            return torch.cat([nope.reshape(t, -1), rope.reshape(t, -1)], dim=1)
        rows = torch.cat([cache_k_nope.reshape(t, -1), cache_k_rope.reshape(t, -1)], dim=1)
        return rows.to(self.dtype).view(self.store_dtype)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        """Persist the owned rows of the chunk; during an extend, also put the chunk's rows into the
        layer's dense latent on top of its history. `cache_k_*` hold the whole chunk (SGLang's CP
        strategy all-gathers it before the write), identical on every rank. An fp8 pool quantizes
        the chunk once; the shard and the dense view get the same fp8 bytes."""
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local_layer = layer_id - self.start_layer
        if cache_k_nope.shape[0] != loc.shape[0] or cache_k_rope.shape[0] != loc.shape[0]:
            raise ValueError(
                f"set_mla_kv_buffer got {cache_k_nope.shape[0]} latent rows for {loc.shape[0]} slots; the "
                "shared-KV pool needs the whole chunk (gathered by the CP strategy) at out_cache_loc"
            )
        rows = self.stored_rows(cache_k_nope, cache_k_rope)
        if self._plan is None:
            self.store.write_rows(local_layer, loc, rows)
            return
        self.debug_check_slots(loc)
        view = self.layer_view(layer_id)  # history landed before the shard's mid-page rows change
        self.store.write_rows(local_layer, loc, rows)
        dense = kernels.scatter_rows(view.latent.view(-1, self.kv_cache_dim), self.dense_rows(loc), rows)
        self._latent_view = (layer_id, dense.unsqueeze(1))

    def dense_latent(self, layer_id: int) -> torch.Tensor:
        """The layer's dense latent rows [rows, 1, kv_cache_dim] as SGLang's getters type them
        (an fp8 pool's uint8 bytes viewed as float8_e4m3fn, as `MLATokenToKVPool.get_key_buffer`)."""
        if self._latent_view is None or self._latent_view[0] != layer_id:
            raise RuntimeError(
                f"layer {layer_id}'s latent KV was read before it was written in this extend batch; the "
                "shared-KV pool builds the dense view in set_mla_kv_buffer (save_kv_cache=False is not supported)"
            )
        view = self._latent_view[1]
        return view.view(self.dtype) if self.store_dtype != self.dtype else view

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
        kv = self.dense_latent(layer.layer_id)[self.dense_rows(loc)]
        if self.dsa_kv_cache_store_fp8:  # FlashMLA rows: dequantize (fp32) before the cast
            kv = kernels.dequantize_mla_fp8(kv.view(torch.uint8).flatten(1)).unsqueeze(1)
        kv = kv.to(dst_dtype or (torch.bfloat16 if self.dsa_kv_cache_store_fp8 else self.dtype))
        return kv[..., : self.kv_lora_rank].contiguous(), kv[..., self.kv_lora_rank :].contiguous()

    # ---- index K: see SharedKVIndexKeyCache --------------------------------------------------------
    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        # During an extend the paged readers get the dense pages; their page tables are dense too.
        return self.index_key_cache.get_buffer(layer_id)

    # ---- what a sharded pool cannot do (yet) -------------------------------------------------------
    def set_kv_buffer(self, *args, **kwargs):
        raise NotImplementedError("the shared-KV DSA pool is written through set_mla_kv_buffer")

    def move_kv_cache(self, tgt_loc, src_loc):
        raise NotImplementedError(
            "moving KV between slots needs a transfer between page owners; speculative verify does this "
            "on a decode instance, and this pool serves only a PD prefill"
        )

    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError(
            "CPU offload of a shared-KV pool is not supported (each rank holds only its own pages)"
        )

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError(
            "CPU restore of a shared-KV pool is not supported (each rank holds only its own pages)"
        )
