"""CPU, ~15 s: the shared-KV DSA pool's sizing (bf16 and fp8 KV) and the configurator hooks that build it
(sglang_ext/mem_cache/). Its multi-rank behaviour is in test_sglang_ext_ranks.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.dsa_pool import KV_DTYPES, LAYERS, PAGE, no_dcp, pool_kwargs  # noqa: E402

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_logical_capacity_grows_n_times_for_the_same_memory(kv):
    """The pool SGLang builds for N x the tokens occupies what the stock pool of 1 x does, for a
    bf16 pool and for the fp8 pool of 656-byte FlashMLA rows."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    per_rank_tokens = 32 * PAGE
    with no_dcp():
        stock_pool = DSATokenToKVPool(**pool_kwargs(per_rank_tokens, kv))
        stock = stock_pool.get_kv_size_bytes()
        for n in (2, 4, 8):
            pool = SharedKVDSATokenToKVPool(
                **pool_kwargs(n * per_rank_tokens, kv), cp_rank=n - 1, cp_size=n, cp_group=None
            )
            assert pool.size == n * per_rank_tokens
            # the shard has the stock pool's row format (what PD registers and sends)
            assert pool.dsa_kv_cache_store_fp8 == stock_pool.dsa_kv_cache_store_fp8 == (kv == "fp8")
            assert (pool.kv_buffer[0].dtype, pool.kv_buffer[0].shape[1:]) == (
                stock_pool.kv_buffer[0].dtype,
                stock_pool.kv_buffer[0].shape[1:],
            )
            assert (
                pool.get_contiguous_buf_infos()[2]
                == stock_pool.get_contiguous_buf_infos()[2]
                == [PAGE * KV_DTYPES[kv][2]] * LAYERS
            )
            # ceil((32n + 1) / n) + 1 trash = 34 local pages vs the stock 33
            assert pool.get_kv_size_bytes() / stock == pytest.approx(34 / 33), f"{n=}"


def test_derive_pool_sizes_hook_scales_the_logical_capacity():
    from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_nsa_cp.envs import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import derive_pool_sizes

    sizes = _PoolSizes(
        max_total_num_tokens=640, max_running_requests=8, full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
        c4_max_total_num_tokens=0, c128_max_total_num_tokens=0, c4_state_pool_size=0, c128_state_pool_size=0,
        c4_state_dtype=None, c128_state_dtype=None,
    )  # fmt: skip
    dsa = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    target = SimpleNamespace(is_draft_worker=False, model_config=SimpleNamespace(hf_config=dsa))
    # An EAGLE (MTP) draft is sized from the target's unmultiplied config and must span the same
    # logical slots; other drafts are refused at start-up and left alone here.
    mtp_draft = SimpleNamespace(
        is_draft_worker=True, model_config=target.model_config, spec_algorithm=SpeculativeAlgorithm.EAGLE
    )
    eagle3_draft = SimpleNamespace(**{**vars(mtp_draft), "spec_algorithm": SpeculativeAlgorithm.EAGLE3})
    original = lambda self, *, config: sizes  # noqa: E731
    with get_parallel().override(attn_cp_size=4), _hicache(False):
        with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
            assert derive_pool_sizes(original, target, config=None).max_total_num_tokens == 4 * 640
            assert derive_pool_sizes(original, mtp_draft, config=None).max_total_num_tokens == 4 * 640
            assert derive_pool_sizes(original, eagle3_draft, config=None) is sizes
        with envs.SGLANG_NSA_CP_SHARED_KV.override(False):
            assert derive_pool_sizes(original, target, config=None) is sizes
    # with HiCache the owner-classed allocator widens the per-rank count itself (one widening)
    with get_parallel().override(attn_cp_size=4), _hicache(True), envs.SGLANG_NSA_CP_SHARED_KV.override(True):
        assert derive_pool_sizes(original, target, config=None) is sizes


def _configurator(context_len=1000, kv="bf16"):
    dsa = SimpleNamespace(
        architectures=["GlmMoeDsaForCausalLM"], index_topk=2048, kv_lora_rank=512, qk_rope_head_dim=64
    )
    model_config = SimpleNamespace(hf_config=dsa, context_len=context_len, kv_lora_rank=512, qk_rope_head_dim=64)
    return SimpleNamespace(
        is_draft_worker=False, model_config=model_config, page_size=PAGE, kv_cache_dtype=KV_DTYPES[kv][0]
    )


@contextmanager
def _hicache(on: bool):
    """`--enable-hierarchical-cache` as the scheduler process sees it (and a PD prefill)."""
    from unittest import mock

    with (
        mock.patch("sglang.srt.runtime_context.get_memory", lambda: SimpleNamespace(enable_hierarchical_cache=on)),
        mock.patch("sglang.srt.runtime_context.get_disagg", lambda: SimpleNamespace(disaggregation_mode="prefill")),
    ):
        yield


@contextmanager
def _chunked_prefill(size):
    from unittest import mock

    with mock.patch("sglang.srt.runtime_context.get_schedule", lambda: SimpleNamespace(chunked_prefill_size=size)):
        yield


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_build_dsa_kv_pool_hook_builds_the_shared_pool_for_this_cp_rank(kv):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_nsa_cp.envs import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import build_dsa_kv_pool, scratch_bytes
    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    configurator = _configurator(context_len=1000, kv=kv)

    def original(self, *, max_total_num_tokens, max_running_requests, dsa_pool_class):
        return dsa_pool_class(**pool_kwargs(max_total_num_tokens, kv))  # what SGLang's builder does

    cp_group = SimpleNamespace(device_group="the CP device group")
    with no_dcp(), envs.SGLANG_NSA_CP_SHARED_KV.override(True), _chunked_prefill(200), _hicache(False):
        with get_parallel().override(attn_cp_rank=2, attn_cp_size=4, attn_cp_group=cp_group):
            pool = build_dsa_kv_pool(
                original,
                configurator,
                max_total_num_tokens=8 * PAGE,
                max_running_requests=4,
                dsa_pool_class=DSATokenToKVPool,
            )
            assert isinstance(pool, SharedKVDSATokenToKVPool)
            assert (pool.cp_rank, pool.cp_size, pool.cp_group) == (2, 4, "the CP device group")
            # scratch reserved at start-up: one 1000-token context (16 pages, 4 per rank) + a
            # 200-token chunk (4 pages) + the trash page, in each of two halves
            page_bytes = PAGE * (KV_DTYPES[kv][2] + 132)
            assert pool.prefetcher.scratch_bytes() == 2 * (16 + 4 + 1) * page_bytes
            # an EAGLE (MTP) draft worker gets its own shard with the same owners and scratch
            draft = SimpleNamespace(
                **{**vars(configurator), "is_draft_worker": True, "spec_algorithm": SpeculativeAlgorithm.EAGLE}
            )
            draft_pool = build_dsa_kv_pool(
                original, draft, max_total_num_tokens=8 * PAGE, max_running_requests=4, dsa_pool_class=DSATokenToKVPool
            )
            assert isinstance(draft_pool, SharedKVDSATokenToKVPool) and draft_pool.store is not pool.store
            assert (draft_pool.cp_rank, draft_pool.cp_size, draft_pool.size) == (2, 4, pool.size)
            assert draft_pool.prefetcher.scratch_bytes() == pool.prefetcher.scratch_bytes()
            # the charge against the KV budget is what the pool reserves
            with get_parallel().override(attn_cp_size=4):
                assert (
                    scratch_bytes(lambda kvc, *, include_mtp=False: 0, configurator) == pool.prefetcher.scratch_bytes()
                )
            with pytest.raises(RuntimeError, match="instead of the shared-KV pool"):
                build_dsa_kv_pool(
                    lambda self, **kw: DSATokenToKVPool(**pool_kwargs(8 * PAGE)),
                    configurator, max_total_num_tokens=8 * PAGE, max_running_requests=4, dsa_pool_class=DSATokenToKVPool,
                )  # fmt: skip


def test_with_hicache_the_pool_gets_sglangs_owner_classed_allocator_widened_once():
    """--enable-hierarchical-cache: the per-rank count stays SGLang's, the pool gets the logical
    size, and SGLang's `PageInterleavePoolAllocator` widens the count to the same logical size,
    which is what SGLang's scheduler reports (per-rank count x `page_interleave_shard_size`)."""
    from sglang.srt.mem_cache.allocator.page_interleave import (
        PageInterleavePoolAllocator,
        page_interleave_shard_size,
    )
    from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.envs import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import build_allocator, build_dsa_kv_pool

    per_rank = 8 * PAGE
    configurator = SimpleNamespace(**vars(_configurator()), device="cpu")
    stock = object()

    def original_allocator(self, **kw):
        return stock

    def original_pool(self, *, max_total_num_tokens, max_running_requests, dsa_pool_class):
        return dsa_pool_class(**pool_kwargs(max_total_num_tokens))

    sizes = _PoolSizes(
        max_total_num_tokens=per_rank, max_running_requests=8, full_max_total_num_tokens=None,
        swa_max_total_num_tokens=None, c4_max_total_num_tokens=0, c128_max_total_num_tokens=0, c4_state_pool_size=0,
        c128_state_pool_size=0, c4_state_dtype=None, c128_state_dtype=None,
    )  # fmt: skip
    cp = SimpleNamespace(device_group="the CP device group")
    kw = dict(sizes=sizes, is_dsv4_model=False, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    with no_dcp(), envs.SGLANG_NSA_CP_SHARED_KV.override(True), _chunked_prefill(200), _hicache(True):
        with get_parallel().override(attn_cp_rank=1, attn_cp_size=4, attn_cp_group=cp):
            pool = build_dsa_kv_pool(
                original_pool, configurator, max_total_num_tokens=per_rank, max_running_requests=4,
                dsa_pool_class=DSATokenToKVPool,
            )  # fmt: skip
            assert pool.size == 4 * per_rank and pool.host_capacity_tokens == per_rank
            allocator = build_allocator(original_allocator, configurator, token_to_kv_pool=pool, **kw)
    assert isinstance(allocator, PageInterleavePoolAllocator), type(allocator)
    assert allocator.size == pool.size, f"allocator {allocator.size} vs pool {pool.size} logical slots"
    assert (allocator.shard_size, allocator.page_size, allocator.shard_spec) == (4, PAGE, None)
    assert per_rank * page_interleave_shard_size(allocator) == pool.size  # what the scheduler reports
    # every page it hands out is a local page the rank's shard holds
    top = int(torch.cat(allocator.class_free_pages).max())
    assert top < pool.num_logical_pages, f"logical page {top} past the pool's {pool.num_logical_pages}"
    assert top // 4 < pool.store.local_pages - 1, f"logical page {top} past the shard's {pool.store.local_pages}"
    # without HiCache, or without the flag: SGLang's own allocator
    with envs.SGLANG_NSA_CP_SHARED_KV.override(True), _hicache(False):
        assert build_allocator(original_allocator, configurator, token_to_kv_pool=pool, **kw) is stock
    with envs.SGLANG_NSA_CP_SHARED_KV.override(False), _hicache(True):
        assert build_allocator(original_allocator, configurator, token_to_kv_pool=pool, **kw) is stock


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_scratch_is_charged_against_the_kv_budget(kv):
    """SGLang subtracts `compute_page_shard_scratch_bytes` from the KV budget before sizing the
    pool; the hook adds the shared pool's two dense views (bf16 or fp8 latent + index pages)."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.envs import envs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import scratch_bytes

    original = lambda kvc, *, include_mtp=False: 4096  # noqa: E731  (SGLang's own, e.g. another sharded pool)
    page_bytes = PAGE * (KV_DTYPES[kv][2] + 132)
    with get_parallel().override(attn_cp_size=2), _chunked_prefill(8192):
        with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
            # 128k context: 2048 history pages + a 128-page chunk + the trash page, two halves
            assert scratch_bytes(original, _configurator(131072, kv)) == 4096 + 2 * (2048 + 128 + 1) * page_bytes
            # with an EAGLE (MTP) draft SGLang asks the target for both pools' scratch
            assert (
                scratch_bytes(original, _configurator(131072, kv), include_mtp=True)
                == 4096 + 2 * 2 * (2048 + 128 + 1) * page_bytes
            )
            draft = SimpleNamespace(
                **{**vars(_configurator()), "is_draft_worker": True, "spec_algorithm": SpeculativeAlgorithm.EAGLE}
            )
            assert scratch_bytes(original, draft) == 4096
        with envs.SGLANG_NSA_CP_SHARED_KV.override(False):
            assert scratch_bytes(original, _configurator(131072)) == 4096


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
