"""GPU, 1 x H200, ~2 min: why the plugin's pool does not override SGLang's batch start
(`begin_shard_extend`) for scratch row 0 in a batch without history
(sglang_ext/mem_cache/page_interleave_pool.py), with FlashMLA's real sparse prefill kernel.

In such a batch nothing writes scratch row 0, and SGLang's DSA readers name it for masked (-1)
top-k entries. CP=2 ranks (over NCCL; sharing GPU 0 on one GPU, `helpers.distributed.nccl_device`)
run the first batch of the GPU correctness scenario (two cold prompts, 4,072 tokens, no cached
history) through SGLang's DSA forward on CUDA (test/helpers/sglang_gpu_row0.py) over SGLang's
replicated pool, SGLang's own page-interleaved class and the plugin's subclass, both sharded
scratches NaN as the batch begins. Both sharded pools' logits must equal replicated CP bit for
bit (measured on 1 x H200, 2026-12-02, bf16 and fp8). Runs only with CUDA and the GPU bundle
(docs/gpu_bundle.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

from helpers.distributed import run_ranks  # noqa: E402
from helpers.gpu_only import NEEDS_CUDA_AND_THE_BUNDLE  # noqa: E402

register_cuda_ci(est_time=120, suite="nsa-cp-test-1-gpu-h200")

pytestmark = NEEDS_CUDA_AND_THE_BUNDLE

SGLANG_MODULE = "sglang.srt.mem_cache.page_interleave_pool"
PLUGIN_MODULE = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool"


@pytest.fixture(scope="module", params=["bfloat16", "fp8_e4m3"])
def ranks(request):
    from helpers import sglang_gpu_harness as G
    from helpers.sglang_gpu_row0 import run_poisoned_batch_without_history

    path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), G.GLM5_ATTN)
    return request.param, run_ranks(run_poisoned_batch_without_history, 2, args=(path, request.param),
                                    backend="nccl", timeout_s=900)  # fmt: skip


def test_each_pool_is_the_class_it_names_and_the_batch_has_no_history(ranks):
    kv, results = ranks
    for rank, r in enumerate(results):
        assert r["sglang_pool"]["pool_module"] == SGLANG_MODULE, f"{kv}, {rank=}"
        assert r["shared"]["pool_module"] == PLUGIN_MODULE, f"{kv}, {rank=}"
        assert not r["sglang_pool"]["history"] and not r["shared"]["history"], f"{kv}, {rank=}"


def test_the_plugins_pool_equals_replicated_cp_with_a_poisoned_scratch(ranks):
    kv, results = ranks
    for rank, r in enumerate(results):
        got, want = r["shared"]["logits"], r["replicated"]["logits"]
        assert torch.isfinite(got).all(), f"{kv}, {rank=}: non-finite logits"
        assert torch.equal(got, want), f"{kv}, {rank=}: max diff {float((got - want).abs().max())}"


def test_sglangs_own_class_equals_replicated_cp_with_a_poisoned_scratch(ranks):
    """Why the plugin does not override SGLang's batch start: FlashMLA's kernel skips the masked
    top-k entries that name the unwritten scratch row 0, so its NaN never reaches the logits."""
    kv, results = ranks
    for rank, r in enumerate(results):
        got, want = r["sglang_pool"]["logits"], r["replicated"]["logits"]
        assert torch.isfinite(got).all(), f"{kv}, {rank=}: non-finite logits"
        assert torch.equal(got, want), f"{kv}, {rank=}: max diff {float((got - want).abs().max())}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
