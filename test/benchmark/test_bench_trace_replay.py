"""The trace replay (benchmark/bench_trace_replay.py) on CPU: hand-made traces through SGLang's
own radix cache give the hits and evictions worked out by hand; the capacity arithmetic matches
SGLang's pool and scratch; the cost model reproduces the H200 chunks it was fitted to; the
command writes its table, JSON and plot and refuses a bad option with one line."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import bench_trace_replay as B  # noqa: E402

# Every batch takes exactly 1 s (c0), so with arrivals 10 s apart each request runs alone.
ONE_SECOND = {"c0_ms": 1000.0, "c1_ms_per_token": 0.0, "c2_ms_per_pair": 0.0, "outside_ms": 0.0}
FLAT_MODEL = {"layers": 1, "layers_measured": 1, "cp_measured": 1, "gpus": 1,
              "fits": {f"{p}/{d}": ONE_SECOND for p in ("replicated", "shared") for d in ("bf16", "fp8")}}  # fmt: skip


def req(t_s, input_len, hash_ids):
    return B.TraceRequest(float(t_s), input_len, B.page_keys(hash_ids, input_len))


def run(requests, capacity_pages, path="replicated", cp=2, contexts=None, context_len=B.CONTEXT_LEN):
    cfg = B.ReplayConfig(cp, "bf16", path, contexts, capacity_pages * B.PAGE, context_len=context_len)
    return B.replay(requests, cfg, FLAT_MODEL)


def test_page_keys_follow_the_docstring_example():
    # 1100 tokens: blocks 7, 9 give 8 pages each (keys 56..63, 72..79), block 4 one full page (32)
    assert list(B.page_keys([7, 9, 4], 1100)) == [*range(56, 64), *range(72, 80), 32]
    assert list(B.page_keys([5], 63)) == []  # no full page: nothing to cache


def test_shared_prefix_hits_whole_pages_up_to_input_minus_one():
    # A [1,2] 1024 tokens: 16 pages cached.  B [1,3]: block 1 = 8 pages hit -> 512 tokens.
    # C [1,2] 1024: may reuse at most (1024 - 1) // 64 = 15 pages -> 960 tokens (one page recomputed).
    s = run([req(0, 1024, [1, 2]), req(10, 1024, [1, 3]), req(20, 1024, [1, 2])], capacity_pages=100)
    assert (s.served, s.rejected, s.input_tokens) == (3, 0, 3072)
    assert s.cached_tokens == 512 + 960, s
    assert s.computed_tokens == 3072 - 1472, s


def test_partial_last_block_caches_its_full_pages_only():
    # [7,9,4] 1100 tokens: 17 full pages inserted, 12 tokens never cached.
    # The same again: limit (1100 - 1) // 64 = 17 pages -> 1088 hit, 12 computed.
    # [7,9,5]: blocks 7 and 9 only (16 pages) -> 1024 hit; 76 computed.
    s = run([req(0, 1100, [7, 9, 4]), req(10, 1100, [7, 9, 4]), req(20, 1100, [7, 9, 5])], capacity_pages=100)
    assert s.cached_tokens == 1088 + 1024, s
    assert s.computed_tokens == 1100 + 12 + 76, s


def test_eviction_is_sglangs_lru_at_a_capacity_of_six_pages():
    # Requests of 129 tokens: 3 pages while running, 2 full pages inserted, the partial page freed;
    # a repeat may reuse (129 - 1) // 64 = 2 pages = 128 tokens, the whole node (no split).
    # t=0  A[1]: cache A                 (4 free)
    # t=10 B[2]: cache A B               (2 free)
    # t=20 C[3]: needs 3, 2 free -> evict the LRU leaf A (2 pages); cache B C
    # t=30 D[2]: hits B (128 tokens), touching it; needs 1 page
    # t=40 E[1]: A is gone, miss; evicts C (last used t=20; B was touched at t=30) -> cache B E
    # t=50 F[3]: C is gone, miss; evicts B (t=30) -> cache E F
    # t=60 G[2]: B is gone, miss.  FIFO eviction would have evicted B at t=40 and let F hit C.
    hashes = [[1], [2], [3], [2], [1], [3], [2]]
    s = run([req(10 * i, 129, h) for i, h in enumerate(hashes)], capacity_pages=6)
    assert (s.served, s.rejected) == (7, 0)
    assert s.cached_tokens == 128, s
    assert s.computed_tokens == 7 * 129 - 128, s


def test_a_request_longer_than_the_cache_is_refused_like_sglang_does():
    # 4 pages of cache: 300 tokens need 5 pages -> refused (SGLang rejects prompts over its
    # KV capacity); the two 129-token requests around it run and the second hits the first.
    s = run([req(0, 129, [1]), req(10, 300, [2]), req(20, 129, [1])], capacity_pages=4)
    assert (s.served, s.rejected) == (2, 1), s
    assert s.cached_tokens == 128 and s.input_tokens == 258, s


def test_scratch_prefix_region_defers_a_batch_past_c_contexts():
    # context 512 at CP 2, C = 1: prefix region ceil(512, 2 x 64) = 512 tokens. A [1] 300 tokens
    # caches 4 pages; then B, C, D (the same prompt) arrive together, each reusing 4 pages, padded
    # to 2 x ceil(4 / 2) = 4 pages = 256 tokens: B and C fill the region, D waits for the next
    # batch. Batches: A, {B, C}, {D} = 3; with C = 2 (1024 tokens) or replicated: A, {B, C, D} = 2.
    reqs = [req(0, 300, [1])] + [req(10, 300, [1]) for _ in range(3)]
    one = run(reqs, 100, "shared", contexts=1, context_len=512)
    two = run(reqs, 100, "shared", contexts=2, context_len=512)
    repl = run(reqs, 100, "replicated", context_len=512)
    assert (one.batches, one.deferred_by_scratch) == (3, 1), one
    assert (two.batches, two.deferred_by_scratch) == (2, 0), two
    assert repl.batches == 2, repl
    for s in (one, two, repl):
        assert s.cached_tokens == 3 * 256, s
    # D finishes a second later with C = 1: TTFTs (s) 1 (A), then 1, 1, 2 against 1, 1, 1
    assert sorted(one.ttft_s) == [1.0, 1.0, 1.0, 2.0] and sorted(repl.ttft_s) == [1.0] * 4


def test_capacity_arithmetic_matches_sglangs_pool_and_scratch():
    # bf16: 576 x 2 B latent + 128 B index K + 4 B scale = 1284 B per layer; fp8: 656 + 132 = 788
    assert B.measure_kv_bytes_per_token("bf16") == 78 * 1284
    assert B.measure_kv_bytes_per_token("fp8") == 78 * 788
    # CP 8, C = 8, chunk 8192: 2 x (8 x 202752 + 8192 + 64) rows x 1284 B
    assert B.scratch_bytes(8, "bf16", 8, 8192) == 2 * (8 * 202752 + 8256) * 1284
    budget = 10 * B.GIB
    assert B.capacity_tokens(budget, 61464, 4, "replicated") == budget // 61464 // 64 * 64
    assert B.capacity_tokens(budget, 61464, 4, "shared", 1 << 30) == 4 * ((budget - (1 << 30)) // 61464 // 64 * 64)


def test_cost_model_reproduces_the_h200_chunks_within_5_percent():
    model = B.fit_cost_model()
    as_measured = dict(model, layers=model["layers_measured"], gpus=model["cp_measured"])  # no scaling
    for name, fit in model["fits"].items():
        path, kv = name.split("/")
        assert fit["max_rel_err"] <= 0.05, f"{name}: {fit['max_rel_err']:.3f}"
        for p in fit["points"]:
            got = 1000 * B.chunk_seconds(as_measured, path, kv, [(p["new"], p["hist"])])
            assert abs(got - p["measured_ms"]) <= 0.05 * p["measured_ms"], f"{name} {p}: model {got:.1f} ms"
    assert len(model["fits"]["replicated/bf16"]["points"]) == 4 + 8 + 16 + 2  # every timed chunk


def _tiny_trace(path):
    lines = [{"timestamp": 500 * i, "input_length": 700 + 300 * (i % 3), "output_length": 10,
              "hash_ids": [0, 100 + i % 4, 200 + i]} for i in range(12)]  # fmt: skip
    for line in lines:
        line["hash_ids"] = line["hash_ids"][: -(-line["input_length"] // 512)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _bench(*args):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmark" / "bench_trace_replay.py"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_writes_table_json_and_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    run_ = _bench("--trace", str(trace), "--out", str(tmp_path), "--cp", "2", "--kv-dtypes", "fp8",
                  "--scratch-contexts", "1,8", "--budget-gib", "4", "--no-progress")  # fmt: skip
    assert run_.returncode == 0, run_.stderr[-3000:]
    assert run_.stdout.startswith("machine: ") and "TTFT p50 s" in run_.stdout, run_.stdout
    raw = json.loads((tmp_path / "bench_trace_replay.json").read_text())
    assert [(r["path"], r["scratch_contexts"]) for r in raw["rows"]] == [
        ("replicated", None),
        ("shared", 1),
        ("shared", 8),
    ]
    for r in raw["rows"]:
        assert r["served"] == 12 and 0 < r["prefix_hit_fraction"] < 1, r
    assert (tmp_path / "bench_trace_replay.png").stat().st_size > 0
    assert json.loads((tmp_path / "bench_trace_replay_cost_model.json").read_text())["fits"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--cp", "1"], "--cp"),
        (["--kv-dtypes", "fp16"], "--kv-dtypes"),
        (["--speed", "0"], "--speed"),
        (["--scratch-contexts", "0"], "--scratch-contexts"),
        (["--trace", "/nonexistent.jsonl"], "--trace"),
        (["--limit", "0"], "--limit"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_option_exits_2_with_one_line(args, words):
    run_ = _bench(*args)
    assert run_.returncode == 2, (args, run_.returncode, run_.stderr)
    lines = run_.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_trace_replay.py: error: ") and words in lines[0], lines
    assert run_.stdout == ""


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
