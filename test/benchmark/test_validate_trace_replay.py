"""The trace replay's cache against SGLang's real servers (benchmark/validate_trace_replay.py), on a
handful of the trace's requests: SGLang's `meta_info.cached_tokens` equals the replay's cache pass
for every request, on the shared-KV prefill and on the replicated one. The full run and its
result: docs/trace_replay.md."""

import os
import pathlib
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=300, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import validate_trace_replay as V  # noqa: E402


def test_sglang_servers_cache_what_the_replay_caches(tmp_path):
    result = V.run(8, tmp_path, progress=print)
    for name, summary in result["summary"].items():
        assert summary["differ"] == [], (name, [result["per_request"][i] for i in summary["differ"]])
    # the first request of the scaled trace shares nothing; later turns reuse earlier ones
    assert result["per_request"][0]["val_shared_sglang"] == 0
    assert sum(r["val_shared_sglang"] for r in result["per_request"]) > 0, result["per_request"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
