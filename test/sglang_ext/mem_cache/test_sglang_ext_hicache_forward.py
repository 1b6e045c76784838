"""CPU (five spawns of 1, 2 or 3 gloo ranks): SGLang 0.5.23's DSA model forward over a
prefix that HiCache evicted to host and loaded back, under SGLang's own KV sharding (what the
plugin's flag turns on, with --enable-hierarchical-cache): the plugin's subclass of its sharded
DSA pool, its owner-classed allocator and its sharded host tier.

Each run, on every rank (sglang_hicache_harness.evict_and_load_back): SGLang's
`DeepseekV32ForCausalLM` (the CPU forward of test_sglang_model_forward.py) prefills request 0
(3 pages and 10 tokens) beside a new one-page request; request 4 extends request 0's 3-page
prefix from its original pages (the control); the prefix is written to host by SGLang's
`HybridCacheController.write` (owner-matched host slots under sharding), its device pages are
freed and filled with 0xFF (NaN rows, as if reused), and a 4-page request and a continuation
run; the controller loads the prefix into fresh device pages (`load`, the owner-classed
`alloc_cyclic` under sharding; `start_loading`, the pool's history gather waiting on its
`LayerDoneCounter`), and request 3 extends the loaded prefix with request 4's tokens. Modes: CP
off (1 rank), replicated CP=2 and 3 (SGLang's `DSATokenToKVPool` on every rank, stock allocator)
and sharded CP=2 and 3 (SGLang's `PageInterleaveDSATokenToKVPool`, the plugin's subclass, of
FORWARD_POOL_PAGES / N pages per rank with its spec and the CP group, its gather scratch poisoned
as each batch begins, and `PageInterleavePoolAllocator(..., shard_spec=spec)` over it, as SGLang's
configurator builds them).

Checked:
- (a) the loaded prefix gives request 3 the control's logits bit for bit in every mode, and every
  batch's logits are equal across modes: sharded = replicated bit for bit at CP=2 and 3, both
  = CP off (bit-identical here); loaded pages keep the owners
  of their host pages, which keep the owners of the device pages they back up; no page leaked;
- (b) a load whose copy fails after its first layer raises out of `start_loading` on every rank
  and queues no completion (nothing would mark the node loaded);
- (c) host bytes per rank, measured from the allocated host tensors, are 1/N of replicated CP's for
  the same logical capacity (less SGLang's fixed padding page), and each rank's host tier holds
  only the cached pages it owns.

Not covered: SGLang's `UnifiedRadixCache` and scheduler themselves (the harness plays their part:
request bookkeeping, the node's rotation base, write-back, eviction and load-back calls), the
`page_first` host layout (layer_first here), and recovery from a failed load: SGLang 0.5.23 has
none for any pool (the exception reaches the scheduler's event loop, which exits and takes the
server down), so after (b) no radix state survives to point at the partly loaded pages.

The baseline runs (CP off, replicated CP) come from helpers/baseline_cache.py: reused from an
earlier run while everything they depend on is unchanged (docs/testing.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_hicache_harness as HC  # noqa: E402
from helpers import sglang_model_harness as H  # noqa: E402
from helpers.baseline_cache import cached_run_ranks  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=35, suite="nsa-cp-test-cpu")

# run -> (mode, ranks)
RUNS = {
    "off": ("off", 1),
    "replicated": ("replicated", 2),
    "sharded": ("sharded", 2),
    "replicated-cp3": ("replicated", 3),
    "sharded-cp3": ("sharded", 3),
}
BATCHES = ("first", "control", "reuse", "loaded")
PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = H.write_checkpoint(str(tmp_path_factory.mktemp("tiny_v32")))
    # the baselines (CP off, replicated CP) come from helpers/baseline_cache.py while their inputs stand
    return {
        run: (run_ranks if mode == "sharded" else cached_run_ranks)(
            HC.evict_and_load_back, world, args=(path, mode), timeout_s=300
        )
        for run, (mode, world) in RUNS.items()
    }


def test_loaded_prefix_gives_the_controls_logits_in_every_mode(runs):
    for mode, ranks in runs.items():
        for rank, r in enumerate(ranks):
            assert torch.equal(r["logits"]["loaded"], r["logits"]["control"]), (
                f"{mode}, rank {rank}: logits over the loaded prefix differ from the control's"
            )
            assert all(torch.isfinite(x).all() for x in r["logits"].values()), f"{mode}, rank {rank}: NaN logits"
            assert not torch.equal(r["logits"]["loaded"], r["logits"]["reuse"][:1]), f"{mode}: degenerate logits"
            assert r["pages_leaked"] == 0, f"{mode}, rank {rank}: {r['pages_leaked']} pages not returned"


@pytest.mark.parametrize("sharded,replicated", [("sharded", "replicated"), ("sharded-cp3", "replicated-cp3")])
def test_sharded_equals_replicated_bit_for_bit_and_cp_off(runs, sharded, replicated):
    (off,) = runs["off"]
    for rank, (s, r) in enumerate(zip(runs[sharded], runs[replicated])):
        for batch in BATCHES:
            got, want = s["logits"][batch], r["logits"][batch]
            assert torch.equal(got, want), (
                f"{sharded}, {batch} batch, rank {rank}: vs {replicated}, max diff {(got - want).abs().max()}"
            )
            assert torch.equal(got, off["logits"][batch]), (
                f"{sharded}, {batch} batch, rank {rank}: vs CP off, max diff {(got - off['logits'][batch]).abs().max()}"
            )


@pytest.mark.parametrize("run", ["sharded", "sharded-cp3"])
def test_host_and_loaded_pages_keep_their_owners(runs, run):
    n = RUNS[run][1]
    first = runs[run][0]
    for rank, r in enumerate(runs[run]):
        assert (r["pool_module"], r["host_pool"]) == (PLUGIN_POOL, "PageInterleaveHostPool"), f"{run}, {rank=}"
        assert (r["prefix"], r["host"], r["loaded"]) == (first["prefix"], first["host"], first["loaded"]), (
            f"rank {rank} chose other pages than rank 0"
        )
    owners = [p % n for p in first["prefix"]]
    assert [p % n for p in first["host"]] == owners, f"host {first['host']} vs device {first['prefix']}"
    assert [p % n for p in first["loaded"]] == owners, f"loaded {first['loaded']} vs device {first['prefix']}"
    assert not set(first["loaded"]) & set(first["prefix"]), f"the load-back reused the source pages {first['prefix']}"


def test_a_load_failing_half_way_raises_and_completes_nothing(runs):
    for mode, ranks in runs.items():
        for rank, r in enumerate(ranks):
            f = r["failed_load"]
            assert f["raised"] == "injected host-to-device transfer failure", f"{mode}, rank {rank}: {f}"
            assert f["new_acks"] == 0 and f["queued"] == 0, f"{mode}, rank {rank}: a failed load completed: {f}"


@pytest.mark.parametrize("sharded,replicated", [("sharded", "replicated"), ("sharded-cp3", "replicated-cp3")])
def test_host_bytes_per_rank_are_a_nth_of_replicated(runs, sharded, replicated):
    n = RUNS[sharded][1]
    (replicated, *_) = runs[replicated]
    kv_shape, idx_shape = replicated["host_shapes"]
    padding = kv_shape[0] * (HC.PAGE * kv_shape[-1] * 2 + 2 * idx_shape[-1])  # one latent, two index pages a layer
    for rank, r in enumerate(runs[sharded]):
        assert (r["host_nbytes"] - padding) * n == replicated["host_nbytes"] - padding, (
            f"rank {rank}: {r['host_nbytes']} host bytes vs {replicated['host_nbytes']} replicated"
        )
        owned = sum(1 for p in r["host"] if p % n == rank)
        assert r["host_pages_written"] == owned, f"rank {rank}: {r['host_pages_written']} host pages, owns {owned}"
    assert replicated["host_pages_written"] == HC.CACHED_PAGES
    print(
        f"{n=}: host bytes per rank: sharded {runs[sharded][0]['host_nbytes']}, replicated {replicated['host_nbytes']}"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
