"""CPU, ~1.5-2.5 min (real servers, 10 SGLang processes on 2 cores): three prompts of 15-16 pages at
once through SGLang's PD with `--enable-nsa-prefill-cp-shared-kv`, the KV moved by SGLang's
MooncakeKVManager over Mooncake's TCP transport with Mooncake's default queue limits (nothing
MC_TCP_* is set).

Servers (test/helpers/sglang_servers.py, its roles and limits: the tiny model's 1024-token
context, chunks of 128 tokens):
- shared: PD prefill, CP=2 interleave, the flag;
- decode: PD decode, one request decoding at a time, up to 8 more rooms receiving KV;
- single: the oracle (no PD, no CP, one request at a time).
The prompts go to prefill and decode the router's way (`generate_pd`: the client sends the
bootstrap fields to both), all at once, the oracle's requests beside them. Asserted: every request
commits with the oracle's greedy tokens; the rooms overlapped (the decode held all three at once,
read from SGLang's /v1/loads every 0.2 s); afterwards both PD servers are idle with every page back
(SGLang's load report and its own idle leak check); no server logged a transfer failure (SGLang's
or Mooncake's). No retry anywhere; a request that times out names the server, the prompt and its
room.

Prompt sizes: each room is 8 chunks, so 8 Mooncake KV batches per CP rank plus its index-K and aux
batches, 46 pages in flight at once. The tiny model's prefill costs ~11 ms a token on this CPU
(SGLang's Triton kernels run by Triton's interpreter), twice (PD and oracle), so longer prompts buy
minutes, not coverage: thousands of pages per room go through the same SGLang Mooncake classes
without the model in test/sglang_ext/disaggregation/test_pd_many_pages.py, and what the size does
not reach is measured in docs/sglang_cpu_server_pd_concurrent.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures as futures  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_servers as S  # noqa: E402

register_cpu_ci(est_time=150, suite="nsa-cp-test-cpu")

ROLES = ("shared", "decode", "single")
PROMPT_TOKENS = (760, 700, 640)  # 12, 11, 10 pages, 3 chunks each: distinct prompts, the first two not page-aligned
# --chunked-prefill-size on all three servers (a later argument wins over server_command's 128): a
# chunk's fixed cost under Triton's interpreter dominates at 128 tokens
CHUNK = ["--chunked-prefill-size", "256"]
NEW_TOKENS = 4
# The requests cost the servers ~100 CPU-seconds, so ~50 s on an idle 2-core machine (the test prints
# both; docs/sglang_cpu_server_pd_concurrent.md); a request still unanswered after this names what it
# waited for.
REQUEST_TIMEOUT_S = 300

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


# The decode counts SGLANG_DISAGGREGATION_WAITING_TIMEOUT from the moment it pre-allocated a room
# until the prefill's last chunk lands. It pre-allocates all three rooms at once and the prefill
# works through them one after the other: on a loaded machine the last room waits past the suite's
# 120 s (a run at load average 20 failed two rooms so).
ENV = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        for key, value in ENV.items():
            patch.setitem(S.SERVER_ENV, key, value)
        for name in ROLES:
            args, needs_bootstrap = S.ROLES[name]
            patch.setitem(S.ROLES, name, (args + CHUNK, needs_bootstrap))
        workdir = tmp_path_factory.mktemp("sglang_pd_concurrent")
        with S.Cluster(workdir, roles=ROLES, router=False).running(timeout_s=300) as cluster:
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


def _cpu_seconds(servers) -> dict:
    """CPU time (user + system) each server's processes have used so far, by server name."""
    used = {}
    for server in servers:
        used[server.name] = 0.0
        for pid in server.pids():
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            used[server.name] += times.user + times.system
    return used


def _answer(server, ids, boot=None):
    """POST /generate to `server` (with the PD bootstrap fields `boot`); the JSON answer, or a
    string naming what was waited for and why it did not come."""
    t0 = time.monotonic()
    try:
        return S.generate(server.url, ids, NEW_TOKENS, REQUEST_TIMEOUT_S, **(boot or {}))
    except requests.RequestException as e:
        room = f" (room {boot['bootstrap_room']})" if boot else ""
        what = f"{server.name}'s answer to the prompt of {len(ids)} tokens{room}"
        return f"waited {time.monotonic() - t0:.0f} s for {what}: {type(e).__name__}: {e}"


def test_concurrent_prompts_all_commit_with_the_oracles_tokens(cluster):
    shared, decode, single = (cluster.servers[n] for n in ROLES)
    print(f"servers ready in {cluster.startup_s:.0f} s")
    assert S.scratch_logs(shared, 0) and S.scratch_logs(shared, 1), "the shared prefill built no sharded pool"
    marks = {s.name: len(s.log_text()) for s in (shared, decode, single)}
    prompts = [S.prompt_ids(n, seed=1000 + n) for n in PROMPT_TOKENS]
    rooms = [random.getrandbits(62) for _ in prompts]
    boots = [
        {"bootstrap_host": "127.0.0.1", "bootstrap_port": shared.bootstrap_port, "bootstrap_room": r} for r in rooms
    ]

    # how many rooms the decode held at once (pre-allocated, receiving KV or decoding)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.2):
            try:
                load = _load(decode)
            except (requests.RequestException, ValueError, KeyError):
                continue
            queues = load.get("disaggregation") or {}
            held = queues.get("decode_prealloc_queue_reqs", 0) + queues.get("decode_transfer_queue_reqs", 0)
            peak[0] = max(peak[0], held + load["num_running_reqs"])

    sampler = threading.Thread(target=sample, daemon=True)
    servers = (shared, decode, single)
    idle0 = sum(_cpu_seconds(servers).values())
    time.sleep(5)
    idle = (sum(_cpu_seconds(servers).values()) - idle0) / 5  # what the idle servers burn a second (polling)
    sampler.start()
    cpu0, t0 = _cpu_seconds(servers), time.monotonic()
    with futures.ThreadPoolExecutor(3 * len(prompts)) as pool:
        pre = [pool.submit(_answer, shared, ids, boot) for ids, boot in zip(prompts, boots)]
        dec = [pool.submit(_answer, decode, ids, boot) for ids, boot in zip(prompts, boots)]
        oracle = [pool.submit(_answer, single, ids) for ids in prompts]
        results = [(p.result(), d.result(), o.result()) for p, d, o in zip(pre, dec, oracle)]
    stop.set()
    sampler.join()
    wall, cpu = time.monotonic() - t0, {k: v - cpu0[k] for k, v in _cpu_seconds(servers).items()}
    print(f"all requests done after {wall:.0f} s: CPU-s by server {({k: round(v) for k, v in cpu.items()})}, "
          f"{sum(cpu.values()):.0f} in all, of which ~{idle * wall:.0f} their idle polling ({idle:.2f} CPU-s a second "
          f"when idle); load average {os.getloadavg()[0]:.1f}; the decode held up to {peak[0]} rooms at once")  # fmt: skip

    problems = []
    for n, room, (p, d, o) in zip(PROMPT_TOKENS, rooms, results):
        if not all(isinstance(a, dict) for a in (p, d, o)):
            problems += [a for a in (p, d, o) if isinstance(a, str)]
            continue
        print(f"prompt of {n} tokens ({-(-n // S.PAGE)} pages, room {room}): PD {d['output_ids']}, oracle {o['output_ids']}")  # fmt: skip
        if d["output_ids"] != o["output_ids"]:
            problems.append(f"prompt of {n} tokens (room {room}): PD {d['output_ids']} != oracle {o['output_ids']}")
    assert not problems, "\n".join(problems) + "\n" + cluster.log_tails()

    assert peak[0] >= len(prompts), f"the decode never held {len(prompts)} rooms at once (at most {peak[0]})"

    # every page back, on both PD servers; SGLang's idle check agrees
    for server in (shared, decode):
        load = _wait_idle(server, marks[server.name])
        print(f"{server.name} idle: {load['num_used_tokens']} of {load['max_total_num_tokens']} tokens in use")
    failures = {s.name: _lines(s, TRANSFER_FAILURE, marks[s.name]) for s in (shared, decode)}
    assert not any(failures.values()), f"transfer failures logged: {failures}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
