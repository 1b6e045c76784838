"""The trace replay's fast TTFT path (benchmark/trace_cost.py) gives the numbers of the
per-request implementation it replaced: `StepCost.step_ms` (each worker's requests summed into the
fits' features, the collectives memoized) equals `StepCost.breakdown()` on random batches of every
arm and case, on the H200's layer terms and on the stand-in ones; and `simulate_node` (waiting
requests as an index range) gives the TTFTs and busy time of the old queue, kept here as the
reference and driven by breakdown(), on the Mooncake trace's first requests."""

import os
import random
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
sys.path.insert(0, os.path.join(ROOT, "test", "benchmark"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import layer_terms  # noqa: E402
import trace_budget as TB  # noqa: E402
import trace_cache as TC  # noqa: E402
import trace_cost as TK  # noqa: E402
import trace_routing as TR  # noqa: E402
from fake_layer_terms import FakeTerms  # noqa: E402

GLM5 = TB.load_model("glm5")
KV_BYTES = 61464  # fp8, GLM-5: bench_trace_replay.measure_kv_bytes_per_token
ARMS = [(p, w) for w in (2, 4, 8) for p in TB.PATHS if p != "tp"] + [("tp", 8)]
POOL_ROWS = 444032  # a CP-8 rank's pool (layer split's broadcast size)


def h200_terms():
    return layer_terms.load()  # benchmark/results/bench_glm5_layer_1xh200.json, committed


def cost(terms, path, width, case):
    layout = TB.Layout(path, width)
    return TK.StepCost(terms, GLM5, path, width, layout.attn_tp, "fp8", case, KV_BYTES, POOL_ROWS), layout


def old_simulate_node(workers, chunk, cost):
    """The queue as it was before the fast path (commit 17693a4), verbatim but for its name."""
    page = 64
    queues = [list(w) for w in workers]
    nxt = [0] * len(workers)
    waiting = [[] for _ in workers]
    heads = [0] * len(workers)
    running = [None] * len(workers)
    ttft, now, busy = [], 0.0, 0.0
    left = sum(len(q) for q in queues)
    while left:
        for w, q in enumerate(queues):
            while nxt[w] < len(q) and q[nxt[w]][0] <= now:
                waiting[w].append(nxt[w])
                nxt[w] += 1
        batches, finished, loaded = [], [], 0
        for w, q in enumerate(queues):
            budget, batch = chunk, []
            if running[w] is not None:
                i, done = running[w]
                take = min(q[i][1] - done, budget // page * page)
                batch.append((take, done))
                budget -= take
                running[w] = [i, done + take] if done + take < q[i][1] else None
                if running[w] is None:
                    finished.append((w, i))
            while heads[w] < len(waiting[w]) and budget >= page and running[w] is None:
                i = waiting[w][heads[w]]
                arrival, length, hit, load = q[i]
                extend = length - hit
                take = extend if extend <= budget else budget // page * page
                heads[w] += 1
                batch.append((take, hit))
                loaded += load
                budget -= take
                if take < extend:
                    running[w] = [i, hit + take]
                else:
                    finished.append((w, i))
            batches.append(batch)
        if not any(batches):
            now = min(q[nxt[w]][0] for w, q in enumerate(queues) if nxt[w] < len(q))
            continue
        dt = cost.step_ms(batches, loaded) / 1e3
        now += dt
        busy += dt
        for w, i in finished:
            ttft.append(now - queues[w][i][0])
            left -= 1
    return ttft, busy


class Breakdown:
    """The per-request step cost: breakdown()'s step_ms."""

    def __init__(self, cost):
        self.cost = cost

    def step_ms(self, batches, loaded):
        return self.cost.breakdown(batches, loaded)["step_ms"]


def random_batches(rng, pools, chunk):
    batches = []
    for _ in range(pools):
        batch, budget = [], chunk
        while budget >= 64 and rng.random() < 0.7:
            n = min(budget, rng.choice([1, 63, 64, 700, 1024, 4096, 8192]))
            batch.append((n, rng.choice([0, 5, 64, 1000, 65536, 131072 + 17, 900000])))
            budget -= n
        batches.append(batch)
    return batches


@pytest.mark.parametrize("terms_of", [h200_terms, lambda: FakeTerms(err=0.1)], ids=["h200", "stand_in"])
def test_fast_step_ms_equals_breakdown_for_every_arm_and_case(terms_of):
    terms, rng, checked = terms_of(), random.Random(45), 0
    for path, width in ARMS:
        for case in TK.CASES:
            fast, layout = cost(terms, path, width, case)
            chunk = TB.per_rank_chunk(8192, layout)
            for _ in range(60):
                batches, loaded = random_batches(rng, layout.pools, chunk), rng.choice([0, 0, 4096, 500000])
                want = fast.breakdown(batches, loaded)["step_ms"]
                assert fast.step_ms(batches, loaded) == pytest.approx(want, rel=1e-12, abs=1e-12), (path, width, case)
                checked += want > 0
    assert checked > len(ARMS) * len(TK.CASES) * 40  # most draws had work


@pytest.mark.parametrize("path, width", [("shared", 8), ("layer_split", 8), ("dp_attention", 8), ("tp", 8),
                                         ("replicated", 2)])  # fmt: skip
def test_replay_gives_the_old_ttfts_on_the_trace(path, width):
    requests = TC.load_trace(os.path.join(ROOT, "benchmark", "data", "mooncake_conversation_trace.jsonl.gz"), 300)
    # 40 x the trace's rate: a queue builds up
    requests = [TC.TraceRequest(r.arrival_s / 40, r.input_len, r.page_keys, r.conversation, r.blocks)
                for r in requests]  # fmt: skip
    layout = TB.Layout(path, width)
    where = TR.route(requests, layout.pools, "cache_aware") if layout.pools > 1 else [0] * len(requests)
    workers = []
    for w in range(layout.pools):
        mine = [r for r, x in zip(requests, where) if x == w]
        hits = TC.fast_cache_pass(mine, 400000)
        workers.append([(r.arrival_s, r.input_len, h * 64, (h * 64) // 3) for r, h in zip(mine, hits)])
    terms = h200_terms()
    for case in TK.CASES:
        fast, _ = cost(terms, path, width, case)
        chunk = TB.per_rank_chunk(8192, layout)
        got, busy = TK.simulate_node(workers, chunk, fast)
        want, want_busy = old_simulate_node(workers, chunk, Breakdown(fast))
        assert len(got) == len(requests) and busy == pytest.approx(want_busy, rel=1e-9)
        assert sorted(got) == pytest.approx(sorted(want), rel=1e-9)
        assert max(want) > 3 * min(want)  # requests queued: the order of service matters


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
