"""CPU (real servers, ~15 processes on 2 cores): `python -m sglang.launch_server` with
`--enable-nsa-prefill-cp-shared-kv` on a PD prefill, over HTTP, checked against oracle servers,
three multi-chunk prompts at once through SGLang's Mooncake manager among them.

Servers (test/helpers/sglang_servers.py; all on a tiny DeepSeek-V3.2 checkpoint written here, CPU
stand-ins from a test-only plugin, docs/sglang_cpu_server.md):
- shared:     PD prefill, CP=2 interleave, the flag (the product's deployment);
- replicated: PD prefill, CP=2 interleave, no flag (today's replicated CP);
- decode:     PD decode, CP off, serving both prefills over Mooncake (TCP, 127.0.0.1);
- single:     one ordinary non-PD, non-CP server (the oracle);
  both decode one request at a time: SGLang's CPU decode is not batch-invariant (the docs);
- SGLang's router (sglang-router, PD mode) in front of shared + decode; the replicated prefill is
  reached the router's way by the client (bootstrap fields to prefill and decode at once).
Greedy tokens through the router must equal the single server's and the replicated PD's. The tests
run in order and share the servers with the layer-split and HiCache files (helpers/shared_servers.py:
one start for all); the last one kills a CP rank of the shared prefill, after every other test on them.

The servers are the demo's (`bash scripts/demo.sh`, test/helpers/demo.py: `demo.cluster_options`,
each prefill rank's pool PREFILL_RANK_TOKENS rows), and the demo's own requests and reports run on
them (`demo.exercise`) with test_demo.py's assertions: the demo's CI case, on the same servers.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures as futures  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import demo  # noqa: E402
from helpers import sglang_servers as S  # noqa: E402
from helpers.demo_checks import assert_demo_run  # noqa: E402
from helpers.listeners import is_wildcard, listening_sockets  # noqa: E402

register_cpu_ci(est_time=225, suite="nsa-cp-test-cpu")

NEW_TOKENS = 6


# What a failed or stuck transfer leaves in a log after start-up: SGLang's prefill transfer worker
# and decode receiver (KVTransferError, "Failed to send kv chunk / aux data ...", "Session ...
# failed"), its timeouts, and Mooncake's own complaints (any glog error line "E<mmdd> ...", its TCP
# lanes' queue-full rejections).
TRANSFER_FAILURE = (r"(?i)KVTransferError|Failed to send|Session \S+ failed|transfer failed|timed out|"
                    r"Transfer thread failed|^E\d{4} |queue-full|rejection count|lane failure")  # fmt: skip


DEMO_ARGS = demo.parse_args([])  # `bash scripts/demo.sh`'s defaults: CP=2, bf16, no HiCache
# the demo's servers (helpers/shared_servers.py starts them with the demo's options, once for every
# system test file that uses them) and SGLang's router in front of shared + decode
SHARED_SERVER_ROLES = ("shared", "replicated", "decode", "single", "router")


@pytest.fixture(scope="module")
def cluster(shared_servers):
    return shared_servers


def _three_paths(cluster, ids):
    """Output ids of the shared-KV PD (router), the replicated PD and the single server, at once."""
    paths = S.three_paths(cluster, ids, NEW_TOKENS)
    return paths["shared"], paths["replicated"], paths["oracle"]


def _assert_same(where, shared, replicated, single):
    assert len(single) > 0, where
    assert shared == single, f"{where}: shared-KV PD {shared} != single server {single}"
    assert replicated == single, f"{where}: replicated PD {replicated} != single server {single}"


def _log_lines_since(server, mark, pattern):
    return [line for line in server.log_text(mark).splitlines() if re.search(pattern, line)]


def _prefill_batches(server, mark):
    """(requests, new tokens) of every prefill batch the server logged since `mark`."""
    return [tuple(map(int, re.search(r"#new-seq: (\d+), #new-token: (\d+)", line).groups()))
            for line in _log_lines_since(server, mark, r"Prefill batch")]  # fmt: skip


def _log_mark(server):
    return len(server.log_text())


def _wait_idle(server, mark, timeout_s=60):
    """SGLang's live load (/v1/loads): no running, waiting or PD-queued request and no KV token in
    use beyond the radix cache, then no leak reported by SGLang's own idle check (its exact
    accounting identity) since `mark`. Under KV sharding SGLang reports used tokens against the
    owner-rotating allocator's min-class floor (N x page x the fewest free pages of any owner), so
    a prefix cache whose owners are not balanced shows a few pages in use when nothing is: there
    the used count may stay below N pages x the owners' imbalance, and the idle check decides.
    Returns the last snapshot."""
    deadline = time.monotonic() + timeout_s
    sharded = S.scratch_logs(server, 0)
    while True:
        load = S.load(server)
        disagg = load.get("disaggregation") or {}
        busy = load["num_running_reqs"] + load["num_waiting_reqs"]
        busy += sum(v for k, v in disagg.items() if k.endswith("_queue_reqs"))
        floor_slack = S.CP * 4 * S.PAGE if sharded else 0  # owners' free pages apart by up to 4
        if busy == 0 and load["num_used_tokens"] <= floor_slack:
            time.sleep(2)  # a few idle loops: SGLang checks its pools there
            leaks = _log_lines_since(server, mark, "memory leak detected")
            assert not leaks, f"{server.name}: SGLang's idle check found a leak: {leaks}"
            return load
        assert time.monotonic() < deadline, f"{server.name} not idle after {timeout_s} s: {load}"
        time.sleep(0.5)


def test_servers_start_with_the_plugin_and_report_n_times_the_capacity(cluster):
    """Both prefills get the same per-rank pool (--max-total-tokens is per rank); the shared one
    serves N x its tokens through SGLang's KV sharding, in the same KV bytes per rank, with the
    plugin's scratch: one context of cached prefix plus one chunk."""
    print(f"servers ready in {cluster.startup_s:.0f} s")
    shared, replicated = cluster.servers["shared"].info(), cluster.servers["replicated"].info()
    assert shared["max_total_num_tokens"] == replicated["max_total_num_tokens"] == demo.PREFILL_RANK_TOKENS
    for rank, (sh, rep) in enumerate(zip(shared["internal_states"], replicated["internal_states"])):
        assert sh["memory_usage"]["token_capacity"] == rep["memory_usage"]["token_capacity"], rank  # per rank
        # the same KV bytes per rank (GB, SGLang's rounding): the shard holds 1/N of N x the pages
        assert sh["memory_usage"]["kvcache"] == pytest.approx(rep["memory_usage"]["kvcache"], abs=0.0015), rank
    # what the scheduler admits against (SGLang's load report, in logical tokens)
    assert S.logical_capacity(cluster.servers["shared"]) == S.CP * S.logical_capacity(cluster.servers["replicated"])
    for rank in range(S.CP):
        pools = S.scratch_logs(cluster.servers["shared"], rank)
        assert pools and S.one_context_scratch() in pools[0], pools
    assert not S.scratch_logs(cluster.servers["replicated"], 0)


def test_the_demo_serves_every_path_with_the_oracles_tokens(cluster, capsys):
    """The demo's CI case (test_demo.py runs it by hand on servers of its own): `bash scripts/demo.sh`'s
    requests and SGLang's reports, on these servers while they are fresh, asserted as test_demo.py
    asserts them; that nothing outlives the stop, the fixture asserts."""
    run = demo.exercise(cluster, demo.DemoRun(startup_s=cluster.startup_s))
    with capsys.disabled():
        print(f"\ndemo (default) on this cluster, servers up in {run.startup_s:.0f} s")
        if run.error is None:
            demo.report(DEMO_ARGS, run)
    assert_demo_run(DEMO_ARGS, run)


SGLANG_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
PLUGIN_MANAGER = "sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn.OwnedPageKVManager"


def test_only_the_servers_that_ask_run_the_plugins_classes(cluster):
    """The plugin is installed in every server; only those started with the flag run its classes
    (as the test-only stand-in plugin reports what SGLang built): the shared prefill's CP ranks
    the plugin's Mooncake manager and pool subclass, the decode (the flag: its opt-in) the plugin's
    manager over SGLang's pool; the replicated prefill, asked nothing, SGLang's own classes. The PD
    secret is set on every server (the flag needs it), so nothing says it runs unprotected."""
    built = {name: S.classes_built(cluster.servers[name]) for name in ("shared", "replicated", "decode")}
    assert built["shared"] == {(PLUGIN_MANAGER, "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool."
                                                "PageInterleaveDSATokenToKVPool")}, built  # fmt: skip
    assert built["replicated"] == {(SGLANG_MANAGER, "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool")}, built
    assert built["decode"] == {(PLUGIN_MANAGER, "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool")}, built
    line = r"owned-page PD transfer runs unprotected"
    assert not any(_log_lines_since(cluster.servers[n], 0, line) for n in ("shared", "decode", "replicated"))


def test_every_listener_is_on_the_servers_interface_but_mooncakes(cluster):
    """Issue 32: the PD servers listen on 127.0.0.1 (their --host and SGLANG_HOST_IP; ZMQ, HTTP,
    bootstrap), read from /proc per process, with two exceptions on every interface: Mooncake's
    handshake and TCP data listeners (no setting binds them: test_listeners.py), inside
    MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, the range a deployment firewalls (docs/deploy.md); and
    torch.distributed's store (`--nccl-port`, torch's TCPStore binds every interface)."""
    low, high = int(S.SERVER_ENV["MC_MIN_RPC_PORT"]), int(S.SERVER_ENV["MC_MAX_RPC_PORT"])
    for name in ("shared", "decode"):
        server = cluster.servers[name]
        listeners = [(pid, a, p) for pid in server.pids() for a, p in listening_sockets(pid)]
        elsewhere = [(pid, a, p) for pid, a, p in listeners if not is_wildcard(a) and a != "127.0.0.1"]
        assert not elsewhere, f"{name}: listeners off the configured interface: {elsewhere}"
        open_to_all = [(pid, a, p) for pid, a, p in listeners if is_wildcard(a) and p != server.nccl_port]
        assert open_to_all and all(low <= p <= high for _, _, p in open_to_all), (
            f"{name}: listeners on every interface outside Mooncake's range {low}..{high}: {open_to_all}"
        )


def test_concurrent_requests_of_mixed_lengths_match_the_oracles(cluster):
    shared = cluster.servers["shared"]
    mark = _log_mark(shared)
    lengths = (150, 100, 64, 9, 1)  # the longest first: the others queue behind its first chunk
    with futures.ThreadPoolExecutor(len(lengths)) as pool:
        results = list(pool.map(lambda n: _three_paths(cluster, S.prompt_ids(n, seed=n)), lengths))
    for n, outputs in zip(lengths, results):
        _assert_same(f"prompt of {n} tokens", *outputs)
    batches = _prefill_batches(shared, mark)
    print("shared prefill batches (requests, tokens):", batches)
    # Several requests in one prefill batch (one dense plan over requests of different lengths).
    # Whether the scheduler batches the requests above depends on when each finishes its bootstrap
    # with the decode; on a loaded machine they may all have run alone. So hold the shared prefill
    # (SGLang's /pause_generation: new requests wait in its tokenizer manager, the decode side
    # pre-allocates meanwhile), send short prompts, then let it go: they reach its scheduler together.
    # Under heavy load their bootstraps can still finish apart (seen once in CI): hold longer, up
    # to three times.
    for hold_s in (3, 8, 15):
        if any(reqs >= 2 for reqs, _ in batches):
            break
        mark = _log_mark(shared)
        short = [S.prompt_ids(n, seed=100 + n + hold_s) for n in (40, 30, 20, 10)]
        requests.post(shared.url + "/pause_generation", json={"mode": "in_place"}, timeout=30).raise_for_status()
        with futures.ThreadPoolExecutor(len(short)) as pool:
            pending = [pool.submit(S.generate, cluster.router_url, ids, NEW_TOKENS) for ids in short]
            time.sleep(hold_s)
            requests.post(shared.url + "/continue_generation", json={}, timeout=30).raise_for_status()
            got = [f.result()["output_ids"] for f in pending]
        for ids, out in zip(short, got):
            want = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS)["output_ids"]
            assert out == want, f"short prompt of {len(ids)} tokens, batched: {out} != single server {want}"
        batches = _prefill_batches(shared, mark)
        print(f"held {hold_s} s, then released: shared prefill batches (requests, tokens):", batches)
    assert any(reqs >= 2 for reqs, _ in batches), f"no prefill batch held several requests: {batches}"
    # OpenAI-compatible completions, text in and out, through the router
    prompt = "Shared KV: one copy per CP group."
    got = S.complete(cluster.router_url, prompt, NEW_TOKENS)
    want = S.complete(cluster.servers["single"].url, prompt, NEW_TOKENS)
    assert got["choices"][0]["text"] == want["choices"][0]["text"], (got, want)
    assert got["usage"]["completion_tokens"] == NEW_TOKENS


def test_long_prompts_at_once_commit_over_mooncake_and_give_every_page_back(cluster):
    """Three multi-chunk prompts at once through the shared-KV PD (the router's way, by the client)
    with SGLang's MooncakeKVManager over Mooncake's TCP transport at Mooncake's default queue limits
    (nothing MC_TCP_* is set): each commits with the oracle's tokens; the rooms overlapped (the
    decode held all three at once, from /v1/loads every 0.2 s); both PD servers end idle with
    every page back (SGLang's load report and idle leak check); no server logged a transfer
    failure, SGLang's or Mooncake's. Thousands of pages per room go through the same classes
    without the model in test_pd_many_pages.py (docs/sglang_cpu_server.md)."""
    shared, decode, single = (cluster.servers[n] for n in ("shared", "decode", "single"))
    marks = {s.name: _log_mark(s) for s in (shared, decode)}
    lengths = (380, 330, 290)  # 3 chunks of 128 each, distinct, not page-aligned
    prompts = [S.prompt_ids(n, seed=1000 + n) for n in lengths]
    peak, stop = [0], threading.Event()

    def sample():  # rooms the decode held at once: pre-allocated, receiving KV or decoding
        while not stop.wait(0.2):
            try:
                load = S.load(decode)
            except (requests.RequestException, ValueError):
                continue
            queues = load.get("disaggregation") or {}
            held = queues.get("decode_prealloc_queue_reqs", 0) + queues.get("decode_transfer_queue_reqs", 0)
            peak[0] = max(peak[0], held + load["num_running_reqs"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        with futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
            pd = [pool.submit(S.generate_pd, shared, decode, ids, NEW_TOKENS, 300) for ids in prompts]
            oracle = [pool.submit(S.generate, single.url, ids, NEW_TOKENS, 300) for ids in prompts]
            answers = [(p.result()[1], o.result()) for p, o in zip(pd, oracle)]
    finally:
        stop.set()
        sampler.join()
    print(f"{len(prompts)} prompts of {lengths} tokens at once: {time.monotonic() - t0:.0f} s; the decode held up "
          f"to {peak[0]} rooms at once")  # fmt: skip
    for n, (got, want) in zip(lengths, answers):
        assert isinstance(got, dict), f"PD prompt of {n} tokens: {got!r}\n{cluster.log_tails()}"
        assert want["output_ids"] and got["output_ids"] == want["output_ids"], f"prompt of {n} tokens: {got} != {want}"
    assert peak[0] >= len(prompts), f"the decode never held {len(prompts)} rooms at once (at most {peak[0]})"
    for server in (shared, decode):
        _wait_idle(server, marks[server.name])
    failures = {s.name: _log_lines_since(s, marks[s.name], TRANSFER_FAILURE) for s in (shared, decode)}
    assert not any(failures.values()), f"transfer failures logged: {failures}"


def test_long_prompt_prefilled_in_several_chunks(cluster):
    shared = cluster.servers["shared"]
    mark = _log_mark(shared)
    n = 2 * S.CHUNK_TOKENS + 40  # 3 chunks
    _assert_same(f"prompt of {n} tokens", *_three_paths(cluster, S.prompt_ids(n, seed=7)))
    chunks = _log_lines_since(shared, mark, r"Prefill batch.*#new-token: ")
    assert len(chunks) >= 3, "expected >= 3 prefill chunks on the shared prefill, got:\n" + "\n".join(chunks)


def test_second_request_hits_the_prefill_radix_cache(cluster):
    shared = cluster.servers["shared"]
    prefix = S.prompt_ids(2 * S.PAGE + 5, seed=11)
    first = prefix + S.prompt_ids(20, seed=12)
    second = prefix + S.prompt_ids(30, seed=13)
    _assert_same("first request", *_three_paths(cluster, first))
    mark = _log_mark(shared)
    _assert_same("second request (cached prefix)", *_three_paths(cluster, second))
    hits = [int(m) for line in _log_lines_since(shared, mark, r"#cached-token: [1-9]")
            for m in re.findall(r"#cached-token: (\d+)", line)]  # fmt: skip
    assert hits and max(hits) >= 2 * S.PAGE, f"no radix hit of >= {2 * S.PAGE} tokens on the shared prefill: {hits}"


def test_client_abort_mid_prefill_frees_everything(cluster):
    shared, decode = cluster.servers["shared"], cluster.servers["decode"]
    marks = {s.name: _log_mark(s) for s in (shared, decode)}
    # 6 chunks: seconds of prefill on CPU, within what the shared prefill admits from the demo's pools
    # (SGLang's limit 832 of its 1024 logical tokens: 7 chunks, 896, are refused at once)
    ids = S.prompt_ids(6 * S.CHUNK_TOKENS, seed=21)
    with pytest.raises(requests.exceptions.ReadTimeout):
        S.generate(cluster.router_url, ids, NEW_TOKENS, timeout_s=1.5)
    # SGLang aborts a request whose client went away (each server checks the connection every few
    # seconds on its own, so the decode may see it after the prefill does)
    deadline = time.monotonic() + 60
    for server, pattern in ((shared, "disconnected from the client side"),
                            (decode, "disconnected from the client side|Aborted by AbortReq")):  # fmt: skip
        while not _log_lines_since(server, marks[server.name], pattern):
            assert time.monotonic() < deadline, f"the {server.name} server never saw the client go away"
            time.sleep(0.5)
    for server in (shared, decode):
        _wait_idle(server, marks[server.name])
    # both keep serving, with the oracle's tokens
    ids = S.prompt_ids(80, seed=22)
    _assert_same("request after the abort", *_three_paths(cluster, ids))


@pytest.mark.stops_shared_servers
def test_killed_cp_rank_fails_the_request_and_the_prefill_exits(cluster):
    """SIGKILL CP rank 1 of the shared prefill while a chunked request is being prefilled: the
    client gets an error (no tokens), the decode frees what it had received and keeps serving,
    and the prefill server exits as a whole (launcher, schedulers, detokenizer) with its ports
    closed, for a supervisor to restart."""
    shared, decode = cluster.servers["shared"], cluster.servers["decode"]
    mark = _log_mark(shared)
    ids = S.prompt_ids(6 * S.CHUNK_TOKENS, seed=31)
    with futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, cluster.router_url + "/generate",
                              json={"input_ids": ids, "sampling_params": S.greedy(NEW_TOKENS)}, timeout=120)  # fmt: skip
        deadline = time.monotonic() + 60
        while len(_log_lines_since(shared, mark, r"Prefill batch.*#new-token: ")) < 2:  # its KV is on the way
            assert time.monotonic() < deadline and not pending.done(), "the request did not start prefilling"
            time.sleep(0.1)
        ranks = shared.scheduler_pids()
        victim = next(pid for title, pid in ranks.items() if "ATTN_CP1" in title)
        os.kill(victim, 9)
        killed_at = time.monotonic()
        answer = pending.result()
    print(
        f"client answer {time.monotonic() - killed_at:.1f} s after the kill: {answer.status_code} {answer.text[:300]}"
    )
    assert answer.status_code >= 400, f"a request whose CP rank died returned {answer.status_code}: {answer.text}"
    assert "output_ids" not in answer.text and "KVTransferError" in answer.text, answer.text
    # the prefill server exits by itself: SGLang's launcher tears the whole group down
    deadline = time.monotonic() + 60
    while shared.exited() is None:
        assert time.monotonic() < deadline, f"the prefill did not exit:\n{shared.log_tail()}"
        time.sleep(0.5)
    print(f"prefill exited with {shared.exited()} {time.monotonic() - killed_at:.1f} s after the kill")
    assert shared.exited() == -signal.SIGKILL  # SGLang's kill_process_tree ends the launcher itself too
    deadline = time.monotonic() + 30
    while S.group_alive(shared.pgid) or any(S.port_open(p) for p in shared.ports):
        assert time.monotonic() < deadline, "processes or ports of the dead prefill left over"
        time.sleep(0.5)
    # the decode failed the room with a reason, freed it, and serves the other prefill
    failures = _log_lines_since(decode, 0, r"Decode transfer failed|KVTransferError")
    assert failures, "the decode logged no failed transfer"
    _wait_idle(decode, 0)
    print(f"decode idle {time.monotonic() - killed_at:.1f} s after the kill")
    ids = S.prompt_ids(70, seed=32)
    _, rep = S.generate_pd(cluster.servers["replicated"], decode, ids, NEW_TOKENS)
    single = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS)["output_ids"]
    assert rep["output_ids"] == single


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
