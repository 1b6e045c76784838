"""CPU, ~15 s: the shared-KV DSA pool's sizing and the configurator hooks that build it
(sglang_ext/mem_cache/). Its multi-rank behaviour is in test_sglang_ext_ranks.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from contextlib import contextmanager  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


PAGE = 64
LAYERS = 2
KV_DIM = 576


@contextmanager
def _no_dcp():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        yield


def _pool_kwargs(size):
    return dict(
        size=size,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=KV_DIM,
    )


def test_logical_capacity_grows_n_times_for_the_same_memory():
    """The pool SGLang builds for N x the tokens occupies what the stock pool of 1 x does."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    per_rank_tokens = 32 * PAGE
    with _no_dcp():
        stock = DSATokenToKVPool(**_pool_kwargs(per_rank_tokens)).get_kv_size_bytes()
        for n in (2, 4, 8):
            pool = SharedKVDSATokenToKVPool(**_pool_kwargs(n * per_rank_tokens), cp_rank=n - 1, cp_size=n, cp_group=None)
            assert pool.size == n * per_rank_tokens
            # ceil((32n + 1) / n) + 1 trash = 34 local pages vs the stock 33
            assert pool.get_kv_size_bytes() / stock == pytest.approx(34 / 33), f"{n=}"


def test_derive_pool_sizes_hook_scales_the_logical_capacity():
    from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.sglang_ext.environ import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import derive_pool_sizes

    sizes = _PoolSizes(
        max_total_num_tokens=640, max_running_requests=8, full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
        c4_max_total_num_tokens=0, c128_max_total_num_tokens=0, c4_state_pool_size=0, c128_state_pool_size=0,
        c4_state_dtype=None, c128_state_dtype=None,
    )  # fmt: skip
    dsa = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    target = SimpleNamespace(is_draft_worker=False, model_config=SimpleNamespace(hf_config=dsa))
    draft = SimpleNamespace(is_draft_worker=True, model_config=target.model_config)
    original = lambda self, *, config: sizes  # noqa: E731
    with get_parallel().override(attn_cp_size=4):
        with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
            assert derive_pool_sizes(original, target, config=None).max_total_num_tokens == 4 * 640
            assert derive_pool_sizes(original, draft, config=None).max_total_num_tokens == 640
        with envs.SGLANG_NSA_CP_SHARED_KV.override(False):
            assert derive_pool_sizes(original, target, config=None) is sizes


def test_build_dsa_kv_pool_hook_builds_the_shared_pool_for_this_cp_rank():
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.sglang_ext.environ import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import build_dsa_kv_pool
    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    dsa = SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"], index_topk=2048)
    configurator = SimpleNamespace(is_draft_worker=False, model_config=SimpleNamespace(hf_config=dsa))

    def original(self, *, max_total_num_tokens, max_running_requests, dsa_pool_class):
        return dsa_pool_class(**_pool_kwargs(max_total_num_tokens))  # what SGLang's builder does

    cp_group = SimpleNamespace(device_group="the CP device group")
    with _no_dcp(), envs.SGLANG_NSA_CP_SHARED_KV.override(True):
        with get_parallel().override(attn_cp_rank=2, attn_cp_size=4, attn_cp_group=cp_group):
            pool = build_dsa_kv_pool(original, configurator, max_total_num_tokens=8 * PAGE, max_running_requests=4, dsa_pool_class=DSATokenToKVPool)
            assert isinstance(pool, SharedKVDSATokenToKVPool)
            assert (pool.cp_rank, pool.cp_size, pool.cp_group) == (2, 4, "the CP device group")
            with pytest.raises(RuntimeError, match="instead of the shared-KV pool"):
                build_dsa_kv_pool(
                    lambda self, **kw: DSATokenToKVPool(**_pool_kwargs(8 * PAGE)),
                    configurator, max_total_num_tokens=8 * PAGE, max_running_requests=4, dsa_pool_class=DSATokenToKVPool,
                )  # fmt: skip
