"""SGLang's KV sharding admits DSA on the Hopper path. Mirrors `sglang/srt/arg_groups/kv_shard_hook.py`.

Target: `kv_shard_hook.validate_kv_shard_attention_backend` (AROUND). Its DSA branch admits only
the `trtllm` prefill and decode backends with fp8_e4m3 KV (Blackwell). With the flag validated,
the plugin's start-up checks (`parallel_hook.find_problems`) have checked what that branch checks,
for the Hopper path: interleave prefill CP > 1, PP 1, CUDA, `--dsa-prefill-backend
flashmla_sparse` or `flashmla_sparse_q8`, bf16 or fp8_e4m3 KV, page 64, Mooncake, no layer split, index_kpool 1. So the
branch is skipped; every other check of `handle_kv_cache_sharding` runs as in SGLang. Without the
flag SGLang's check runs unchanged.
"""

from __future__ import annotations

from sglang_nsa_cp.sglang_ext.server_args import ATTR


def validate_kv_shard_attention_backend(original, server_args, cfg=None):
    """AROUND: skip SGLang's backend check once the flag's validation has passed."""
    if getattr(server_args, ATTR, False):
        return None
    return original(server_args, cfg)
