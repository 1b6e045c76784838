"""CPU (one spawned process): SGLang 0.5.23's HiCache host tier under its own KV
sharding (what the plugin's flag turns on), over the plugin's subclass of its sharded DSA pool.

What runs is SGLang's own code (see sglang_hicache_harness.py for the list and the two stand-ins
for CUDA-only pieces): its `PageInterleaveDSATokenToKVPool` of the per-rank size with its
`PageShardSpec`, its owner-classed `PageInterleavePoolAllocator(..., shard_spec=spec)`, its DSA
host pools, built by its assembler from the device pool, and its `HybridCacheController` writing a
chain of pages back to host and loading it into fresh device pages. N CP ranks are N pools in one
process: write-back and load-back never communicate.

Checked, at N = 2 and N = 3:
- each rank's device pool is the plugin's subclass and its host tier is wrapped by SGLang's
  `PageInterleaveHostPool` (owner-matched host slots);
- every rank allocates the same device pages, host slots and load-back pages (mirrored decisions);
- after the round trip each rank's shard holds, at the fresh pages it owns, the chain's latent
  rows and index pages bit for bit, the same bytes SGLang's unmodified pool (replicated) holds
  after its own round trip, and nothing else in the shard changed;
- each rank's host tier received only the pages it owns;
- host bytes per rank, measured from the allocated host tensors, are 1/N of the replicated host
  pool's for the same logical capacity (less SGLang's fixed padding pages).

A model forward over a loaded-back prefix and a load that fails half-way are in
test_sglang_ext_hicache_forward.py (docs/sglang_plugin.md, section HiCache).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_hicache_harness as HC  # noqa: E402
from helpers import sglang_model_harness as H  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu-unit")

CASES = ((2, 5), (3, 7))  # (CP ranks, pages in the chain); chains start on owner 1 and wrap around
PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool"


@pytest.fixture(scope="module")
def trips(tmp_path_factory):
    path = H.write_checkpoint(str(tmp_path_factory.mktemp("tiny_v32")))
    (results,) = run_ranks(HC.round_trips, 1, args=(path, CASES), timeout_s=600)
    return dict(zip(CASES, results))


def _rows(page: int, n: int) -> slice:
    local = page // n
    return slice(local * HC.PAGE, (local + 1) * HC.PAGE)


@pytest.mark.parametrize("case", CASES, ids=[f"N={n}" for n, _ in CASES])
def test_every_rank_makes_the_same_choices_and_host_pages_keep_their_owners(trips, case):
    n, num_pages = case
    t = trips[case]
    assert t["pool_modules"] == [PLUGIN_POOL] * n, f"{n=}: {t['pool_modules']}"
    assert t["host_pools"] == ["PageInterleaveHostPool"] * n, f"{n=}: {t['host_pools']}"
    assert [p % n for p in t["dev"]] == [(1 + i) % n for i in range(num_pages)], (
        f"{n=}: {t['dev']} not cyclic from owner 1"
    )
    assert [p % n for p in t["host"]] == [p % n for p in t["dev"]], f"{n=}: host {t['host']} vs device {t['dev']}"
    assert [p % n for p in t["new"]] == [p % n for p in t["host"]], f"{n=}: loaded {t['new']} vs host {t['host']}"


@pytest.mark.parametrize("case", CASES, ids=[f"N={n}" for n, _ in CASES])
def test_loaded_pages_hold_the_chain_bit_for_bit_like_the_replicated_pool(trips, case):
    n, _ = case
    t = trips[case]
    for i, (page, page_rep) in enumerate(zip(t["new"], t["new_rep"])):
        owner = page % n
        for layer in range(HC.LAYERS):
            latent, index = t["content"][layer][0][i], t["content"][layer][1][i]
            kv, idx = t["shards"][owner][layer]
            where = f"{n=}, chain page {i} (logical {page}, rank {owner}), layer {layer}"
            assert torch.equal(kv[_rows(page, n), 0].view(torch.uint8), latent.view(torch.uint8)), (
                f"{where}: latent rows"
            )
            assert torch.equal(idx[page // n], index), f"{where}: index page"
            kv_rep, idx_rep = t["replicated_new"][i][layer]
            assert torch.equal(kv_rep.view(torch.uint8), kv[_rows(page, n), 0].view(torch.uint8)), (
                f"{where}: vs replicated"
            )
            assert torch.equal(idx_rep, idx[page // n]), f"{where}: index vs replicated"


@pytest.mark.parametrize("case", CASES, ids=[f"N={n}" for n, _ in CASES])
def test_each_rank_moves_only_its_own_pages(trips, case):
    n, _ = case
    t = trips[case]
    for rank in range(n):
        for layer in range(HC.LAYERS):
            kv, idx = t["shards"][rank][layer]
            written = {p // n for p in t["dev"] + t["new"] if p % n == rank}
            for local in range(idx.shape[0]):
                if local in written:
                    continue  # the chain's source pages and the pages it was loaded into
                untouched = kv[local * HC.PAGE : (local + 1) * HC.PAGE].view(torch.uint8)
                assert bool((untouched == 0xFF).all() and (idx[local] == 0xFF).all()), (
                    f"{n=}, rank {rank}, layer {layer}: local page {local} changed"
                )
        host = t["host_kv"][rank]  # [layers, rows, 1, 576]
        host_pages = host.view(host.shape[0], -1, HC.PAGE * 576 * 2 // host.element_size())
        nonzero = {int(p) for p in (host_pages != 0).any(-1).any(0).nonzero().flatten()}
        owned = {p // n for p in t["host"] if p % n == rank}
        assert nonzero == owned, f"{n=}, rank {rank}: host pages written {sorted(nonzero)}, owned {sorted(owned)}"


@pytest.mark.parametrize("case", CASES, ids=[f"N={n}" for n, _ in CASES])
def test_host_bytes_per_rank_are_a_nth_of_replicated(trips, case):
    n, _ = case
    t = trips[case]
    # SGLang pads each host pool with one latent page and two index pages (per layer), whatever its size
    (kv_shape, idx_shape) = t["host_shapes"][0]
    padding = HC.LAYERS * (HC.PAGE * 576 * 2 + 2 * idx_shape[-1])
    for rank, nbytes in enumerate(t["host_nbytes"]):
        assert (nbytes - padding) * n == t["replicated_host_nbytes"] - padding, (
            f"{n=}, rank {rank}: {nbytes} host bytes vs {t['replicated_host_nbytes']} replicated ({t['host_shapes']})"
        )
    print(f"N={n}: host bytes per rank {t['host_nbytes'][0]}, replicated {t['replicated_host_nbytes']}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
