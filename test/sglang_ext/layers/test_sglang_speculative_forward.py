"""CPU (three spawns of 1 or 2 gloo ranks): the PD prefill's speculative step with
SGLang 0.5.23's own GLM-5 DSA model and its own NextN (MTP) draft, under SGLang's KV sharding
(what the plugin's flag turns on) and without it.

Per prefill batch, as `EAGLEWorkerV2._forward_prefill_batch` runs it (docs/speculative.md): the
target `GlmMoeDsaForCausalLM` captures every token's hidden state (SGLang's full CP tail gather),
then `GlmMoeDsaForCausalLMNextN` runs its draft extend over the same slots with the ids shifted by
one and the target's hidden states in `EagleDraftExtendInput` (SGLang's `cp_shard_model_inputs`
splits them like the embeddings), writing its own DSA pool. GLM because SGLang shards an MTP
draft's KV only for GLM DSA with one NextN layer and EAGLE top-k 1 (the plugin's validation
enforces it). Batches are page-aligned from SGLang's owner-rotating allocator, as its scheduler
makes them under sharding: new requests, a second chunk over cached pages, a radix hit on a
shared two-page prefix (sglang_model_harness.ROTATED_BATCHES).

- CP off (1 rank), CP=2 replicated (SGLang's CP: both pools keep every page), CP=2 sharded (the
  plugin's subclass of SGLang's `PageInterleaveDSATokenToKVPool` for the target, and for the
  draft the pool SGLang's `_build_mtp_kv_shard_pool` builds: the same class with the target's
  spec, shard group and per-rank size, one layer, its own storage, on the target's allocator and
  request table; both gather scratches poisoned with NaN bytes as each batch begins).
- Sharded must equal replicated CP bit for bit (`torch.equal`): target logits and every token's
  target hidden state (the draft's input), draft logits, the draft's top-1 proposals and last
  hidden states (what the prefill puts in the metadata buffer for the decode), and the draft KV
  (MLA latent, index K and scale) at every written slot, assembled from the pages each rank owns
  (what the owned-page transfer delivers). Both CP runs must match CP off where SGLang's own CP
  does (see the test).

The baseline runs (CP off, replicated CP) come from helpers/baseline_cache.py: reused from an
earlier run while everything they depend on is unchanged (docs/testing.md).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_draft_harness as D  # noqa: E402
from helpers import sglang_model_harness as H  # noqa: E402
from helpers.baseline_cache import cached_run_ranks  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=25, suite="nsa-cp-test-cpu")

RUNS = (("off", 1), ("replicated", 2), ("sharded", 2))
COMPARED = ("target_logits", "target_hidden", "draft_logits", "draft_topk", "draft_hidden")
PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool.PageInterleaveDSATokenToKVPool"
SGLANG_POOL = "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = D.write_mtp_checkpoint(str(tmp_path_factory.mktemp("tiny_glm5_mtp")))
    # the baselines (CP off, replicated CP) come from helpers/baseline_cache.py while their inputs stand
    return {
        mode: (run_ranks if mode == "sharded" else cached_run_ranks)(
            D.run_scenario, world, args=(path, mode), timeout_s=400
        )
        for mode, world in RUNS
    }


def test_the_draft_pool_is_sglangs_mtp_shard_pool(runs):
    for mode, ranks in runs.items():
        for rank, r in enumerate(ranks):
            want = PLUGIN_POOL if mode == "sharded" else SGLANG_POOL
            assert (r["target_pool"], r["draft_pool"]) == (want, want), f"{mode}, {rank=}"
            assert r["draft_arch"] == "GlmMoeDsaForCausalLMNextN", f"{mode}, {rank=}"
    for rank, r in enumerate(runs["sharded"]):
        shape = {k: r[k] for k in ("draft_spec_is_targets", "draft_group_is_targets", "draft_size_is_targets")}
        assert all(shape.values()) and r["draft_layers"] == 1, f"{rank=}: {shape}, {r['draft_layers']} layers"
        assert r["draft_storage_is_own"], f"{rank=}: the draft writes the target's KV buffers"


def test_the_draft_ran_over_every_token(runs):
    extend_tokens = [sum(n for _, n in batch) for batch in H.ROTATED_BATCHES]
    for mode, ranks in runs.items():
        for rank, r in enumerate(ranks):
            # the target's full tail gather: every token's hidden state reaches the draft
            assert r["tail_rows"] == extend_tokens, f"{mode}, {rank=}"
            for b, batch in enumerate(H.ROTATED_BATCHES):
                assert tuple(r["draft_logits"][b].shape) == (len(batch), H.TINY_GLM5["vocab_size"])
                assert tuple(r["draft_topk"][b].shape) == (len(batch), D.DRAFT_TOPK)
                assert torch.isfinite(r["draft_logits"][b]).all(), f"{mode}, {rank=}, batch {b}"
    for rank, r in enumerate(runs["sharded"]):  # continuations and the radix hit read draft history from the owners
        assert r["draft_history"] == [False, True, True], f"{rank=}"
    (off,) = runs["off"]
    # the draft reads its own KV history: request 0's second chunk's draft logits differ from its first's
    assert not torch.allclose(off["draft_logits"][0][0], off["draft_logits"][1][0])


@pytest.mark.parametrize("key", COMPARED)
def test_sharded_equals_replicated_cp_bitwise(runs, key):
    for rank, (r, rep) in enumerate(zip(runs["sharded"], runs["replicated"], strict=True)):
        for b, (got, want) in enumerate(zip(r[key], rep[key], strict=True)):
            assert torch.equal(got, want), f"{key}, rank {rank}, batch {b}: sharded differs from replicated CP"


def test_draft_kv_from_the_owners_equals_the_replicated_draft_pool(runs):
    for rank, (r, rep) in enumerate(zip(runs["sharded"], runs["replicated"], strict=True)):
        for part, want in rep["draft_kv"].items():
            got = r["draft_kv"][part]
            assert got.shape == want.shape and got.any(), f"{part}, rank {rank}: nothing written"
            assert torch.equal(got, want), f"draft {part}, rank {rank}: owners' pages differ from the replicated pool"


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_cp2_matches_cp_off_where_sglangs_cp_does(runs, mode):
    """Batches 0 and 1 (new requests, a second chunk): everything equals CP off, the draft KV
    too. In batch 2 SGLang's own replicated CP=2 already differs from CP off (which of the
    indexer's tied keys make its top-k depends on where they sit; docs/sglang_cpu_forward.md), so
    the draft rows fed by it differ too; sharded reproduces replicated CP there bit for bit (above)."""
    (off,) = runs["off"]
    for rank, r in enumerate(runs[mode]):
        for key in COMPARED:
            for b in (0, 1):
                assert torch.equal(r[key][b], off[key][b]), f"{mode} {key}, rank {rank}, batch {b}: differs from CP off"
        first_two = sum(n for batch in H.ROTATED_BATCHES[:2] for _, n in batch)  # their slots come first
        for part, want in off["draft_kv"].items():
            assert torch.equal(r["draft_kv"][part][:first_two], want[:first_two]), f"draft {part}, {mode}, rank {rank}"
        drift = (r["target_hidden"][2] != off["target_hidden"][2]).any(-1).nonzero().flatten().tolist()
        print(f"{mode} rank {rank}: batch 2 target hidden rows differing from CP off: {drift}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
