"""Build the shared-KV DSA pool. Mirrors `sglang/srt/mem_cache/kv_cache_configurator.py`.

Targets (all pass-through unless shared KV is enabled), for the target worker's DSA pool and for
an EAGLE/NEXTN draft worker's (the MTP layer's own DSA pool, docs/speculative.md):
- `KVCacheConfigurator._derive_pool_sizes` (AROUND): SGLang sizes the pool from the bytes one
  rank can spend per token. A shared-KV rank spends them on 1/N of the logical pages, so the same
  budget holds N x the tokens: the logical `max_total_num_tokens` (what the allocator hands out
  and the scheduler reports) is multiplied by attn_cp_size. The per-rank bytes do not change.
  A draft worker is sized from the target's unmultiplied `memory_pool_config`, so it is
  multiplied the same way: both pools span the one allocator's logical slots.
- `KVCacheConfigurator._build_dsa_kv_pool` (AROUND): SGLang's DSA pool class becomes
  `SharedKVDSATokenToKVPool` bound to this rank's CP group, with its dense scratch reserved. The
  draft's pool is its own shard with the target's owners (page p on rank p % N, local page
  p // N): the PD transfer sends the draft's KV entries at the target's owned local page ids.
- `page_interleave.compute_page_shard_scratch_bytes` (AROUND; SGLang's pool sizing subtracts it
  from the KV budget before sizing the pool): adds the shared pool's double-buffered dense scratch
  (two layers' dense views of one context of history plus one chunk), so the scratch is charged
  like SGLang's own sharded pools charge theirs instead of coming out of activation memory. With
  an EAGLE draft (`include_mtp`, SGLang passes it for the target) the draft pool's scratch too.
- `KVCacheConfigurator._build_token_to_kv_pool_allocator` (AROUND; with HiCache only): SGLang's
  owner-classed `PageInterleavePoolAllocator` instead of its stock paged allocator, so that a
  HiCache load-back gets device pages of the owners its host copies live on. That allocator
  widens the per-rank capacity by N itself and SGLang's scheduler then reports N x the per-rank
  count (`page_interleave_shard_size`), so with HiCache `_derive_pool_sizes` leaves the count
  per-rank and `_build_dsa_kv_pool` gives the pool the logical size: widened once either way.
  It gets no `shard_spec`: SGLang's admission then does not gate on SGLang's sharding scratch,
  which this pool does not use (its own is reserved by `compute_page_shard_scratch_bytes`).
"""

from __future__ import annotations

import functools

import msgspec
import torch

from sglang_nsa_cp.kernels.formats import INDEX_ROW_BYTES, MLA_FP8_ROW_BYTES
from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool, dense_scratch_pages
from sglang_nsa_cp.sglang_ext.server_args import is_enabled


def _applies(configurator) -> bool:
    """The target's DSA pool, or an EAGLE draft's (start-up validation refuses other drafts)."""
    if not is_enabled():
        return False
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if configurator.is_draft_worker and configurator.spec_algorithm != SpeculativeAlgorithm.EAGLE:
        return False

    return is_deepseek_dsa(configurator.model_config.hf_config)


def _owner_classed_allocation() -> bool:
    """HiCache on: the target's allocator is SGLang's owner-classed one (start-up validation
    refuses HiCache with a draft, so this is the target's pool)."""
    from sglang.srt.runtime_context import get_memory

    return bool(get_memory().enable_hierarchical_cache)


def derive_pool_sizes(original, self, *, config):
    """AROUND `_derive_pool_sizes`: logical capacity = per-rank capacity x attn_cp_size, unless
    the owner-classed allocator widens it (HiCache)."""
    sizes = original(self, config=config)
    if not _applies(self) or _owner_classed_allocation():
        return sizes
    from sglang.srt.runtime_context import get_parallel

    return msgspec.structs.replace(sizes, max_total_num_tokens=sizes.max_total_num_tokens * get_parallel().attn_cp_size)


def _scratch_pages(configurator) -> int:
    from sglang.srt.runtime_context import get_parallel, get_schedule

    context_len = configurator.model_config.context_len
    chunk = get_schedule().chunked_prefill_size
    chunk = chunk if chunk and chunk > 0 else context_len  # chunked prefill off: one whole prompt
    return dense_scratch_pages(context_len, chunk, configurator.page_size, get_parallel().attn_cp_size)


def scratch_bytes(original, kvc, *, include_mtp: bool = False):
    """AROUND `compute_page_shard_scratch_bytes`: SGLang's fixed scratch plus the shared pool's."""
    extra = original(kvc, include_mtp=include_mtp)
    if not _applies(kvc) or kvc.is_draft_worker:  # a draft's scratch is charged with its target's
        return extra
    model_config = kvc.model_config
    if kvc.kv_cache_dtype == torch.float8_e4m3fn:  # FlashMLA's row, the only fp8 layout the pool takes
        row_bytes = MLA_FP8_ROW_BYTES
    else:
        row_bytes = (model_config.kv_lora_rank + model_config.qk_rope_head_dim) * kvc.kv_cache_dtype.itemsize
    page_bytes = kvc.page_size * (row_bytes + INDEX_ROW_BYTES)
    pools = 2 if include_mtp else 1  # the draft's pool has its own double-buffered scratch
    return extra + pools * 2 * _scratch_pages(kvc) * page_bytes


def build_dsa_kv_pool(original, self, *, max_total_num_tokens, max_running_requests, dsa_pool_class):
    """AROUND `_build_dsa_kv_pool`: build `SharedKVDSATokenToKVPool` for this CP rank."""
    if not _applies(self):
        return original(
            self,
            max_total_num_tokens=max_total_num_tokens,
            max_running_requests=max_running_requests,
            dsa_pool_class=dsa_pool_class,
        )
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if _owner_classed_allocation():  # the count is per-rank (see derive_pool_sizes); the pool's size is logical
        max_total_num_tokens *= parallel.attn_cp_size
    pool_class = functools.partial(
        SharedKVDSATokenToKVPool,
        cp_rank=parallel.attn_cp_rank,
        cp_size=parallel.attn_cp_size,
        cp_group=parallel.attn_cp_group.device_group,
        scratch_pages=_scratch_pages(self),
    )
    pool = original(
        self,
        max_total_num_tokens=max_total_num_tokens,
        max_running_requests=max_running_requests,
        dsa_pool_class=pool_class,
    )
    if not isinstance(pool, SharedKVDSATokenToKVPool):
        raise RuntimeError(
            f"SGLang built {type(pool).__name__} instead of the shared-KV pool: another pool option "
            "(KV sharding, layer split, HiSparse) took precedence; start-up validation should have refused it"
        )
    return pool


def build_allocator(original, self, *, sizes, token_to_kv_pool, token_to_kv_pool_allocator, **kwargs):
    """AROUND `_build_token_to_kv_pool_allocator`: with HiCache, SGLang's owner-classed allocator
    over the shared pool (`sizes.max_total_num_tokens` per rank; it widens by N itself)."""
    if not (_applies(self) and _owner_classed_allocation()) or token_to_kv_pool_allocator is not None:
        return original(
            self, sizes=sizes, token_to_kv_pool=token_to_kv_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator, **kwargs,
        )  # fmt: skip
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.runtime_context import get_disagg

    if not isinstance(token_to_kv_pool, SharedKVDSATokenToKVPool):
        raise RuntimeError(f"expected the shared-KV pool, got {type(token_to_kv_pool).__name__}")
    return PageInterleavePoolAllocator(
        sizes.max_total_num_tokens,
        physical_page_size=self.page_size,
        shard_size=token_to_kv_pool.cp_size,
        dtype=self.kv_cache_dtype,
        device=self.device,
        kvcache=token_to_kv_pool,
        need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),  # as SGLang's own branch
        shard_spec=None,  # no admission gate on SGLang's sharding scratch: the pool reserves its own
    )
