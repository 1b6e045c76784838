"""The trace replay's cache against SGLang's real servers on CPU, request by request.

    python benchmark/validate_trace_replay.py                   # 30 requests; ~30 min on 2 busy cores
    python benchmark/validate_trace_replay.py --contrast --requests 24   # what the CI test runs:
        # the requests among the first 24 where the two pools cache differently

A scaled replay: the trace's requests, one 64-token page per 512-token block (each block's tokens
drawn from its hash id, a partial block's share of the page kept), through SGLang 0.5.23's own PD
prefill servers on CPU (test/helpers/sglang_servers.py: CP=2 with the flag, and the same without
it, each rank's pool 2,048 tokens so that the replay evicts; a decode behind both), one request at
a time, both prefills at once. For each request it
compares SGLang's `meta_info.cached_tokens` with what the replay's cache pass
(`trace_cache.PagePrefixCache`, SGLang's tree at the server's logical capacity from `/v1/loads`)
says. The tiny model's context is 1,024 tokens, so only requests of at most 15 blocks are taken,
and only from conversations with three or more of them (so that turns reuse earlier ones).
`--contrast` instead takes, from the first --requests, a request whose reused prefix the replay says
the replicated pool evicts and the shared one keeps, with the request it reuses and the requests
that evict it (the fewest tokens that do).
Writes DIR/validate_trace_replay.json: per request and server, both counts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
sys.path.insert(0, str(ROOT / "test"))

import trace_cache as TC  # noqa: E402

PREFILLS = ("val_shared", "val_replicated")
MAX_BLOCKS = 15  # 15 pages + a partial one stay under the tiny model's 1,024-token context
RANK_TOKENS = 2048  # --max-total-tokens per rank: small enough that the trace's turns evict


def scaled_requests(trace: str, n: int) -> list[tuple[list[int], list[int]]]:
    """(page keys, token ids) of the first `n` qualifying requests, in arrival order."""
    from helpers import sglang_servers as S

    reqs = [r for r in TC.load_trace(trace) if len(r.blocks) <= MAX_BLOCKS]
    turns: dict[int, int] = {}
    for r in reqs:
        turns[r.conversation] = turns.get(r.conversation, 0) + 1
    chosen = [r for r in reqs if turns[r.conversation] >= 3][:n]
    out = []
    vocab = S.MODEL["vocab_size"]
    for r in chosen:
        ids = []
        for j, h in enumerate(r.blocks):
            draw = random.Random(h)
            page = [draw.randrange(2, vocab) for _ in range(TC.PAGE)]
            tail = r.input_len - j * TC.BLOCK
            ids += page if tail >= TC.BLOCK else page[: max(1, tail * TC.PAGE // TC.BLOCK)]
        out.append((list(r.blocks), ids))
    return out


def simulated_cached_tokens(requests, capacity_tokens: int) -> list[int | None]:
    """The replay's cache pass over the scaled requests: one key per page (the block's hash id)."""
    from array import array

    cache = TC.PagePrefixCache(capacity_tokens // TC.PAGE)
    out = []
    for blocks, ids in requests:
        full = len(ids) // TC.PAGE
        hit = cache.serve(array("q", blocks[:full]), len(ids))
        out.append(None if hit is None else hit * TC.PAGE)
    return out


def contrast_requests(requests, small_tokens: int, large_tokens: int) -> list:
    """The fewest tokens of `requests`, in their order, on whose last one a pool of `small_tokens`
    and one of `large_tokens` cache differently: for each request where the two differ, the
    requests before it are dropped one at a time, the smallest first, while the difference stays;
    the set with the fewest tokens wins."""

    def differs(subset):
        return simulated_cached_tokens(subset, small_tokens)[-1] != simulated_cached_tokens(subset, large_tokens)[-1]

    small, large = simulated_cached_tokens(requests, small_tokens), simulated_cached_tokens(requests, large_tokens)
    sets = []
    for last in (i for i in range(len(requests)) if small[i] != large[i]):
        keep = list(range(last + 1))
        for k in sorted(range(last), key=lambda k: len(requests[k][1])):
            if differs([requests[i] for i in keep if i != k]):
                keep.remove(k)
        sets.append([requests[i] for i in keep])
    if not sets:
        raise ValueError(
            f"no request of {len(requests)} caches differently at {small_tokens} and {large_tokens} tokens"
        )
    return min(sets, key=lambda subset: sum(len(ids) for _, ids in subset))


def run(n: int, workdir: Path, progress=print, contrast: bool = False) -> dict:
    """Serve `n` scaled requests (with `contrast`: the contrast set drawn from the first `n`)."""
    from helpers import sglang_servers as S

    requests = scaled_requests(str(ROOT / "benchmark" / "data" / "mooncake_conversation_trace.jsonl.gz"), n)
    if contrast:  # the pools' nominal sizes; the result's sims use the capacities the servers report
        requests = contrast_requests(requests, RANK_TOKENS, S.CP * RANK_TOKENS)
    for name in PREFILLS:  # the helper's prefills with a smaller pool (a later argument wins)
        args, bootstrap = S.ROLES[name.removeprefix("val_")]
        S.ROLES[name] = (args + ["--max-total-tokens", str(RANK_TOKENS)], bootstrap)
    # a loaded 2-core machine takes minutes per request: PD failure detection relaxed to match (these
    # servers only: the variables are the cluster's, not SERVER_ENV's, which later clusters start from)
    relaxed = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1800", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "30"}
    cluster = S.Cluster(workdir, roles=(*PREFILLS, "decode"), router=False, env=relaxed)
    real = {name: [] for name in PREFILLS}
    with cluster.running(timeout_s=900):
        progress(f"servers up in {cluster.startup_s:.0f} s")
        capacity = {name: S.logical_capacity(cluster.servers[name]) for name in PREFILLS}
        decode = cluster.servers["decode"]
        t0 = time.monotonic()
        for i, (_, ids) in enumerate(requests):
            with concurrent.futures.ThreadPoolExecutor(len(PREFILLS)) as pool:
                pending = {name: pool.submit(S.generate_pd, cluster.servers[name], decode, ids, 1, 600)
                           for name in PREFILLS}  # fmt: skip
                for name, f in pending.items():
                    pre, dec = f.result()
                    if not isinstance(pre, dict) or not isinstance(dec, dict):
                        raise RuntimeError(f"{name} request {i}: {pre!r} {dec!r}\n{cluster.log_tails()}")
                    real[name].append(pre["meta_info"]["cached_tokens"])
            progress(f"request {i + 1}/{len(requests)} ({len(ids)} tokens): "
                     + ", ".join(f"{name} {real[name][-1]}" for name in PREFILLS)
                     + f"; {time.monotonic() - t0:.0f} s")  # fmt: skip
    result = {
        "requests": len(requests),
        "contrast": contrast,
        "capacity_tokens": capacity,
        "per_request": [],
        "summary": {},
    }
    sims = {name: simulated_cached_tokens(requests, capacity[name]) for name in PREFILLS}
    for i, (blocks, ids) in enumerate(requests):
        result["per_request"].append({"tokens": len(ids), "blocks": blocks,
                                      **{f"{name}_sglang": real[name][i] for name in PREFILLS},
                                      **{f"{name}_sim": sims[name][i] for name in PREFILLS}})  # fmt: skip
    for name in PREFILLS:
        diff = [i for i in range(len(requests)) if real[name][i] != sims[name][i]]
        result["summary"][name] = {"equal": len(requests) - len(diff), "differ": diff,
                                   "sglang_cached_tokens": sum(real[name]), "sim_cached_tokens": sum(sims[name])}  # fmt: skip
    result["input_tokens"] = sum(len(ids) for _, ids in requests)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30, help="how many scaled requests (at least 1)")
    p.add_argument(
        "--contrast", action="store_true", help="the fewest of the first --requests where the pools cache differently"
    )
    p.add_argument("--out", default=str(ROOT / "benchmark" / "results"), help="directory for the JSON")
    args = p.parse_args(argv)
    if args.requests < 1:
        print(f"validate_trace_replay.py: error: --requests {args.requests}: must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trace_validate_") as tmp:
        result = run(args.requests, Path(tmp), lambda s: print(s, file=sys.stderr, flush=True), args.contrast)
    for name, s in result["summary"].items():
        print(f"{name}: capacity {result['capacity_tokens'][name]} tokens; {s['equal']}/{result['requests']} requests "
              f"equal; cached tokens SGLang {s['sglang_cached_tokens']} vs replay {s['sim_cached_tokens']} "
              f"of {result['input_tokens']}; differ at {s['differ']}")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "validate_trace_replay.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
