"""CPU, ~4-5 min (real servers, 10 SGLang processes on 2 cores): three long prompts at once through
SGLang's PD with `--enable-nsa-prefill-cp-shared-kv`, the KV moved by SGLang's MooncakeKVManager
over Mooncake's TCP transport with Mooncake's default queue limits (nothing MC_TCP_* is set).

Servers (test/helpers/sglang_servers.py; the roles of test_sglang_server_pd.py with a longer
context, `ROLES` below):
- long_shared: PD prefill, CP=2 interleave, the flag;
- long_decode: PD decode, one request decoding at a time, up to 8 more rooms receiving KV;
- long_single: the oracle (no PD, no CP, one request at a time).
The prompts go to prefill and decode the router's way (`generate_pd`: the client sends the
bootstrap fields to both), all at once, the oracle's requests beside them. Asserted: every request
commits with the oracle's greedy tokens; the decode held all three rooms at once; afterwards both
PD servers are idle with every page back (SGLang's load report and its own idle leak check); no
server logged a transfer failure (SGLang's or Mooncake's). No retry anywhere.

Prompt sizes: the issue asks for thousands of pages per prompt (64k+ tokens). Out of reach on a
2-core CPU: the tiny model's prefill costs ~11 ms a token (4096 tokens in 47-53 s; 82 % of it in
SGLang's Triton kernels run by Triton's interpreter: act_quant, the index-K store, the page-table
transform), and the DSA indexer's logits grow with the square of the context, so one 64k prompt
would take well over 12 minutes per server, twice (PD prefill and oracle). The test sends what fits
the CI budget: three distinct prompts of 60-63 pages (3800-4000 tokens), 184 pages in flight at
once, chunked by 512 tokens, so each room is 8 Mooncake KV batches per CP rank plus its index-K
and aux batches. What the size does not reach, and what was measured beyond it (SGLang sends one
batch at a time per decode, of at most 10 entries here; Mooncake's TCP limit and what one
oversized batch does): docs/sglang_cpu_server_pd_concurrent.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures as futures  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_servers as S  # noqa: E402

register_cpu_ci(est_time=270, suite="nsa-cp-test-cpu")

PROMPT_TOKENS = (4000, 3900, 3800)  # 63, 61, 60 pages: distinct prompts, none page-aligned
NEW_TOKENS = 4
CONTEXT = 8192  # the tiny model's 1024 raised for these servers (both PD and oracle, same override)
CHUNK = 512  # --chunked-prefill-size: 8 pages, 8 chunks per prompt
# --max-total-tokens. The shared prefill's is per rank (it serves 2 x that, logical): 16384 logical
# tokens hold the three prompts at once. The decode pre-allocates a room only while one more
# context-length request would still fit beside the rooms it holds (SGLang's admission): with 16384
# tokens it took in two rooms and kept the third in bootstrap until the first committed; 32768 holds
# all three. The oracle runs one request at a time.
PREFILL_RANK_TOKENS = 8192
DECODE_TOKENS = 32768
SINGLE_TOKENS = 8192
REQUEST_TIMEOUT_S = 420

# The checkpoint's context (1024) raised by SGLang's own --json-model-override-args, with the yarn
# rope's original length along (factor 1.0: the same rotary frequencies, a longer cos/sin table).
LONG_CONTEXT = [
    "--context-length", str(CONTEXT), "--chunked-prefill-size", str(CHUNK), "--json-model-override-args",
    json.dumps({"max_position_embeddings": CONTEXT,
                "rope_scaling": dict(S.MODEL["rope_scaling"], original_max_position_embeddings=CONTEXT)}),
]  # fmt: skip
# name -> (launch arguments, needs a bootstrap port); later arguments win over server_command's
ROLES = {
    "long_shared": (S.ROLES["shared"][0] + LONG_CONTEXT + ["--max-total-tokens", str(PREFILL_RANK_TOKENS)], True),
    "long_decode": (S.ROLES["decode"][0] + LONG_CONTEXT + ["--max-total-tokens", str(DECODE_TOKENS)], False),
    "long_single": (S.ROLES["single"][0] + LONG_CONTEXT + ["--max-total-tokens", str(SINGLE_TOKENS)], False),
}
# The decode counts SGLANG_DISAGGREGATION_WAITING_TIMEOUT from the moment it pre-allocated a room
# until the prefill's last chunk lands. It pre-allocates all three rooms at once, and on these 2
# cores the prefill works through them one after the other (each ~1 min beside the oracle): the
# last room waits several minutes, past the 120 s of S.SERVER_ENV.
ENV = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600"}

# What a failed or stuck transfer leaves in a log after start-up: SGLang's prefill transfer worker
# and decode receiver (KVTransferError, "Failed to send kv chunk / aux data ...", "Session ...
# failed"), its timeouts and deferred releases, and Mooncake's own complaints (any glog error line
# "E<mmdd> ...", its TCP lanes' queue-full rejections).
TRANSFER_FAILURE = re.compile(
    r"KVTransferError|Failed to send|Session \S+ failed|transfer failed|timed out|Transfer thread failed|"
    r"^E\d{4} |queue-full|rejection count|lane failure",
    re.IGNORECASE,
)
LEAK = re.compile(r"memory leak detected|double free|use-after-free")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        for name, role in ROLES.items():
            patch.setitem(S.ROLES, name, role)
        for key, value in ENV.items():
            patch.setitem(S.SERVER_ENV, key, value)
        workdir = tmp_path_factory.mktemp("sglang_pd_concurrent")
        with S.Cluster(workdir, roles=tuple(ROLES), router=False).running(timeout_s=300) as cluster:
            yield cluster


def _lines(server, pattern, since=0):
    return [line for line in server.log_text(since).splitlines() if pattern.search(line)]


def _load(server):
    (load,) = requests.get(server.url + "/v1/loads", timeout=10).json()["loads"]
    return load


def _wait_idle(server, mark, timeout_s=120):
    """No running, waiting or PD-queued request and no KV token in use beyond the radix cache
    (SGLang's /v1/loads), then SGLang's own idle check (its exact accounting identity over the
    allocator's free pages, the radix cache and the request pool) reports no leak since `mark`.
    Under KV sharding the load report counts used tokens against the owner-rotating allocator's
    min-class floor, so up to a few pages of owner imbalance may show there; the idle check decides
    (as in test_sglang_server_pd.py). Returns the last load report."""
    deadline = time.monotonic() + timeout_s
    slack = S.CP * 4 * S.PAGE if S.scratch_logs(server, 0) else 0
    while True:
        load = _load(server)
        disagg = load.get("disaggregation") or {}
        busy = load["num_running_reqs"] + load["num_waiting_reqs"]
        busy += sum(v for k, v in disagg.items() if k.endswith("_queue_reqs"))
        if busy == 0 and load["num_used_tokens"] <= slack:
            time.sleep(3)  # a few idle loops: SGLang checks its pools there
            leaks = _lines(server, LEAK, mark)
            assert not leaks, f"{server.name}: SGLang's idle check found a leak: {leaks}"
            return load
        assert time.monotonic() < deadline, f"{server.name} not idle after {timeout_s} s: {load}"
        time.sleep(1)


def test_concurrent_long_prompts_all_commit_with_the_oracles_tokens(cluster):
    shared, decode, single = (cluster.servers[n] for n in ("long_shared", "long_decode", "long_single"))
    print(f"servers ready in {cluster.startup_s:.0f} s")
    assert S.logical_capacity(shared) == S.CP * PREFILL_RANK_TOKENS
    assert S.scratch_logs(shared, 0) and S.scratch_logs(shared, 1), "the shared prefill built no sharded pool"
    marks = {s.name: len(s.log_text()) for s in (shared, decode, single)}
    prompts = [S.prompt_ids(n, seed=1000 + n) for n in PROMPT_TOKENS]

    # the PD servers' queues while the requests run (SGLang's /v1/loads): how many rooms the decode
    # held at once (pre-allocated, receiving KV or decoding), how many the prefill had in flight
    peaks = {"decode_rooms": 0, "prefill_inflight": 0}
    stop = threading.Event()

    def sample():
        while not stop.wait(1.0):
            try:
                d, p = _load(decode), _load(shared)
            except (requests.RequestException, ValueError, KeyError):
                continue
            dq = d.get("disaggregation") or {}
            rooms = dq.get("decode_prealloc_queue_reqs", 0) + dq.get("decode_transfer_queue_reqs", 0)
            peaks["decode_rooms"] = max(peaks["decode_rooms"], rooms + d["num_running_reqs"])
            peaks["prefill_inflight"] = max(
                peaks["prefill_inflight"], (p.get("disaggregation") or {}).get("prefill_inflight_queue_reqs", 0)
            )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    with futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
        pd = [pool.submit(S.generate_pd, shared, decode, ids, NEW_TOKENS, REQUEST_TIMEOUT_S) for ids in prompts]
        oracle = [pool.submit(S.generate, single.url, ids, NEW_TOKENS, REQUEST_TIMEOUT_S) for ids in prompts]
        done = {}
        for i, f in enumerate(pd):
            done[i] = f.result()
            print(f"PD request of {PROMPT_TOKENS[i]} tokens done after {time.monotonic() - t0:.0f} s")
        wants = [f.result()["output_ids"] for f in oracle]
    stop.set()
    sampler.join()
    print(f"all requests done after {time.monotonic() - t0:.0f} s; peaks: {peaks}")

    problems = []
    for i, n in enumerate(PROMPT_TOKENS):
        pre, dec = done[i]
        if not isinstance(pre, dict) or not isinstance(dec, dict):
            problems.append(f"prompt of {n} tokens: prefill {pre!r}, decode {dec!r}")
            continue
        got = dec["output_ids"]
        print(f"prompt of {n} tokens ({-(-n // S.PAGE)} pages): PD {got}, oracle {wants[i]}")
        if got != wants[i]:
            problems.append(f"prompt of {n} tokens: PD {got} != oracle {wants[i]}")
    assert not problems, "\n".join(problems) + "\n" + cluster.log_tails()

    # the rooms were in flight together: the decode held all of them at once
    assert peaks["decode_rooms"] >= len(prompts), f"the decode never held {len(prompts)} rooms at once: {peaks}"

    # every page back, on both PD servers; SGLang's idle check agrees
    for server in (shared, decode):
        load = _wait_idle(server, marks[server.name])
        print(f"{server.name} idle: {load['num_used_tokens']} of {load['max_total_num_tokens']} tokens in use")
    failures = {s.name: _lines(s, TRANSFER_FAILURE, marks[s.name]) for s in (shared, decode)}
    assert not any(failures.values()), f"transfer failures logged: {failures}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
