"""The trace replay (benchmark/bench_trace_replay.py and its trace_*.py modules) on CPU: hand-made
traces through SGLang's own radix cache give the hits and evictions worked out by hand, and the
block-level cache of the sweep gives the same; the node budget follows SGLang's rules and its
mem_fraction_static and per-rank chunk are what SGLang's own argument resolution computes; routing
follows sglang-router's cache-aware rules; the cost model reproduces the H200 chunks it was fitted
to; the command writes its rows, JSON and plot and refuses a bad option with one line."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="nsa-cp-test-cpu")

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))
sys.path.insert(0, str(ROOT / "test" / "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import bench_trace_replay as B  # noqa: E402
import trace_budget as TB  # noqa: E402
import trace_cache as TC  # noqa: E402
import trace_cost as TK  # noqa: E402
import trace_routing as TR  # noqa: E402
from fake_layer_terms import FakeTerms  # noqa: E402

CACHES = [TC.PagePrefixCache, TC.FastPageCache]


def req(t_s, input_len, hash_ids):
    return TC.TraceRequest(float(t_s), input_len, TC.page_keys(hash_ids, input_len), TC.conversation_key(hash_ids),
                           hash_ids)  # fmt: skip


def serve_all(cache_cls, requests, capacity_pages):
    cache = cache_cls(capacity_pages)
    keys = (lambda r: r.page_keys) if cache_cls is TC.PagePrefixCache else (lambda r: r.blocks)
    return [cache.serve(keys(r), r.input_len) for r in requests]


def test_page_keys_follow_the_docstring_example():
    # 1100 tokens: blocks 7, 9 give 8 pages each (keys 56..63, 72..79), block 4 one full page (32)
    assert list(TC.page_keys([7, 9, 4], 1100)) == [*range(56, 64), *range(72, 80), 32]
    assert list(TC.page_keys([5], 63)) == []  # no full page: nothing to cache


@pytest.mark.parametrize("cache_cls", CACHES)
def test_shared_prefix_hits_whole_pages_up_to_input_minus_one(cache_cls):
    # A [1,2] 1024 tokens: 16 pages cached.  B [1,3]: block 1 = 8 pages hit.
    # C [1,2] 1024: may reuse at most (1024 - 1) // 64 = 15 pages (one page recomputed).
    hits = serve_all(cache_cls, [req(0, 1024, [1, 2]), req(1, 1024, [1, 3]), req(2, 1024, [1, 2])], 100)
    assert hits == [0, 8, 15]


@pytest.mark.parametrize("cache_cls", CACHES)
def test_partial_last_block_caches_its_full_pages_only(cache_cls):
    # [7,9,4] 1100 tokens: 17 full pages inserted, 12 tokens never cached. The same again: limit
    # (1100 - 1) // 64 = 17 pages. [7,9,5]: blocks 7 and 9 only (16 pages).
    hits = serve_all(cache_cls, [req(0, 1100, [7, 9, 4]), req(1, 1100, [7, 9, 4]), req(2, 1100, [7, 9, 5])], 100)
    assert hits == [0, 17, 16]


@pytest.mark.parametrize("cache_cls", CACHES)
def test_eviction_is_sglangs_lru_at_a_capacity_of_six_pages(cache_cls):
    # Requests of 129 tokens: 3 pages while running, 2 full pages kept, the partial page freed;
    # a repeat may reuse (129 - 1) // 64 = 2 pages.
    # A[1]: cache A (4 free); B[2]: A B (2 free); C[3]: needs 3 -> evict the LRU leaf A; cache B C
    # D[2]: hits B (2 pages), touching it; E[1]: A is gone, miss; evicts C (B was touched) -> B E
    # F[3]: C is gone, miss; evicts B -> E F; G[2]: B is gone, miss. FIFO would have let F hit C.
    hashes = [[1], [2], [3], [2], [1], [3], [2]]
    hits = serve_all(cache_cls, [req(i, 129, h) for i, h in enumerate(hashes)], 6)
    assert hits == [0, 0, 0, 2, 0, 0, 0]


@pytest.mark.parametrize("cache_cls", CACHES)
def test_a_request_longer_than_the_cache_is_refused_like_sglang_does(cache_cls):
    # 4 pages of cache: 300 tokens need 5 pages -> refused; the requests around it run.
    hits = serve_all(cache_cls, [req(0, 129, [1]), req(1, 300, [2]), req(2, 129, [1])], 4)
    assert hits == [0, None, 2]


def test_block_cache_matches_sglangs_tree_on_the_trace():
    # The sweep's block-level cache against SGLang's UnifiedRadixCache, request by request, on
    # the trace's first 1500 requests at a capacity that evicts (SGLang evicts whole radix nodes,
    # the block cache chains of blocks with one access time: nearly, not always, the same pages).
    requests = TC.load_trace(B.DEFAULT_TRACE, limit=1500)
    capacity = 200_000
    sglang = TC.cache_pass(requests, capacity)
    fast = TC.fast_cache_pass(requests, capacity)
    total = sum(r.input_len for r in requests)
    same = sum(a == b for a, b in zip(sglang, fast))
    gap = abs(sum(a or 0 for a in sglang) - sum(b or 0 for b in fast)) * TC.PAGE / total
    assert same >= 0.99 * len(requests), f"{len(requests) - same} requests differ"
    assert gap <= 0.002, f"hit fractions differ by {100 * gap:.2f} points"


def test_attention_tp_and_weights_follow_sglangs_layout_rules():
    glm5 = TB.load_model("glm5")
    # MLA + indexer per layer: the ~174M parameters CP replicates at attention TP 1
    assert TB.attention_params_per_layer(glm5) == 174_391_296
    assert [TB.Layout("shared", w).attn_tp for w in (2, 4, 8)] == [4, 2, 1]
    assert [TB.Layout("dp_attention", w).attn_tp for w in (2, 4, 8)] == [4, 2, 1]
    assert TB.Layout("dp_attention", 8).pools == 8 and TB.Layout("shared", 8).pools == 1
    terms = {w: dict((n, b) for n, b, _ in TB.weight_terms(glm5, TB.Layout("replicated", w))) for w in (2, 8)}
    split = "attention q_b/kv_b/o_proj"
    assert terms[8][split] == pytest.approx(4 * terms[2][split])  # attention TP 4 -> 1
    assert terms[8]["routed experts"] == terms[2]["routed experts"]  # MoE over all 8 GPUs either way
    # DP attention splits the embedding over attention TP; CP keeps it over TP 8
    dp8 = dict((n, b) for n, b, _ in TB.weight_terms(glm5, TB.Layout("dp_attention", 8)))
    assert dp8["embedding"] == pytest.approx(8 * terms[8]["embedding"])


def test_capacity_per_layout():
    glm5, kv = TB.load_model("glm5"), 61464
    rep = TB.node_budget(glm5, TB.Layout("replicated", 8), "fp8", kv, 0)
    sh = TB.node_budget(glm5, TB.Layout("shared", 8), "fp8", kv, 1 << 30)
    dp = TB.node_budget(glm5, TB.Layout("dp_attention", 8), "fp8", kv, 0)
    assert rep.capacity_tokens == rep.tokens_per_rank == rep.pool_tokens
    assert sh.capacity_tokens == 8 * sh.tokens_per_rank and sh.tokens_per_rank < rep.tokens_per_rank  # scratch
    assert dp.capacity_tokens == 8 * dp.pool_tokens and dp.pool_tokens < rep.pool_tokens  # embedding / attn TP 1
    assert rep.host_tokens_per_pool == 2 * rep.pool_tokens and sh.host_tokens_per_pool == 2 * sh.pool_tokens


def test_pool_rows_are_what_sglangs_pool_configurator_computes():
    # DefaultPoolConfigurator.calculate_pool_sizes: (budget - fixed scratch) // cell size, in pages
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    glm5, kv = TB.load_model("glm5"), 61464
    scratch = B.scratch_bytes(8, "fp8", 1, 8192, glm5["max_position_embeddings"])
    for layout in (TB.Layout("shared", 8), TB.Layout("replicated", 4), TB.Layout("dp_attention", 2)):
        budget = TB.node_budget(glm5, layout, "fp8", kv, scratch)
        conf = object.__new__(DefaultPoolConfigurator)  # its arithmetic, without a model runner
        conf._cell_size, conf._zero_kv_max_tokens = kv, 0
        conf._fixed_overhead_bytes = budget.scratch_bytes
        assert conf.calculate_pool_sizes(budget.kv_pool_bytes, TB.PAGE).max_total_num_tokens == budget.tokens_per_rank


def test_mem_fraction_and_per_rank_chunk_are_what_sglang_resolves():
    # SGLang's own argument resolution for a GLM-5 PD prefill on an H200 (device memory and
    # capability stood in, and the prefill CUDA graph's CUDA default, `breakable`, forced: CPU
    # torch defaults it off), against the budget's reproduction of its rule, for every layout.
    script = textwrap.dedent(f"""
        import json, sys, tempfile
        from unittest import mock
        import torch
        from sglang.srt.server_args import ServerArgs
        import sglang.srt.arg_groups.memory_hook as mh
        cfg = json.load(open({str(TB.MODELS["glm5"])!r})); cfg.pop("_source")
        d = tempfile.mkdtemp(); json.dump(cfg, open(d + "/config.json", "w"))
        out = {{}}
        layouts = (("replicated", dict(attn_cp_size=8)), ("dp_attention", dict(dp_size=8, enable_dp_attention=True)),
                   ("tp", {{}}), ("layer_split", dict(attn_cp_size=8, enable_prefill_cp=True, cp_strategy="interleave",
                                                      enable_dsa_cache_layer_split=True)))
        for name, extra in layouts:
            with mock.patch.object(mh, "get_device_memory_capacity", lambda device=None: {TB.H200_MIB}), \\
                 mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)), \\
                 mock.patch.object(torch.cuda, "is_available", lambda: True), \\
                 mock.patch("sglang.srt.model_executor.cuda_graph_config.default_prefill_backend", lambda: "breakable"):
                a = ServerArgs(model_path=d, tp_size=8, disaggregation_mode="prefill", device="cuda",
                               skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3", **extra)
                a.resolve_once()
            r = a.resolved_dict()
            out[name] = [r["mem_fraction_static"], r["chunked_prefill_size"], r["page_size"], r["hicache_ratio"],
                         r["cuda_graph_config"]["prefill"]["backend"] == "breakable", r["load_balance_method"]]
        print(json.dumps(out))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for path, resolved in got.items():
        layout = TB.Layout(path, 8)
        ours = [
            TB.mem_fraction_static(8192, prefill_cuda_graph=layout.prefill_cuda_graph),
            TB.per_rank_chunk(8192, layout),
            TB.PAGE,
            TB.HICACHE_RATIO,
            layout.prefill_cuda_graph,
        ]
        assert resolved[:5] == ours, (path, resolved, ours)
        # a PD prefill's DP ranks follow the bootstrap room (trace_routing.route_dp's default dispatch)
        assert resolved[5] == "follow_bootstrap_room", resolved
    assert got["dp_attention"][0] == 0.893 and got["replicated"][0] == 0.904  # the 1.5 GiB graph reserve


def test_layer_split_cell_is_sglangs_effective_layers():
    # SGLang's own sizing functions under its layer-split switch, on a stand-in model runner
    from types import SimpleNamespace

    from sglang.srt.layers.cp.utils import get_glm_dsa_layer_split_effective_num_layers
    from sglang.srt.runtime_context import get_parallel

    glm5 = TB.load_model("glm5")
    runner = SimpleNamespace(is_draft_worker=False, use_mla_backend=True,
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=glm5["architectures"],
                                                                                  index_topk=2048)))  # fmt: skip
    for width in (2, 4, 8):
        with get_parallel().override(attn_cp_size=width, enable_dsa_cache_layer_split=True):
            latent = get_glm_dsa_layer_split_effective_num_layers(runner, 78)
        got = TB.layer_split_layers(78, width)
        assert got[0] == latent, (width, got, latent)
    assert TB.layer_split_layers(78, 8) == (11, 11, 9)  # 6 ranks own 10 layers, 2 own 9
    assert TB.cell_bytes(glm5, TB.Layout("layer_split", 8), "fp8") == 11 * 656 + 11 * 132


def test_capacity_of_every_layout_at_cp8_fp8():
    # Every term of the budget is printed; these are its sums (GLM-5 FP8, fp8 KV, 8 x H200, C=1)
    glm5 = TB.load_model("glm5")
    scratch = B.scratch_bytes(8, "fp8", 1, 8192, glm5["max_position_embeddings"])
    got = {p: TB.node_budget(glm5, TB.Layout(p, 8), "fp8", 61464, scratch) for p in TB.PATHS}
    rows = {p: b.tokens_per_rank for p, b in got.items()}
    # one pool's bytes over each layout's cell: the same KV GiB for the CP layouts (attention TP 1)
    assert got["replicated"].kv_pool_bytes == got["shared"].kv_pool_bytes == got["layer_split"].kv_pool_bytes
    assert rows["layer_split"] == got["layer_split"].kv_pool_bytes // (11 * 788) // 64 * 64
    assert (
        got["shared"].capacity_tokens == 8 * rows["shared"]
        and got["dp_attention"].capacity_tokens == 8 * rows["dp_attention"]
    )
    # DP and TP keep the prefill graph (0.893), CP does not (0.904)
    assert got["dp_attention"].mem_fraction_static == got["tp"].mem_fraction_static == 0.893
    # plain TP splits attention 8 ways: more room than replicated CP 8, which replicates it
    assert got["tp"].capacity_tokens > got["replicated"].capacity_tokens
    assert got["shared"].capacity_tokens > got["layer_split"].capacity_tokens > got["dp_attention"].capacity_tokens
    with pytest.raises(ValueError, match="tp: width must be"):
        TB.Layout("tp", 4)


def test_routing_sticky_round_robin_and_cache_aware():
    reqs = [req(i, 2048, [0, 100 + i % 3, 7, 8]) for i in range(9)]  # 3 conversations, one turn each 1 s
    sticky = TR.route(reqs, 4, "sticky")
    assert all(sticky[i] == sticky[i % 3] for i in range(9))
    assert TR.route(reqs, 4, "round_robin") == [i % 4 for i in range(9)]
    # cache-aware: a new conversation (match 1 block of 4 = 25 % <= 30 %) goes to the smallest tree;
    # its later turns (match 4 of 4) follow it
    ca = TR.route(reqs, 4, "cache_aware", tokens_per_s=1e9)
    assert ca[:3] == [0, 1, 2] and all(ca[i] == ca[i % 3] for i in range(9)), ca


def test_cache_aware_routing_balances_past_64_requests_in_flight():
    # 70 turns of one conversation at once (7 of 8 blocks shared), each taking 1000 s: after 65
    # on worker 0 (64 more than worker 1's 0, and over 1.5 x), the next goes to the idle worker
    # despite the match.
    reqs = [req(0.001 * i, 4096, [0, 5, 6, 7, 8, 9, 10, 1000 + i]) for i in range(70)]
    ca = TR.route(reqs, 2, "cache_aware", tokens_per_s=0.512)
    assert ca[:65] == [0] * 65 and ca[65] == 1, ca


def _cost(path, width, case="mid", terms=None, pool_rows=3_000_000):
    glm5 = TB.load_model("glm5")
    layout = TB.Layout(path, width)
    return TK.StepCost(terms or FakeTerms(err=0.0), glm5, path, width, layout.attn_tp, "fp8", case, 61464, pool_rows)


def test_step_cost_follows_the_layer_terms_and_the_streams():
    glm5, terms = TB.load_model("glm5"), FakeTerms(err=0.0)
    batch = [(8192, 65536)]
    # a CP-8 rank: 1/8 of the chunk's queries against the whole history, MoE over 8 GPUs
    shared = _cost("shared", 8).breakdown([batch])
    q, h = 1024, 65536 + 4096 - 512
    assert shared["attention_ms_per_layer"] == pytest.approx(terms.ms("attention", "fp8", q, h))
    assert shared["indexer_ms_per_layer"] == pytest.approx(terms.ms("indexer", "fp8", q, h))
    assert shared["moe_ms_per_layer"] == pytest.approx(terms.ms("moe", "fp8", 1024, 0))
    # the flag's history gather hides under the layer; layer split's 2 GB broadcast does not
    assert shared["side_collectives_ms_per_layer"] > 0 and shared["side_exposed_ms_per_layer"] == 0
    split = _cost("layer_split", 8).breakdown([batch])
    assert split["side_exposed_ms_per_layer"] > 1.0 and split["step_ms"] > 2 * shared["step_ms"]
    # a DP-8 rank runs its request whole on one GPU: 8 x the queries of a CP-8 rank
    dp = _cost("dp_attention", 8).breakdown([batch] + [[]] * 7)
    assert dp["indexer_ms_per_layer"] == pytest.approx(terms.ms("indexer", "fp8", 8192, 65536))
    assert dp["moe_ms_per_layer"] == shared["moe_ms_per_layer"]  # MoE over the 8 GPUs either way
    # plain TP: attention heads / 8, the indexer whole on every GPU
    tp = _cost("tp", 8).breakdown([batch])
    assert tp["attention_ms_per_layer"] == pytest.approx(terms.ms("attention", "fp8", 8192, 65536) / 8)
    assert tp["indexer_ms_per_layer"] == dp["indexer_ms_per_layer"]
    # layers: the MoE on the 75 MoE layers, the rest on all 78
    per_layer = shared["step_ms"] - shared["tail_ms"]
    moe_layers = glm5["num_hidden_layers"] - glm5["first_k_dense_replace"]
    rest = sum(shared[k] for k in ("attention_ms_per_layer", "indexer_ms_per_layer", "gemms_ms_per_layer",
                                   "store_ms_per_layer", "compute_collectives_ms_per_layer"))  # fmt: skip
    assert per_layer == pytest.approx(moe_layers * shared["moe_ms_per_layer"] + 78 * rest)


def test_cost_ranges_widen_with_the_fits_error_and_the_bus():
    terms = FakeTerms(err=0.1)
    ms = {case: _cost("replicated", 8, case, terms).step_ms([[(8192, 32768)]]) for case in TK.CASES}
    assert ms["low"] < ms["mid"] < ms["high"]
    with pytest.raises(ValueError, match="case"):
        _cost("shared", 8, "worst")


def test_node_steps_its_dp_ranks_together():
    # Flat 1 s steps: two ranks, one request each at t=0, and a second on rank 0 at t=0 too.
    class Flat:
        def step_ms(self, batches, loaded):
            return 1000.0

    ttft, busy = TK.simulate_node([[(0.0, 100, 0, 0), (0.0, 100, 0, 0)], [(0.0, 5000, 0, 0)]], 1024, Flat())
    # step 1: rank 0 takes both (200 tokens), rank 1 1024 of 5000; rank 1 needs 5 steps
    assert sorted(ttft) == [1.0, 1.0, 5.0] and busy == 5.0


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


def test_cli_writes_rows_json_and_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    run_ = _bench("--trace", str(trace), "--out", str(tmp_path), "--widths", "8", "--nodes", "1,2",
                  "--routing", "sticky", "--paths", "replicated,shared,dp_attention", "--dp-dispatch", "dp_aware",
                  "--jobs", "1", "--no-progress", "--no-ttft")  # fmt: skip
    assert run_.returncode == 0, run_.stderr[-3000:]
    assert run_.stdout.startswith("machine: ") and "TTFT p50 s" in run_.stdout, run_.stdout
    assert "TTFT not projected" in run_.stdout  # --no-ttft: capacity, hits and bytes only
    raw = json.loads((tmp_path / "bench_trace_replay.json").read_text())
    arms = [(r["path"], r["hicache"], r["nodes"], r["routing"]) for r in raw["rows"]]
    assert arms == [(p, h, k, rt) for p, k1 in (("replicated", "-"), ("shared", "-"), ("dp_attention", "sticky"))
                    for k, rt in ((1, k1), (2, "sticky")) for h in (False, True)]  # fmt: skip
    for r in raw["rows"]:
        assert r["input_tokens"] == sum(700 + 300 * (i % 3) for i in range(12)) and r["rejected"] == 0, r
        assert 0 < r["prefix_hit_fraction"] < 1 and r["ttft_p50_s"] is None
        for key in ("cp", "kv_dtype", "path", "scratch_contexts", "capacity_tokens", "kv_bytes_per_forward"):
            assert key in r, key
    assert raw["provenance"]["command"].startswith("python benchmark/bench_trace_replay.py --trace")
    assert (tmp_path / "bench_trace_replay.png").stat().st_size > 0


def test_every_arm_with_layer_terms_gives_ttft_ranges(tmp_path, monkeypatch):
    # in process, the stand-in terms where layer_terms would load the H200's
    import types

    fake = types.ModuleType("layer_terms")
    fake.load = lambda path=None: FakeTerms()
    monkeypatch.setitem(sys.modules, "layer_terms", fake)
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    code = B.main(["--trace", str(trace), "--out", str(tmp_path), "--widths", "8", "--nodes", "1",
                   "--routing", "cache_aware", "--hicache", "off", "--jobs", "1", "--no-progress"])  # fmt: skip
    assert code == 0
    raw = json.loads((tmp_path / "bench_trace_replay.json").read_text())
    got = {(r["path"], r["dp_dispatch"]) for r in raw["rows"]}
    assert got == {("replicated", "-"), ("shared", "-"), ("layer_split", "-"), ("tp", "-"),
                   ("dp_attention", "dp_aware"), ("dp_attention", "bootstrap_room")}  # fmt: skip
    for r in raw["rows"]:
        assert 0 < r["ttft_p50_s_low"] <= r["ttft_p50_s"] <= r["ttft_p50_s_high"], r
    by = {(r["path"], r["dp_dispatch"]): r for r in raw["rows"]}
    assert by[("layer_split", "-")]["kv_bytes_per_forward"] > 20 * by[("shared", "-")]["kv_bytes_per_forward"]
    assert by[("layer_split", "-")]["ttft_p50_s"] > by[("shared", "-")]["ttft_p50_s"]


def test_dp_dispatch_follows_the_router_or_the_bootstrap_room():
    reqs = [req(i, 2048, [0, 100 + i % 3, 7, 8]) for i in range(60)]  # 3 conversations
    aware = TR.route_dp(reqs, 2, 4, "cache_aware", "dp_aware", tokens_per_s=1e9)
    assert aware == TR.route(reqs, 8, "cache_aware", tokens_per_s=1e9)
    assert all(aware[i] == aware[i % 3] for i in range(60))  # a conversation stays on its DP rank
    room = TR.route_dp(reqs, 2, 4, "cache_aware", "bootstrap_room", tokens_per_s=1e9)
    nodes = TR.route(reqs, 2, "cache_aware", tokens_per_s=4e9)
    assert [w // 4 for w in room] == nodes  # the router picks the node ...
    assert len({w for i, w in enumerate(room) if i % 3 == 0}) > 1  # ... the room scatters a conversation's turns
    with pytest.raises(ValueError, match="dispatch"):
        TR.route_dp(reqs, 1, 4, "sticky", "hash")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--widths", "3"], "--widths"),
        (["--paths", "pp"], "--paths"),
        (["--dp-dispatch", "random"], "--dp-dispatch"),
        (["--layer-terms", "/nonexistent.json"], "--layer-terms"),
        (["--routing", "random"], "--routing"),
        (["--hicache", "yes"], "--hicache"),
        (["--kv-dtypes", "fp16"], "--kv-dtypes"),
        (["--speed", "0"], "--speed"),
        (["--scratch-contexts", "0"], "--scratch-contexts"),
        (["--trace", "/nonexistent.jsonl"], "--trace"),
        (["--limit", "0"], "--limit"),
        (["--model", "llama"], "--model"),
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
