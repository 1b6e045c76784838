"""The product demo (`bash scripts/demo.sh`): SGLang 0.5.23's real servers with
`--enable-nsa-prefill-cp-shared-kv` on this CPU machine, checked against oracles, with issue 30's report.

It starts (test/helpers/sglang_servers.py, the tiny DeepSeek-V3.2 checkpoint, CPU stand-ins of
docs/sglang_cpu_server.md): a PD prefill at CP=N with the flag ("shared"), the same prefill
without it (replicated CP, "replicated"), a PD decode for both, an ordinary non-CP server (the
oracle, "single") and SGLang's router in front of shared + decode. Then it sends a few greedy
requests through the router (shared-KV PD), through the replicated PD and to the oracle, checks
the tokens are equal, reads SGLang's own capacity and memory reports (/v1/loads,
/get_server_info, each rank's allocation log), prints one report and stops every process, also
on Ctrl-C. Both prefills get the same KV pool per rank (PREFILL_RANK_TOKENS rows): the shared one
admits N x the logical tokens in it, so a prompt longer than one rank's pool is refused by the
replicated prefill (SGLang's own length check) and served by the shared one, which the report
shows against the oracle. Exit status: 0 when every path gave the oracle's tokens and only the
replicated prefill refused the long prompt, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from helpers import sglang_servers as S

PROMPT_LENGTHS = (5, 70, 200)  # one page, two pages, four pages (the last one in 2 prefill chunks)
NEW_TOKENS = 8
MAX_CP = 8
CP_SIZES = S.CPU_TP_SIZES  # the CP sizes that run on CPU (sglang_servers.model_for_tp says why)
# Each prefill rank's KV pool (--max-total-tokens), the same on both prefills: the replicated one
# admits prompts shorter than it (SGLang's max_req_input_len: the pool - 6), the shared one N x that,
# up to the checkpoint's context (1024). LONG_PROMPT lies between, with room for NEW_TOKENS.
PREFILL_RANK_TOKENS = 512
LONG_PROMPT = 640  # 10 pages, 5 prefill chunks
# SGLang's refusal (managers/utils.py validate_input_length)
REFUSAL = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")
# each CP rank's pool allocation (SGLang's mem_cache/memory_pool.py; its GB are rounded to 0.01) and
# the sharded pool's gather scratch (mem_cache/page_interleave_pool.py), tagged with the rank
POOL_LOG = re.compile(r"ATTN_CP(\d+) [^\]]*\] KV Cache is allocated\. dtype: (\S+), #tokens: (\d+)")
SCRATCH_LOG = re.compile(r"ATTN_CP(\d+) [^\]]*\] Page-interleave KV sharding enabled: .*?\(([\d.]+) MiB per rank")
HOST_POOL_LOG = re.compile(r"ATTN_CP(\d+) [^\]]*\] Allocating kv hierarchical KV host pool: (\d+) tokens")
# Start-up limit: every CP rank is a scheduler process importing SGLang (~10 s of CPU each on a quiet
# machine); at CP=8 on 2 cores shared with other work, 600 s was not enough for the 2 x 8 ranks.
START_S_PER_RANK = 60
TRANSFER_KEYS = ("kv_transfer_speed_gb_s", "kv_transfer_latency_ms")


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    """Every option checked before anything starts; a bad one exits 2 with one line."""
    parser = _OneLineErrors(prog="scripts/demo.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", default="2", help=f"prefill CP size, {CP_SIZES} (default 2)")
    parser.add_argument("--kv-cache-dtype", default="bfloat16", help="bfloat16 (default) or fp8_e4m3")
    parser.add_argument("--hicache", action="store_true", help="HiCache's host tier on both prefills")
    parser.add_argument("--workdir", default=None, help="model and logs (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if not args.cp.isdigit() or not 2 <= int(args.cp) <= MAX_CP:
        parser.error(f"--cp {args.cp}: must be an integer from 2 to {MAX_CP} (prefill CP ranks; 1 is no CP)")
    args.cp = int(args.cp)
    if args.cp not in CP_SIZES:
        parser.error(f"--cp {args.cp}: on CPU must be 2, 4 or 8: SGLang pads a --device cpu server's attention "
                     "heads to a multiple of N and its flashmla_sparse path needs a head count that divides 64 "
                     "(docs/sglang_cpu_server.md)")  # fmt: skip
    if args.kv_cache_dtype not in ("bfloat16", "fp8_e4m3"):
        parser.error(f"--kv-cache-dtype {args.kv_cache_dtype}: must be bfloat16 or fp8_e4m3")
    if args.workdir is not None and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        parser.error(f"--workdir {args.workdir}: must be a new or empty folder")
    return args


def cluster_options(args) -> dict:
    """The demo's four servers (sglang_servers' shared, replicated, decode and single roles) at the
    chosen CP size, KV dtype and HiCache setting: sglang_servers.Cluster's `cp` and `extra_args`."""
    kv = S.FP8_KV_ARGS if args.kv_cache_dtype == "fp8_e4m3" else []
    prefill = (S.FP8_PREFILL_ARGS if kv else []) + (S.HICACHE_ARGS if args.hicache else [])
    prefill += ["--max-total-tokens", str(PREFILL_RANK_TOKENS)]  # the same KV bytes per rank on both
    return dict(cp=args.cp, extra_args={"shared": prefill, "replicated": prefill, "decode": kv, "single": kv})


def stage(text: str) -> float:
    print(f"demo: {text}", file=sys.stderr, flush=True)
    return time.monotonic()


def capacity(server) -> dict:
    """SGLang's own numbers: logical tokens the scheduler admits against (/v1/loads), and per CP
    rank the KV pool's GB and token capacity (/get_server_info) and its allocation log line."""
    load = S.load(server)
    states = server.info()["internal_states"]  # one per DP rank (the CP group's rank 0 answers)
    log = server.log_text()
    return {
        "logical_tokens": int(load["max_total_num_tokens"]),
        "kv_gb": [s["memory_usage"]["kvcache"] for s in states],
        "pool_rows": {int(r): int(n) for r, _, n in POOL_LOG.findall(log)},
        "pool_dtypes": sorted({dtype for _, dtype, _ in POOL_LOG.findall(log)}),
        "scratch_mib": {int(r): float(m) for r, m in SCRATCH_LOG.findall(log)},
        "host_rows": {int(r): int(n) for r, n in HOST_POOL_LOG.findall(log)},  # HiCache's host tier
        "transfer": {k: (load.get("disaggregation") or {}).get(k) for k in TRANSFER_KEYS},
    }


def run_requests(cluster) -> list[dict]:
    rows = []
    for length in PROMPT_LENGTHS:
        ids = S.prompt_ids(length, seed=length)
        t = stage(f"request of {length} tokens: shared-KV PD (router), replicated PD, oracle")
        rows.append(dict(length=length, **S.three_paths(cluster, ids, NEW_TOKENS), seconds=time.monotonic() - t))
    return rows


def refusal(prefill, input_ids: list[int], timeout_s: float = 60) -> str | None:
    """SGLang's message when the PD prefill refuses the request, None when it takes it in.

    Sent to the prefill alone, with the bootstrap fields a router adds: the scheduler checks the
    length when the request arrives, before any bootstrap with a decode, and answers at once."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 1}
    try:
        S.generate(prefill.url, input_ids, NEW_TOKENS, timeout_s, **boot)
    except requests.HTTPError as e:
        if e.response.status_code != 400:  # an admission refusal is a Bad Request; anything else is a failure
            raise
        return e.response.json()["error"]["message"]
    except requests.Timeout:
        return None  # taken in: it waits for a decode that is not coming
    return None


def run_long_prompt(cluster) -> dict:
    """The prompt only shared KV can serve: longer than one rank's pool, within the shared N."""
    ids = S.prompt_ids(LONG_PROMPT, seed=LONG_PROMPT)
    t = stage(f"request of {LONG_PROMPT} tokens (> one rank's pool of {PREFILL_RANK_TOKENS}): replicated prefill, "
              "shared-KV PD (router), oracle")  # fmt: skip
    refused = refusal(cluster.servers["replicated"], ids)
    shared = S.generate(cluster.router_url, ids, NEW_TOKENS)["output_ids"]
    oracle = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS)["output_ids"]
    return dict(length=LONG_PROMPT, refused=refused, shared=shared, oracle=oracle, seconds=time.monotonic() - t)


def token_bytes(kv_cache_dtype: str) -> int:
    """KV bytes of one pool row (token) over every layer: the MLA latent row (bf16 576 values, or
    FlashMLA's 656-byte fp8 row) + the indexer's K (128 fp8 values + one fp32 scale)."""
    latent = 576 * 2 if kv_cache_dtype == "bfloat16" else 656
    return (latent + S.MODEL["index_head_dim"] + 4) * S.MODEL["num_hidden_layers"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


@dataclass
class DemoRun:
    """What one demo run saw: the requests' tokens, the long prompt, SGLang's reports."""

    rows: list[dict] = field(default_factory=list)
    long: dict | None = None
    shared: dict | None = None  # capacity(shared prefill)
    replicated: dict | None = None  # capacity(replicated prefill)
    startup_s: float = 0.0
    leftovers: list[str] = field(default_factory=list)
    error: str | None = None  # a server that did not come up, a request that failed

    @property
    def tokens_ok(self) -> bool:
        return bool(self.rows) and all(r["shared"] == r["oracle"] == r["replicated"] for r in self.rows)

    @property
    def long_ok(self) -> bool:
        """The replicated prefill refused the long prompt with SGLang's message; shared KV served it."""
        long = self.long
        return long is not None and bool(REFUSAL.search(long["refused"] or "")) and long["shared"] == long["oracle"]

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens_ok and self.long_ok and not self.leftovers


def capacity_lines(args, shared: dict, replicated: dict) -> list[str]:
    """SGLang's capacity and memory reports side by side, and one sentence of what they show."""
    n = args.cp
    lines = ["KV per CP rank (SGLang's reports)   shared-KV CP     replicated CP",
             f"logical capacity (/v1/loads)        {shared['logical_tokens']:>8d} tokens  "
             f"{replicated['logical_tokens']:>8d} tokens"]  # fmt: skip
    for i, (sh_gb, rep_gb) in enumerate(zip(shared["kv_gb"], replicated["kv_gb"])):
        lines.append(f"KV pool (/get_server_info, state {i})   {sh_gb:8.3f} GB       {rep_gb:8.3f} GB")
    row_bytes = token_bytes(args.kv_cache_dtype)
    ranks = [(r, shared["pool_rows"].get(r), replicated["pool_rows"].get(r)) for r in range(n)]
    for r, sh, rep in ranks:
        if sh is not None and rep is not None:
            lines.append(f"rank {r} pool rows (allocation log) {sh:>6d} = {_mib(sh * row_bytes):>9s}  "
                         f"{rep:>6d} = {_mib(rep * row_bytes):>9s}")  # fmt: skip
    for r in sorted(shared["host_rows"]):
        lines.append(f"rank {r} HiCache host pool (its log) {shared['host_rows'][r]:>6d} rows   "
                     f"{replicated['host_rows'].get(r, 0):>6d} rows")  # fmt: skip
    for r, mib in sorted(shared["scratch_mib"].items()):
        lines.append(f"rank {r} gather scratch (its log)     {mib:8.2f} MiB, charged against the KV budget")
    ratio = shared["logical_tokens"] / replicated["logical_tokens"]
    if not all(sh is not None and rep is not None for _, sh, rep in ranks):
        lines.append(f"logical capacity, shared / replicated = {ratio:.2f} x (a rank's allocation log is missing)")
        return lines
    sh_rows, rep_rows = (sum(c["pool_rows"][r] for r in range(n)) for c in (shared, replicated))
    sh_per = sh_rows * row_bytes / n / shared["logical_tokens"]
    rep_per = rep_rows * row_bytes / n / replicated["logical_tokens"]
    lines.append(f"KV bytes per rank per logical token {sh_per:8.1f} B        {rep_per:8.1f} B   "
                 f"(shared / replicated = {sh_per / rep_per:.3f}; 1/N = {1 / n:.3f})")  # fmt: skip
    memory = sh_rows / rep_rows  # the pool rows above, summed over the ranks
    where = "in the same KV memory per rank" if sh_rows == rep_rows else f"in {memory:.2f} x the KV memory per rank"
    lines.append(f"logical capacity, shared / replicated = {ratio:.2f} x {where}")
    return lines


def report(args, run: DemoRun) -> None:
    n, page = args.cp, S.PAGE
    print(f"servers: PD prefill CP={n} with the flag, the same without it (replicated CP), a decode, "
          f"a non-CP oracle, SGLang's router; KV {args.kv_cache_dtype}, page {page}, HiCache "
          f"{'on' if args.hicache else 'off'}, {PREFILL_RANK_TOKENS} KV rows per prefill rank; "
          f"up in {run.startup_s:.0f} s")  # fmt: skip
    print()
    print("prompt  shared-KV PD (router)               replicated PD  oracle (no CP)  s")
    for r in run.rows:
        same = "= oracle" if r["shared"] == r["oracle"] else "DIFFERENT"
        rep = "=" if r["replicated"] == r["oracle"] else "DIFFERENT"
        print(f"{r['length']:6d}  {str(r['shared']):34s}  {same:13s}  {rep:14s}  {r['seconds']:.1f}")
    if run.long is not None:
        long = run.long
        same = "= oracle" if long["shared"] == long["oracle"] else f"DIFFERENT from the oracle's {long['oracle']}"
        refused = f"refused: {long['refused']}" if long["refused"] else "NOT refused (no answer in 60 s)"
        print()
        print(
            f"prompt of {long['length']} tokens > one rank's pool ({PREFILL_RANK_TOKENS} tokens; {long['seconds']:.1f} s):"
        )
        print(f"  shared-KV PD (router)  {long['shared']}  {same}")
        print(f"  replicated prefill     {refused}")
    print()
    for line in capacity_lines(args, run.shared, run.replicated):
        print(line)
    pages = [-(-length // page) for length in (*PROMPT_LENGTHS, LONG_PROMPT)]
    owned = [sum(1 for p in pages for k in range(p) if k % n == r) for r in range(n)]
    print(f"pages held and sent per CP rank: not in SGLang's reports (/v1/loads is per DP rank; no per-rank page "
          f"count in /get_server_info or the info logs). By SGLang's rule (owner = logical page % {n}, rotating over "
          f"a request's pages) each rank stores and sends about 1/{n} of these prompts' {sum(pages)} pages "
          f"(e.g. {owned}); a replicated rank stores all {sum(pages) - pages[-1]} of those it served, its rank 0 "
          "sends them")  # fmt: skip
    transfer = run.shared["transfer"]
    if any(transfer.values()):  # SGLang reports 0.0 when it has no recent transfer
        print(f"shared prefill's last KV transfer (/v1/loads): {transfer}")


def exercise(cluster, run: DemoRun) -> DemoRun:
    """The demo's requests and SGLang's reports on a running cluster of `cluster_options(args)`'s
    servers: this run's or one already up (test_sglang_server_pd.py's, the CI case of the demo).
    A request that fails ends the run with `error`."""
    try:
        run.rows = run_requests(cluster)
        run.long = run_long_prompt(cluster)
        stage("reading SGLang's capacity and memory reports")
        run.shared, run.replicated = capacity(cluster.servers["shared"]), capacity(cluster.servers["replicated"])
    except (RuntimeError, TimeoutError, requests.RequestException) as e:
        run.error = f"{type(e).__name__}: {e}"
    return run


def run_demo(args, workdir: Path) -> DemoRun:
    """Start the servers, send the requests, read SGLang's reports, stop everything (also on an
    error or Ctrl-C; `leftovers` says what outlived the stop). A server that does not come up or a
    request that fails ends the run with `error` (the message carries the server's log tail)."""
    cluster = S.Cluster(workdir, **cluster_options(args))
    run = DemoRun()
    try:
        stage(f"starting 4 SGLang servers and the router (CP={args.cp}; logs in {workdir / 'logs'}) ...")
        t = time.monotonic()
        cluster.start(timeout_s=START_S_PER_RANK * 2 * args.cp + 300)
        run.startup_s = time.monotonic() - t
        stage(f"servers up in {run.startup_s:.0f} s")
        exercise(cluster, run)
    except (RuntimeError, TimeoutError, requests.RequestException) as e:
        run.error = f"{type(e).__name__}: {e}"
    finally:
        stage("stopping every server")
        run.leftovers = cluster.stop()
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="nsa_cp_demo_"))
    # Ctrl-C and SIGTERM both end in run_demo's `finally`, which stops every server.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run = None
    try:
        run = run_demo(args, workdir)
        if run.error is None:
            report(args, run)
        else:
            print(f"failed: {run.error}")
    except KeyboardInterrupt:
        stage("interrupted")
    ok = run is not None and run.ok
    if run is not None:
        print(f"stopped: {'LEFT OVER ' + str(run.leftovers) if run.leftovers else 'no process or port left'}")
    print(f"oracle: {'ok' if ok else 'FAILED'}")
    print(f"wall time: {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
