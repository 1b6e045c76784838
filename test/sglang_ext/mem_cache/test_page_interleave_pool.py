"""CPU (spawns of 1 to 4 gloo ranks): SGLang 0.5.23's own page-interleaved DSA pool
(`PageInterleaveDSATokenToKVPool`, what `--enable-kv-cache-sharding` builds) on the Hopper path
the flag targets (`--dsa-prefill-backend flashmla_sparse`, bf16 and fp8 KV), with the plugin's
subclass and scratch sizing (`sglang_ext/mem_cache/page_interleave_pool.py`, `page_interleave.py`).

SGLang's DSA model forward (the tiny random-weight DeepSeek-V3.2 of sglang_model_harness.py) runs
page-aligned batches from SGLang's owner-rotating allocator, as its scheduler makes them under
sharding: new requests, a second chunk over two cached pages, a radix hit on a shared prefix with
a third chunk and a new request, then a decode step on a non-CP pool assembled from each page's
owner (what the owned-page PD transfer delivers). The pool's gather scratch is filled with NaN
bytes as each batch begins. Sharded must equal SGLang's replicated CP bit for bit (`torch.equal`)
at CP 2 (bf16, fp8; DeepSeek-V3.2's and GLM-5's model classes), 3 and 4, and CP off wherever
replicated CP does (SGLang's own top-k breaks
ties by position in each rank's packed logits row, docs/sglang_cpu_forward.md); so must SGLang's
own class with the same poisoned scratch. The subclass's override has a test that fails without it.

The baseline runs (CP off, replicated CP) come from helpers/baseline_cache.py: reused from an
earlier run while everything they depend on is unchanged (docs/testing.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_model_harness as H  # noqa: E402
from helpers.baseline_cache import cached_run_ranks  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=50, suite="nsa-cp-test-cpu")

PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool"
# (run name, checkpoint, mode, ranks, --kv-cache-dtype, plugin loaded)
RUNS = (
    ("off", "v32", "off", 1, "bfloat16", True),
    ("replicated", "v32", "replicated", 2, "bfloat16", True),
    ("sharded", "v32", "sharded", 2, "bfloat16", True),
    ("sglang-sharded", "v32", "sharded", 2, "bfloat16", False),
    ("fp8-replicated", "v32", "replicated", 2, "fp8_e4m3", True),
    ("fp8-sharded", "v32", "sharded", 2, "fp8_e4m3", True),
    ("replicated-cp3", "v32", "replicated", 3, "bfloat16", True),
    ("sharded-cp3", "v32", "sharded", 3, "bfloat16", True),
    ("replicated-cp4", "v32", "replicated", 4, "bfloat16", True),
    ("sharded-cp4", "v32", "sharded", 4, "bfloat16", True),
    ("glm5-replicated", "glm5", "replicated", 2, "bfloat16", True),
    ("glm5-sharded", "glm5", "sharded", 2, "bfloat16", True),
)
STEPS = [f"prefill batch {b}" for b in range(len(H.ROTATED_BATCHES))] + ["decode step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {
        name: H.write_checkpoint(str(tmp_path_factory.mktemp(f"tiny_{name}")), cfg)
        for name, cfg in (("v32", H.TINY_V32), ("glm5", H.TINY_GLM5))
    }
    # the baselines (CP off, replicated CP) come from helpers/baseline_cache.py while their inputs stand
    return {
        name: (run_ranks if mode == "sharded" else cached_run_ranks)(
            H.run_rotated_scenario, world, args=(paths[ckpt], mode, kv, plugin), timeout_s=400
        )
        for name, ckpt, mode, world, kv, plugin in RUNS
    }


def _assert_bitwise(got, want, where):
    for step, g, w in zip(STEPS, got, want, strict=True):
        assert torch.isfinite(g).all(), f"{where}, {step}: non-finite logits"
        assert torch.equal(g, w), f"{where}, {step}: not bitwise, max |diff| {(g - w).abs().max().item()}"


@pytest.mark.parametrize(
    "sharded, replicated",
    [("sharded", "replicated"), ("fp8-sharded", "fp8-replicated"), ("sharded-cp3", "replicated-cp3"),
     ("sharded-cp4", "replicated-cp4"), ("glm5-sharded", "glm5-replicated")],
)  # fmt: skip
def test_sharded_pool_equals_replicated_cp_bit_for_bit(runs, sharded, replicated):
    for rank, (r, rep) in enumerate(zip(runs[sharded], runs[replicated], strict=True)):
        assert r["pool_module"] == PLUGIN_POOL, f"{sharded}, {rank=}: {r['pool_module']}.{r['pool']}"
        assert [t["history"] for t in r["trace"][:3]] == [False, True, True], f"{sharded}, {rank=}"
        _assert_bitwise(r["logits"], rep["logits"], f"{sharded} vs {replicated}, rank {rank}")
        for layer, (got, want) in enumerate(zip(r["decode_pool_latent"], rep["decode_pool_latent"], strict=True)):
            assert want.any(), f"{replicated}, {rank=}, {layer=}: the replicated prefill wrote nothing"
            assert torch.equal(got, want), f"{sharded}, {rank=}, {layer=}: decode pool bytes differ from replicated"


def test_sharded_pool_equals_cp_off_where_replicated_cp_does(runs):
    (off,) = runs["off"]
    for rank, (r, rep) in enumerate(zip(runs["sharded"], runs["replicated"], strict=True)):
        for step, got, rep_logits, want in zip(STEPS, r["logits"], rep["logits"], off["logits"], strict=True):
            assert torch.equal(got, want) == torch.equal(rep_logits, want), f"{rank=}, {step}"
        assert torch.equal(r["logits"][0], off["logits"][0]), f"{rank=}: the batch without history"


def test_narrow_tail_gather_and_history_gathers(runs):
    layers = H.TINY_V32["num_hidden_layers"]
    for rank, r in enumerate(runs["sharded"]):
        # the plugin's narrow tail gather moves one row per request (SGLang's, every token's)
        assert [t.get("tail_rows") for t in r["trace"][:3]] == [len(b) for b in H.ROTATED_BATCHES], f"{rank=}"
        # batches 1 and 2 gather history: latent and index pages per layer; batch 0 gathers nothing
        assert r["gathered"]["calls"] == 2 * 2 * layers, f"{rank=}: {r['gathered']}"


@pytest.mark.parametrize("run", ["replicated", "sharded", "fp8-sharded", "sharded-cp3", "sharded-cp4"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(runs, run):
    ranks = runs[run]
    assert len(ranks[0]["collectives"]) > 0
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["collectives"] == ranks[0]["collectives"], f"{run}: rank {rank}'s collectives differ from rank 0's"


# ---- SGLang's own class, and the override against it -------------------------------------------------


def test_sglangs_own_class_equals_replicated_cp_with_a_poisoned_scratch(runs):
    """SGLang's class, same NaN scratch: the batch without history leaves scratch row 0 unwritten,
    and the masked top-k entries that name it read nothing (as in FlashMLA's kernel), so the
    plugin needs no override of SGLang's batch start."""
    for rank, (r, rep) in enumerate(zip(runs["sglang-sharded"], runs["replicated"], strict=True)):
        assert r["pool_module"] == "sglang.srt.mem_cache.page_interleave_pool", f"{rank=}"
        assert [t["history"] for t in r["trace"][:3]] == [False, True, True], f"{rank=}"
        _assert_bitwise(r["logits"], rep["logits"], f"SGLang's class vs replicated, rank {rank}")


def test_fp8_chunk_is_quantized_once_per_layer_write(runs):
    """SGLang's pool quantizes each chunk twice (scratch, owned rows); the subclass once, as a
    replicated pool does."""
    writes = len(H.ROTATED_BATCHES) * H.TINY_V32["num_hidden_layers"]
    for rank, (r, rep) in enumerate(zip(runs["fp8-sharded"], runs["fp8-replicated"], strict=True)):
        assert rep["fp8_quantizations"] == writes, f"{rank=}: {rep['fp8_quantizations']}"
        assert r["fp8_quantizations"] == writes, f"{rank=}: {r['fp8_quantizations']} quantizations"


def test_scratch_holds_the_configured_contexts_plus_one_chunk(monkeypatch):
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    from sglang_nsa_cp.envs import envs
    from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave import make_page_shard_spec

    sglang_spec = PageShardSpec(1, 4, 64, max_prefix_tokens=8 * 163840, chunk_tokens=8192)  # SGLang's 8 contexts
    target = SimpleNamespace(is_draft_worker=False, model_config=SimpleNamespace(context_len=163_800))
    draft = SimpleNamespace(is_draft_worker=True, model_config=target.model_config)
    with envs.SGLANG_NSA_CP_SHARED_KV.override(True):
        spec = make_page_shard_spec(lambda kvc: sglang_spec, target)
        assert (spec.max_prefix_tokens, spec.chunk_tokens) == (163_840, 8192)  # one context, 4 x 64 aligned
        with envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.override(2):
            assert make_page_shard_spec(lambda kvc: sglang_spec, target).max_prefix_tokens == 2 * 163_840
        assert make_page_shard_spec(lambda kvc: sglang_spec, draft) is sglang_spec  # the target's, as SGLang's
        assert make_page_shard_spec(lambda kvc: None, target) is None  # sharding off
    with envs.SGLANG_NSA_CP_SHARED_KV.override(False):
        assert make_page_shard_spec(lambda kvc: sglang_spec, target) is sglang_spec
    with envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.override(0), pytest.raises(ValueError, match="at least 1"):
        envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.get()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
