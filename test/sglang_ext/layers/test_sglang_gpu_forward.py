"""GPU, 1 or 2 x H200, ~4.5 min: SGLang 0.5.23's own DSA model forward on CUDA with GLM-5's
attention dimensions (test/helpers/sglang_gpu_harness.py), FlashMLA's real sparse prefill kernel.

Runs only where CUDA and the GPU bundle are (docs/gpu_bundle.md: `source scripts/gpu_unpack.sh`);
skipped elsewhere. The same batches through CP off, SGLang's replicated interleave CP and the
plugin's shared KV (with and without one-layer-ahead prefetch): cold prompts longer than the
indexer's top-k, continuations whose prefix ends mid-page, a batch with a radix hit, a third chunk
and a new request, then a decode step from a pool assembled from the owners' pages. CP=2 and CP=4,
each with bf16 KV and with `--kv-cache-dtype fp8_e4m3` (656-byte FlashMLA rows; decode on
flashmla_kv). Ranks get a GPU each over NCCL where there are enough GPUs; otherwise they share GPU 0
over gloo (`comm_setup`): the same kernels on the same data, so every check holds unchanged, only
the collectives are slower. Shared KV must equal replicated CP bit for bit (same kernels, same
inputs); CP off may differ from CP by bf16 rounding (docs/sglang_gpu_forward.md says by how much).
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

register_cuda_ci(est_time=270, suite="nsa-cp-test-1-gpu-h200")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sgl_kernel") is None,
    reason="needs CUDA and the GPU bundle (docs/gpu_bundle.md)",
)


RUNS = {  # name: (ranks, mode, prefetch, kv_cache_dtype)
    "off": (1, "off", False, "bfloat16"),
    "replicated": (2, "replicated", False, "bfloat16"),
    "shared": (2, "shared", True, "bfloat16"),
    "shared-no-prefetch": (2, "shared", False, "bfloat16"),
    "fp8-replicated": (2, "replicated", False, "fp8_e4m3"),
    "fp8-shared": (2, "shared", True, "fp8_e4m3"),
    # CP=4: more ranks than this machine has GPUs, so they share GPU 0 over gloo (comm_setup)
    "cp4-replicated": (4, "replicated", False, "bfloat16"),
    "cp4-shared": (4, "shared", True, "bfloat16"),
    "cp4-fp8-replicated": (4, "replicated", False, "fp8_e4m3"),
    "cp4-fp8-shared": (4, "shared", True, "fp8_e4m3"),
}


@pytest.fixture(scope="module")
def runs():
    from helpers import sglang_gpu_harness as G

    path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), G.GLM5_ATTN)
    return {
        name: run_ranks(
            G.run_check, world, args=(path, mode, prefetch, kv), backend=G.comm_setup(0, world)[0], timeout_s=900
        )
        for name, (world, mode, prefetch, kv) in RUNS.items()
    }


@pytest.mark.parametrize(
    "run, reference",
    [
        ("shared", "replicated"),
        ("shared-no-prefetch", "replicated"),
        ("fp8-shared", "fp8-replicated"),
        ("cp4-shared", "cp4-replicated"),
        ("cp4-fp8-shared", "cp4-fp8-replicated"),
    ],
)
def test_shared_kv_equals_replicated_cp_bit_for_bit(runs, run, reference):
    """Every rank's logits of every batch and the decode step, bit for bit; the decode pool
    assembled from the owners' pages holds the replicated prefill's bytes (per-layer digests)."""
    for rank, (r, rep) in enumerate(zip(runs[run], runs[reference])):
        assert r["pool"] == "SharedKVDSATokenToKVPool" and rep["pool"] == "DSATokenToKVPool"
        assert r["pool_dtype"] == rep["pool_dtype"], f"{run}, rank {rank}"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"])):
            assert torch.isfinite(got).all(), f"{run}, rank {rank}, batch {b}: non-finite logits"
            assert torch.equal(got, want), f"{run}, rank {rank}, batch {b}: max diff {float((got - want).abs().max())}"
        assert r["decode_pool_digests"] == rep["decode_pool_digests"], f"{run}, rank {rank}: decode pool bytes differ"
    if not RUNS[run][2]:
        assert not r["early"], f"{run}: prefetch is off, yet a layer was gathered ahead"


def test_prefetch_gathers_the_next_layer_ahead(runs):
    # at CP=2 the last batch has enough history pages per rank for an early launch
    assert runs["shared"][0]["early"] and runs["fp8-shared"][0]["early"]


def test_fp8_runs_really_use_the_fp8_cache(runs):
    for name in ("fp8-shared", "fp8-replicated", "cp4-fp8-shared", "cp4-fp8-replicated"):
        assert runs[name][0]["pool_dtype"] == "torch.float8_e4m3fn", name
    # batches with history read the cache: their logits differ from the bf16 cache's
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
