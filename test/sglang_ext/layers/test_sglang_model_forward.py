"""CPU, ~6-7 min (eleven spawns of 1, 2 or 4 gloo ranks; 19 min measured on a 2-core machine shared
at load 23): SGLang 0.5.23's own DSA model forward, with and without the plugin.

A tiny random-weight DeepSeek-V3.2 checkpoint (config.json + safetensors in tmp_path; 2 layers, both
DSA attention + dense MLP, kv_lora_rank 512 + rope 64, index_head_dim 128, index_topk 32, page 64)
is loaded by SGLang's `DeepseekV32ForCausalLM.load_weights` and run through SGLang's own code:
`DeepseekV2Model.forward`, `DeepseekV2AttentionMLA` / `forward_mla` (absorbed MLA), the DSA
`Indexer` (`forward_cuda`: index-K store by SGLang's triton `SetKAndS` in the interpreter, torch fp8
MQA logits, torch top-k), `DeepseekSparseAttnBackend` (`init_forward_metadata`, `forward_extend`,
`forward_decode`), `DSATokenToKVPool`, SGLang's interleave CP strategy
(`prepare_cp_forward`, `DSAInterleaveCPIndexerOverlap`, KV and index-key all-gathers over SGLang's
GroupCoordinator on gloo), `EagerRunner._execute_extend_cp` and the `LogitsProcessor`. What stands in
for CUDA-only kernels is listed in docs/sglang_cpu_forward.md (sparse-MLA attention: a
gather-softmax reference; Hadamard: a matrix product; RoPE: SGLang's own native path).

The same batches every run (new requests; continuations whose cached prefix ends mid-page; a
batch mixing a radix hit on a shared page, a continuation, a new request and the third chunk of
request 0's prompt; then one decode step for all four requests):
- CP off: 1 rank;
- CP=2 replicated: SGLang's `--enable-prefill-cp --cp-strategy interleave --attn-cp-size 2`;
- CP=4 replicated, the same at 4 ranks;
- CP=2 shared KV, with and without one-layer-ahead history prefetch, and CP=4 shared KV with it:
  the same with the plugin loaded through its entry point and enabled: its
  `SharedKVDSATokenToKVPool` (the core's dense plan and `HistoryPrefetcher`), narrow tail gather
  and logits-processor hook; its dense scratch is filled with NaN bytes as each batch begins, so
  a row the pool did not write (the trash page, a chunk's unused tail rows) would reach the
  logits if SGLang's forward read it. The decode step runs on a non-CP pool assembled from the
  pages each rank owns (what the owned-page PD transfer delivers to a decode instance).
The same at CP off, replicated CP=2 and shared CP=2 with `--kv-cache-dtype fp8_e4m3` (SGLang's
656-byte FlashMLA rows). At CP=2 all must give the same next-token logits (they are bit-identical here: dense MLPs are not
TP-split, `moe_dense_tp_size=1`); at CP=4 shared KV must equal replicated CP=4 bit for bit (both
differ from CP off through SGLang's top-k tie-breaking, see docs/sglang_cpu_forward.md). Every rank of a run must issue the same collectives in the
same order. CP off and CP=2 shared KV are run once more through GLM-5's
`GlmMoeDsaForCausalLM`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_model_harness as H  # noqa: E402
from sglang_nsa_cp.comm import run_ranks  # noqa: E402

register_cpu_ci(est_time=180, suite="nsa-cp-test-cpu")

# (run name, checkpoint, mode, ranks, history prefetch, --kv-cache-dtype)
RUNS = (
    ("off", "v32", "off", 1, False, "bfloat16"),
    ("replicated", "v32", "replicated", 2, False, "bfloat16"),
    ("shared", "v32", "shared", 2, True, "bfloat16"),
    ("shared-no-prefetch", "v32", "shared", 2, False, "bfloat16"),
    ("replicated-cp4", "v32", "replicated", 4, False, "bfloat16"),
    ("shared-cp4", "v32", "shared", 4, True, "bfloat16"),
    ("glm5-off", "glm5", "off", 1, False, "bfloat16"),
    ("glm5-shared", "glm5", "shared", 2, True, "bfloat16"),
    ("fp8-off", "v32", "off", 1, False, "fp8_e4m3"),
    ("fp8-replicated", "v32", "replicated", 2, False, "fp8_e4m3"),
    ("fp8-shared", "v32", "shared", 2, True, "fp8_e4m3"),
)

SHARED_RUNS = [run[0] for run in RUNS if run[2] == "shared"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {
        name: H.write_checkpoint(str(tmp_path_factory.mktemp(f"tiny_{name}")), cfg)
        for name, cfg in (("v32", H.TINY_V32), ("glm5", H.TINY_GLM5))
    }
    return {
        run: run_ranks(H.run_scenario, world, args=(paths[ckpt], mode, prefetch, kv), timeout_s=300)
        for run, ckpt, mode, world, prefetch, kv in RUNS
    }


def _assert_same_logits(got, want, where):
    names = [f"prefill batch {b}" for b in range(len(H.BATCHES))] + ["decode step"]
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, f"{where}, {name}: {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.isfinite(g).all(), f"{where}, {name}: non-finite logits"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}, {name}: {m}")


def test_cp_off_forward_runs_sglangs_dsa_model(runs):
    (off,) = runs["off"]
    assert off["pool"] == "DSATokenToKVPool"
    assert [t["cp_active"] for t in off["trace"]] == [False] * 4
    bs = [len(b) for b in H.BATCHES] + [len(H.DECODE)]
    assert [tuple(x.shape) for x in off["logits"]] == [(n, H.TINY_V32["vocab_size"]) for n in bs]
    # the cached-prefix batch and the decode step read history: their logits are not the
    # first batch's (a smoke check that the KV pool is really read)
    assert not torch.allclose(off["logits"][0], off["logits"][1][:2])


def test_cp2_replicated_matches_cp_off(runs):
    (off,) = runs["off"]
    for rank, r in enumerate(runs["replicated"]):
        assert r["pool"] == "DSATokenToKVPool"
        assert [t["cp_active"] for t in r["trace"]] == [True, True, True, False], (
            f"{rank=}: SGLang's CP path did not run"
        )
        # SGLang's tail gather hands every token's hidden state to the logits processor
        assert [t.get("tail_rows") for t in r["trace"][:3]] == [sum(n for _, n in b) for b in H.BATCHES]
        _assert_same_logits(r["logits"], off["logits"], f"CP=2 replicated, rank {rank} vs CP off")


@pytest.mark.parametrize("run", ["shared", "shared-no-prefetch"])
def test_cp2_shared_kv_matches_cp_off_and_replicated(runs, run):
    (off,) = runs["off"]
    for rank, (r, rep) in enumerate(zip(runs[run], runs["replicated"])):
        assert r["pool"] == "SharedKVDSATokenToKVPool" and r["sharded_pool_seen"], f"{rank=}: {r['pool']}"
        assert [t["cp_active"] for t in r["trace"]] == [True, True, True, False], f"{rank=}"
        _assert_same_logits(r["logits"], off["logits"], f"CP=2 {run}, rank {rank} vs CP off")
        _assert_same_logits(r["logits"], rep["logits"], f"CP=2 {run} vs replicated, rank {rank}")


def test_cp4_shared_kv_matches_replicated_cp4(runs):
    """At CP=4 SGLang's own replicated CP already differs from CP off in the last prefill batch
    and the decode step (its torch top-k breaks ties by position in each rank's packed logits row:
    docs/sglang_cpu_forward.md); shared KV must reproduce replicated CP=4 bit for bit."""
    for rank, (r, rep) in enumerate(zip(runs["shared-cp4"], runs["replicated-cp4"])):
        assert r["pool"] == "SharedKVDSATokenToKVPool", f"{rank=}: {r['pool']}"
        _assert_same_logits(r["logits"], rep["logits"], f"CP=4 shared KV vs replicated, rank {rank}")
        for b, got in enumerate(r["logits"]):
            assert torch.equal(got, rep["logits"][b]), (
                f"CP=4 shared KV vs replicated, rank {rank}, batch {b}: not bitwise"
            )


@pytest.mark.parametrize("run", SHARED_RUNS)
def test_shared_kv_run_took_the_plugins_paths(runs, run):
    layers = H.TINY_V32["num_hidden_layers"]
    prefetch = {name: p for name, _, _, _, p, _ in RUNS}[run]
    for rank, r in enumerate(runs[run]):
        # narrow tail gather: one row per request reaches the logits processor
        assert [t.get("tail_rows") for t in r["trace"][:3]] == [len(b) for b in H.BATCHES], f"{rank=}"
        # batches 1 and 2 have cached history: one latent and one index-page all-gather per layer
        # each, launched one layer ahead with prefetch on; batch 0 gathers nothing
        assert [t["history"] for t in r["trace"][:3]] == [False, True, True], f"{rank=}"
        assert [t["early"] for t in r["trace"][:3]] == [False, prefetch, prefetch], f"{rank=}"
        assert r["gathered"]["materialize_latent"]["calls"] == 2 * layers, f"{rank=}: {r['gathered']}"
        assert r["gathered"]["materialize_index"]["calls"] == 2 * layers, f"{rank=}: {r['gathered']}"
    if run in ("shared", "shared-no-prefetch"):
        for rank, (r, rep) in enumerate(zip(runs[run], runs["replicated"])):
            # each rank stores ceil(25 / 2) of the 25 logical pages (+1 trash page)
            assert r["pool_bytes"] / rep["pool_bytes"] == pytest.approx((13 + 1) / 25), f"{rank=}"


@pytest.mark.parametrize("run", ["replicated", "replicated-cp4", "fp8-replicated", *SHARED_RUNS])
def test_every_rank_issues_the_same_collectives_in_the_same_order(runs, run):
    """All of them: SGLang's own (TP/CP groups) and the pool's history all-gathers."""
    ranks = runs[run]
    assert len(ranks[0]["collectives"]) > 0
    for rank, r in enumerate(ranks[1:], start=1):
        mismatch = next((i for i, (a, b) in enumerate(zip(r["collectives"], ranks[0]["collectives"])) if a != b), None)
        assert len(r["collectives"]) == len(ranks[0]["collectives"]) and mismatch is None, (
            f"{run}: rank {rank} differs from rank 0 at collective {mismatch}: "
            f"{r['collectives'][mismatch] if mismatch is not None else len(r['collectives'])} vs "
            f"{ranks[0]['collectives'][mismatch] if mismatch is not None else len(ranks[0]['collectives'])}"
        )


def test_glm5_shared_kv_matches_glm5_cp_off(runs):
    """The same through `GlmMoeDsaForCausalLM` (GLM-5's class; same weights, so also the same
    logits as DeepSeek-V3.2's class)."""
    (off,) = runs["glm5-off"]
    _assert_same_logits(off["logits"], runs["off"][0]["logits"], "GLM-5 CP off vs DeepSeek-V3.2 CP off")
    for rank, r in enumerate(runs["glm5-shared"]):
        assert r["pool"] == "SharedKVDSATokenToKVPool", f"{rank=}: {r['pool']}"
        assert [t.get("tail_rows") for t in r["trace"][:3]] == [len(b) for b in H.BATCHES], f"{rank=}"
        _assert_same_logits(r["logits"], off["logits"], f"GLM-5 CP=2 shared KV, rank {rank} vs CP off")


def test_fp8_kv_shared_matches_replicated_bit_for_bit(runs):
    """--kv-cache-dtype fp8_e4m3 (656-byte FlashMLA rows; SGLang's flashmla_sparse prefill reads a
    prefix batch's KV dequantized from the pool): shared KV CP=2 gives replicated CP=2's logits bit
    for bit in every prefill batch (new requests, continuations ending mid-page, a radix hit, a third
    chunk) and the decode step, and the decode pool assembled from the owners' fp8 pages holds the
    replicated prefill's bytes."""
    for rank, (r, rep) in enumerate(zip(runs["fp8-shared"], runs["fp8-replicated"])):
        assert r["pool"] == "SharedKVDSATokenToKVPool" and r["sharded_pool_seen"], f"{rank=}: {r['pool']}"
        assert r["pool_dtype"] == rep["pool_dtype"] == "torch.float8_e4m3fn", f"{rank=}"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"])):
            assert torch.equal(got, want), (
                f"fp8 KV, rank {rank}, {'decode step' if b == 3 else f'prefill batch {b}'}: not bitwise"
            )
        for layer, (got, want) in enumerate(zip(r["decode_pool_latent"], rep["decode_pool_latent"])):
            assert got.shape[-1] == want.shape[-1] == 656, f"{rank=}, {layer=}: {tuple(got.shape)}"
            assert want.any(), f"{rank=}, {layer=}: the replicated prefill wrote nothing"
            assert torch.equal(got, want), (
                f"fp8 KV, rank {rank}, layer {layer}: decode pool bytes differ from the replicated prefill's"
            )


def test_fp8_kv_matches_cp_off_and_is_not_the_bf16_cache(runs):
    (off,) = runs["fp8-off"]
    for rank, r in enumerate(runs["fp8-shared"]):
        _assert_same_logits(r["logits"], off["logits"], f"fp8 KV CP=2 shared, rank {rank} vs CP off")
    # batch 0 has no history (attention reads the chunk's bf16 rows); batches with history read
    # the fp8 cache, so their logits are not the bf16 cache's
    (bf16_off,) = runs["off"]
    assert torch.equal(off["logits"][0], bf16_off["logits"][0])
    assert not torch.equal(off["logits"][1], bf16_off["logits"][1])


def test_fp8_history_materialize_moves_656_bytes_per_token(runs):
    """The history all-gathers move fp8 pages: 656 latent bytes per token instead of 1152."""
    for rank, (fp8, bf16) in enumerate(zip(runs["fp8-shared"], runs["shared"])):
        got, want = fp8["gathered"]["materialize_latent"], bf16["gathered"]["materialize_latent"]
        assert got["calls"] == want["calls"] and got["bytes"] * 1152 == want["bytes"] * 656, f"{rank=}: {got} vs {want}"
        assert fp8["gathered"]["materialize_index"] == bf16["gathered"]["materialize_index"], f"{rank=}"


def test_timings_are_reported(runs):
    """Not a check: puts each run's phase timings (seconds) into the test log."""
    for mode, ranks in runs.items():
        print(mode, [{k: round(v, 2) for k, v in r["timings"].items()} for r in ranks])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
