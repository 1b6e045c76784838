"""SGLang's page-interleaved DSA pool with the Hopper delta. Mirrors
`sglang/srt/mem_cache/page_interleave_pool.py`.

A subclass of SGLang's `page_interleave_pool.PageInterleaveDSATokenToKVPool` that adds no state:
with `--enable-nsa-prefill-cp-shared-kv` the pool SGLang builds (for the target worker and an MTP
draft) becomes this class (`kv_cache_configurator.py`'s hook); without the flag SGLang's name and
every pool it builds stay SGLang's class (test_page_interleave_pool.py checks pool and scratch).

N = 2, page 64, SGLang's placement (`page_interleave.PageInterleavePlacement`):

    logical page    0  1 | 2  3 | 4  5 | 6  7      (pages 0..N-1: SGLang's padding pages)
    owner (p % 2)   0  1 | 0  1 | 0  1 | 0  1
    local (p // 2)  0  0 | 1  1 | 2  2 | 3  3

    an extend's scratch slot, one layer:  [ prefix, owner-major | chunk | trash page ]

What it changes, for a measured reason (docs/sglang_plugin.md):
- an fp8 pool (FlashMLA's 656-byte rows) quantizes a chunk once and stores the scratch and owned
  rows in one pass (`kernels.store_mla_fp8_owned_and_scratch`, bit-equal to SGLang's quantizer):
  SGLang's pool quantizes it for the scratch and again for the owned rows
  (`quantize_k_cache_separate` twice per layer, then two row scatters).

SGLang's batch start (`begin_shard_extend`) is used as it is: in a batch without cached history
its scratch row 0 holds whatever the last batch or the allocator left, and SGLang's DSA readers
name it only for masked (-1) top-k entries, which FlashMLA's kernel skips. On 1 x H200 with the
real kernel, SGLang's pool with a NaN-poisoned scratch gives replicated CP's logits bit for bit,
bf16 and fp8 (test_row0_gpu.py, 2026-12-02); an earlier CPU finding of NaN there came from
FlashMLA's stand-in, which read row 0 for masked entries and is now faithful.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool as SGLangPool

from sglang_nsa_cp import kernels


class PageInterleaveDSATokenToKVPool(SGLangPool):
    """`PageInterleaveDSATokenToKVPool` with the override of the module docstring (no state of its own)."""

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override: Optional[int] = None):
        """Stage the whole chunk into the layer's scratch slot and persist the owned rows, from one
        quantization in one pass (fp8: `kernels.store_mla_fp8_owned_and_scratch`, SGLang's
        rounding); bf16 rows go through SGLang's path unchanged."""
        if not self.dsa_kv_cache_store_fp8:
            return super().set_mla_kv_buffer(layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override)
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        scratch = self._slots[layer_id % 2].tensors["kv"]
        if self._shard_extend_active:
            scratch_rows = self._translate_loc_cached(loc)
        else:  # a write outside an extend persists the owned rows only
            scratch_rows = torch.full_like(loc, -1)
        kernels.store_mla_fp8_owned_and_scratch(
            scratch.view(-1, self.kv_cache_dim),
            scratch_rows,
            self.kv_buffer[layer_id - self.start_layer].view(-1, self.kv_cache_dim),
            loc,
            cache_k_nope,
            cache_k_rope,
            self.shard_rank,
            self.shard_size,
            self.page_size,
        )
