"""The small DSA KV pool the plugin's pool tests build (test/sglang_ext/mem_cache/): SGLang's
`DSATokenToKVPool` constructor arguments on CPU, bf16 or fp8, and its parallel state without DCP."""

from contextlib import contextmanager

import torch

PAGE = 64
LAYERS = 2
KV_DIM = 576
# KV cache dtypes the pool takes: (torch dtype, SGLang's kv_cache_dim, latent bytes per token)
KV_DTYPES = {"bf16": (torch.bfloat16, KV_DIM, 2 * KV_DIM), "fp8": (torch.float8_e4m3fn, 656, 656)}


@contextmanager
def no_dcp():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        yield


def pool_kwargs(size, kv="bf16"):
    dtype, kv_cache_dim, _ = KV_DTYPES[kv]
    return dict(
        size=size,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,  # 656 for fp8: SGLang's FlashMLA row (calculate_mla_kv_cache_dim)
    )
