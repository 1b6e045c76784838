"""The trace replay's cache against SGLang's real servers (benchmark/validate_trace_replay.py), on
the trace's requests where capacity matters: the replay's contrast set (a request whose reused
prefix the replicated pool evicts and the shared one keeps, the request it reuses and those that
evict it). SGLang's `meta_info.cached_tokens` equals the replay's cache pass for every request on
both prefills, and the two prefills' counts differ on the last request as the replay says. The full
run and its result: docs/trace_replay.md."""

import os
import pathlib
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=115, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import validate_trace_replay as V  # noqa: E402


def test_the_contrast_set_is_one_where_the_pools_cache_differently():
    requests = V.scaled_requests(str(ROOT / "benchmark" / "data" / "mooncake_conversation_trace.jsonl.gz"), 24)
    chosen = V.contrast_requests(requests, V.RANK_TOKENS, 2 * V.RANK_TOKENS)
    small, large = (V.simulated_cached_tokens(chosen, t) for t in (V.RANK_TOKENS, 2 * V.RANK_TOKENS))
    assert small[:-1] == large[:-1] and small[-1] < large[-1], (small, large)
    assert V.simulated_cached_tokens(chosen, 100 * V.RANK_TOKENS) == large  # the large pool evicts nothing
    with pytest.raises(ValueError, match="no request"):
        V.contrast_requests(requests[:3], V.RANK_TOKENS, 2 * V.RANK_TOKENS)


def test_sglang_servers_cache_what_the_replay_caches_where_capacity_matters(tmp_path):
    result = V.run(24, tmp_path, progress=print, contrast=True)
    per = result["per_request"]
    for name, summary in result["summary"].items():
        assert summary["differ"] == [], (name, [per[i] for i in summary["differ"]])
    assert per[0]["val_shared_sglang"] == 0  # the first request shares nothing
    # the shared prefill kept the prefix that the replicated one evicted, on SGLang's own servers
    assert per[-1]["val_shared_sglang"] > per[-1]["val_replicated_sglang"], per
    assert result["capacity_tokens"]["val_shared"] > result["capacity_tokens"]["val_replicated"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
