"""The plugin's pool subclass only with the flag. Mirrors `sglang/srt/mem_cache/kv_cache_configurator.py`.

Target: `KVCacheConfigurator._build_token_to_kv_pool` (AFTER), which builds every scheduler's KV
pool, the target's and an MTP draft's (`_build_dsa_kv_pool`, `_build_mtp_kv_shard_pool`). On a
shared-KV prefill (the flag, resolved) a pool that is exactly SGLang's page-interleaved DSA pool
becomes the plugin's subclass (`page_interleave_pool.PageInterleaveDSATokenToKVPool`, which adds no
state: its class is switched on the built object). Everywhere else, SGLang's own
`--enable-kv-cache-sharding` on Blackwell included, the pool stays SGLang's class.
"""

from __future__ import annotations

from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool as SGLangPool

from sglang_nsa_cp.sglang_ext.server_args import is_enabled


def adopt_sharded_dsa_pool(pool, *args, **kwargs):
    """AFTER `_build_token_to_kv_pool`: SGLang's sharded DSA pool as the plugin's subclass, with the flag."""
    if type(pool) is SGLangPool and is_enabled():
        from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

        pool.__class__ = PageInterleaveDSATokenToKVPool
    return pool
