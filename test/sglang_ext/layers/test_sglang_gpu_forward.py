"""GPU, 1 or 2 x H200, ~4.5 min: SGLang 0.5.23's own DSA model forward on CUDA with GLM-5's
attention dimensions (test/helpers/sglang_gpu_harness.py), FlashMLA's real sparse prefill kernel.

Runs only where CUDA and the GPU bundle are (docs/gpu_bundle.md: `source scripts/gpu_unpack.sh`);
skipped elsewhere. The same batches through CP off, SGLang's replicated interleave CP and the
flag's shared KV (SGLang's page-interleaved pool, the plugin's subclass, history gathered one
layer ahead; its gather scratch NaN as each batch begins): cold prompts longer than the
indexer's top-k, a second chunk, a batch with a radix hit on 32 cached pages, a third chunk and
new requests (every extend starting on a page, as SGLang schedules them under KV sharding), then
a decode step from a pool assembled from the page owners. CP=2 and CP=4, each with bf16 KV and
with `--kv-cache-dtype fp8_e4m3` (656-byte FlashMLA rows; decode on flashmla_kv). Request pages
come from SGLang's owner-rotating allocator in every run. Ranks talk NCCL and the pool gathers
history with SGLang's own PyNccl communicator: a GPU per rank where there are enough GPUs, else
every rank on GPU 0 with its own NCCL_HOSTID (NCCL's socket transport on loopback:
`helpers.distributed.nccl_device`), the same kernels on the same data, only slower collectives. Shared KV must equal replicated CP bit for bit (same kernels,
same inputs); CP off may differ from CP by bf16 rounding (docs/sglang_gpu_forward.md says by
how much).
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

register_cuda_ci(est_time=270, suite="nsa-cp-test-1-gpu-h200")

pytestmark = NEEDS_CUDA_AND_THE_BUNDLE


RUNS = {  # name: (ranks, mode, kv_cache_dtype)
    "off": (1, "off", "bfloat16"),
    "replicated": (2, "replicated", "bfloat16"),
    "shared": (2, "shared", "bfloat16"),
    "fp8-replicated": (2, "replicated", "fp8_e4m3"),
    "fp8-shared": (2, "shared", "fp8_e4m3"),
    # CP=4: more ranks than a 1- or 2-GPU machine has, so they share GPU 0 (nccl_device)
    "cp4-replicated": (4, "replicated", "bfloat16"),
    "cp4-shared": (4, "shared", "bfloat16"),
    "cp4-fp8-replicated": (4, "replicated", "fp8_e4m3"),
    "cp4-fp8-shared": (4, "shared", "fp8_e4m3"),
}
PAIRS = [("shared", "replicated"), ("fp8-shared", "fp8-replicated"), ("cp4-shared", "cp4-replicated"),
         ("cp4-fp8-shared", "cp4-fp8-replicated")]  # fmt: skip
PLUGIN_POOL = ("sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool", "PageInterleaveDSATokenToKVPool")


@pytest.fixture(scope="module")
def runs():
    from helpers import sglang_gpu_harness as G

    path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), G.GLM5_ATTN)
    return {
        name: run_ranks(G.run_check, world, args=(path, mode, kv), backend="nccl", timeout_s=900)
        for name, (world, mode, kv) in RUNS.items()
    }


@pytest.mark.parametrize("run, reference", PAIRS)
def test_shared_kv_equals_replicated_cp_bit_for_bit(runs, run, reference):
    """Every rank's logits of every batch and the decode step, bit for bit; the decode pool
    assembled from the page owners holds the replicated prefill's bytes (per-layer digests)."""
    for rank, (r, rep) in enumerate(zip(runs[run], runs[reference])):
        assert (r["pool_module"], r["pool"]) == PLUGIN_POOL, f"{run}, rank {rank}: {r['pool_module']}.{r['pool']}"
        assert rep["pool"] == "DSATokenToKVPool", f"{reference}, rank {rank}: {rep['pool']}"
        assert r["pool_dtype"] == rep["pool_dtype"], f"{run}, rank {rank}"
        # the prefill batches took SGLang's CP path (recorded before the decode step)
        assert r["cp_active"] == rep["cp_active"] == [True] * 3, f"{run}, rank {rank}: {r['cp_active']}"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"])):
            assert torch.isfinite(got).all(), f"{run}, rank {rank}, batch {b}: non-finite logits"
            assert torch.equal(got, want), f"{run}, rank {rank}, batch {b}: max diff {float((got - want).abs().max())}"
        assert r["decode_pool_digests"] == rep["decode_pool_digests"], f"{run}, rank {rank}: decode pool bytes differ"


@pytest.mark.parametrize("run", [p[0] for p in PAIRS])
def test_history_is_gathered_one_layer_ahead_by_the_pools_communicator(runs, run):
    """Batches 1 and 2 have cached history: one latent and one index-K all-gather per layer each,
    through SGLang's PyNccl communicator, also where the ranks share a GPU."""
    from helpers import sglang_gpu_harness as G

    want_comm = "PyNcclCommunicator"
    layers = G.GLM5_ATTN["num_hidden_layers"]
    for rank, r in enumerate(runs[run]):
        assert r["history"] == [False, True, True], f"{run}, rank {rank}: {r['history']}"
        assert r["gather_comm"] == want_comm, f"{run}, rank {rank}: {r['gather_comm']}"
        assert r["gathered"]["calls"] == 2 * 2 * layers, f"{run}, rank {rank}: {r['gathered']}"
        # the plugin's scratch: one context of CHECK_MAX_LEN tokens plus one chunk, not SGLang's eight
        assert r["scratch_prefix_tokens"] == G.CHECK_MAX_LEN, f"{run}, rank {rank}: {r['scratch_prefix_tokens']}"


def test_fp8_runs_really_use_the_fp8_cache(runs):
    for name in ("fp8-shared", "fp8-replicated", "cp4-fp8-shared", "cp4-fp8-replicated"):
        assert runs[name][0]["pool_dtype"] == "torch.float8_e4m3fn", name
    # batches with history read the cache: their logits differ from the bf16 cache's
    assert not torch.equal(runs["fp8-replicated"][0]["logits"][1], runs["replicated"][0]["logits"][1])


def test_fp8_shared_pool_stores_with_the_fused_kernel(runs):
    """The plugin's subclass quantizes a chunk once, in `kernels.store_mla_fp8_owned_and_scratch`
    (on CUDA its kernel, which never calls SGLang's `quantize_k_cache_separate`); SGLang's
    replicated fp8 pool calls that quantizer at every layer's store."""
    from helpers import sglang_gpu_harness as G

    for name in ("fp8-shared", "cp4-fp8-shared"):
        print(name, "SGLang quantizer calls:", [r["fp8_quantizations"] for r in runs[name]])
        assert all(r["fp8_quantizations"] == 0 for r in runs[name]), name
    # the control: the count sees SGLang's quantizer (once per layer and prefill batch)
    want = G.GLM5_ATTN["num_hidden_layers"] * 3
    for name in ("fp8-replicated", "cp4-fp8-replicated"):
        print(name, "SGLang quantizer calls:", [r["fp8_quantizations"] for r in runs[name]])
        assert all(r["fp8_quantizations"] == want for r in runs[name]), f"{name}: want {want} per rank"


def test_cp_matches_cp_off_within_bf16_rounding(runs):
    """CP's reductions run in another order than CP off's: at most 1.2 % of the logits' scale on
    the H200 (gpu_suite_1xh200.log: 5.9e-2 at a scale of 4.72); 2 % leaves room for the hardware, not for a regression."""
    (off,) = runs["off"]
    for b, (cp, ref) in enumerate(zip(runs["replicated"][0]["logits"], off["logits"])):
        scale = float(ref.abs().max())
        diff = float((cp - ref).abs().max())
        print(f"batch {b}: max |CP=2 - CP off| = {diff:.3e} (logits up to {scale:.2f})")
        assert diff <= 0.02 * scale, f"batch {b}: CP=2 differs from CP off by {diff} on logits up to {scale}"


def test_no_stand_in_is_called_in_the_forward(runs):
    """SGLang's forward runs on real kernels only: the stand-ins it reaches are import-time
    lookups of sgl_kernel ops, never a call (each use, with its caller, goes to the log)."""
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            print(name, rank, r["stand_ins"])
            called = [line for line in r["stand_ins"].splitlines() if line.strip().startswith("call ")]
            assert not called, f"{name}, rank {rank}: stand-ins called in the forward: {called}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
