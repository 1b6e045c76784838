"""GPU, 2 x H200, ~4 min: SGLang 0.5.23's own DSA model forward on CUDA with GLM-5's attention
dimensions (test/helpers/sglang_gpu_harness.py), FlashMLA's real sparse prefill kernel, NCCL.

Runs only where CUDA and the GPU bundle are (docs/gpu_bundle.md: `source scripts/gpu_unpack.sh`);
skipped elsewhere. The same batches through CP off (1 GPU), SGLang's replicated interleave CP=2,
and the plugin's shared KV at CP=2 with and without one-layer-ahead prefetch: cold prompts longer
than the indexer's top-k, continuations whose prefix ends mid-page, a batch with a radix hit, a
third chunk and a new request, then a decode step from a pool assembled from the owners' pages.
Replicated and shared CP=2 run again with `--kv-cache-dtype fp8_e4m3` (656-byte FlashMLA rows;
decode on flashmla_kv). Shared KV must equal replicated CP bit for bit (same kernels, same inputs); CP off may differ
from CP by bf16 rounding (docs/sglang_gpu_forward.md says by how much and why).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import importlib.util  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

from sglang_nsa_cp.comm import run_ranks  # noqa: E402

register_cuda_ci(est_time=120, suite="nsa-cp-test-2-gpu-h200")

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("sgl_kernel") is None,
    reason="needs 2 CUDA GPUs and the GPU bundle (docs/gpu_bundle.md)",
)


@pytest.fixture(scope="module")
def runs():
    from helpers import sglang_gpu_harness as G

    path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), G.GLM5_ATTN)
    return {
        name: run_ranks(G.run_check, world, args=(path, mode, prefetch, kv), backend="nccl", timeout_s=900)
        for name, world, mode, prefetch, kv in (
            ("off", 1, "off", False, "bfloat16"),
            ("replicated", 2, "replicated", False, "bfloat16"),
            ("shared", 2, "shared", True, "bfloat16"),
            ("shared-no-prefetch", 2, "shared", False, "bfloat16"),
            ("fp8-replicated", 2, "replicated", False, "fp8_e4m3"),
            ("fp8-shared", 2, "shared", True, "fp8_e4m3"),
        )
    }


@pytest.mark.parametrize("run", ["shared", "shared-no-prefetch"])
def test_shared_kv_equals_replicated_cp_bit_for_bit(runs, run):
    for rank, (r, rep) in enumerate(zip(runs[run], runs["replicated"])):
        assert r["pool"] == "SharedKVDSATokenToKVPool" and rep["pool"] == "DSATokenToKVPool"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"])):
            assert torch.isfinite(got).all(), f"{run}, rank {rank}, batch {b}: non-finite logits"
            assert torch.equal(got, want), f"{run}, rank {rank}, batch {b}: max diff {float((got - want).abs().max())}"
    assert runs["shared"][0]["early"] and not runs["shared-no-prefetch"][0]["early"]


def test_fp8_kv_shared_equals_replicated_cp_bit_for_bit(runs):
    """--kv-cache-dtype fp8_e4m3: the same batches, logits bit for bit, and the decode pool
    assembled from the owners' fp8 pages holds the replicated prefill's bytes (per-layer digests)."""
    for rank, (r, rep) in enumerate(zip(runs["fp8-shared"], runs["fp8-replicated"])):
        assert r["pool_dtype"] == rep["pool_dtype"] == "torch.float8_e4m3fn", f"{rank=}"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"])):
            assert torch.isfinite(got).all(), f"fp8, rank {rank}, batch {b}: non-finite logits"
            assert torch.equal(got, want), f"fp8, rank {rank}, batch {b}: max diff {float((got - want).abs().max())}"
        assert r["decode_pool_digests"] == rep["decode_pool_digests"], f"fp8, rank {rank}: decode pool bytes differ"
    # the fp8 cache is really read: batches with history differ from the bf16 cache's logits
    assert not torch.equal(runs["fp8-replicated"][0]["logits"][1], runs["replicated"][0]["logits"][1])


def test_cp_matches_cp_off_within_bf16_rounding(runs):
    (off,) = runs["off"]
    for b, (cp, ref) in enumerate(zip(runs["replicated"][0]["logits"], off["logits"])):
        scale = float(ref.abs().max())
        diff = float((cp - ref).abs().max())
        print(f"batch {b}: max |CP=2 - CP off| = {diff:.3e} (logits up to {scale:.2f})")
        assert diff <= 0.05 * scale, f"batch {b}: CP=2 differs from CP off by {diff} on logits up to {scale}"


def test_stand_ins_report(runs):
    """Not a check: every stand-in that SGLang reached, with its caller, into the log."""
    for name, ranks in runs.items():
        print(name, ranks[0]["stand_ins"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
