"""The correctness oracle end to end: single rank, replicated CP and shared-KV CP prefill of the
reference model agree on logits (float32, 1e-5 relative), on every layer's top-k selections, and
on the KV at every logical slot, over chunked prefill with cached prefixes ending mid-page."""

import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.oracle import RTOL, Scenario, run_oracle

register_cpu_ci(est_time=394, suite="nsa-cp-test-cpu")

# Three chunks: long and very short requests (shorter than 2N), continuations whose cached prefix
# ends mid-page, a request that first appears in the last chunk.
THREE_CHUNKS = [
    [("a", 100), ("b", 3), ("c", 41)],
    [("a", 37), ("c", 70), ("d", 1)],
    [("a", 5), ("b", 64), ("c", 1), ("d", 90), ("e", 2)],
]


@pytest.mark.parametrize(
    "cp_size, split, page_size",
    [
        (2, "zigzag", 16),
        (2, "interleave", 64),
        (3, "zigzag", 64),
        (3, "interleave", 16),
        (4, "zigzag", 16),
        (4, "interleave", 64),
    ],
)
def test_cp_paths_match_the_single_rank(cp_size, split, page_size):
    scenario = Scenario(THREE_CHUNKS, cp_size=cp_size, split=split, page_size=page_size, seed=cp_size)
    report = run_oracle(scenario)
    for path in ("replicated", "shared"):
        checks = report["paths"][path]
        assert checks["topk_identical"], path
        assert checks["max_rel_logit_err"] <= RTOL, (path, checks["max_rel_logit_err"])
        assert checks["max_rel_kv_err"] <= RTOL, (path, checks["max_rel_kv_err"])
    assert report["ok"]
    shared = report["paths"]["shared"]
    replicated = report["paths"]["replicated"]
    assert max(shared["kv_bytes_per_rank"]) * cp_size == replicated["kv_bytes_per_rank"][0]
    # Every page of the requests is held by every replicated rank and by exactly one shared rank.
    assert (
        sum(shared["held_pages_per_rank"])
        == replicated["held_pages_per_rank"][0]
        == report["paths"]["single"]["held_pages"]
    )
    # The shared path's tail moves one row per request per rank, never the whole chunk.
    assert "tail_full" not in shared["bytes_moved"] and "tail_narrow" not in replicated["bytes_moved"]


def test_pages_borrowed_across_owner_classes_are_still_persisted():
    # The pool is sized exactly, so the page-aligned second chunk exhausts an owner class and
    # borrows: its rows must be persisted from the gathered chunk, as the third chunk reads them.
    chunks = [[("r1", 150)], [("r0", 200), ("r1", 160), ("r2", 130)], [("r2", 20)]]
    report = run_oracle(Scenario(chunks, cp_size=4, page_size=16))
    assert report["ok"], report["paths"]["shared"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_long_prompt_on_page_aligned_zigzag_uses_direct_writes(prefetch):
    # Long enough for every request to have 2N whole pages: the page-aligned split holds, each
    # rank writes only what it computed, and history is materialized from the owners, one
    # layer ahead or in place.
    chunks = [[("a", 300), ("b", 260)], [("a", 290), ("b", 333)]]
    report = run_oracle(Scenario(chunks, cp_size=2, page_size=16, prefetch=prefetch))
    assert report["ok"], report["paths"]
    assert report["paths"]["shared"]["bytes_moved"]["materialize_latent"]["calls"] == 3  # one per layer, chunk 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
