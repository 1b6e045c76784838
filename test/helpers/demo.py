"""The product demo (`bash scripts/demo.sh`): SGLang 0.5.23's real servers with
`--enable-nsa-prefill-cp-shared-kv` on this CPU machine, checked against oracles, with issue 30's report.

It starts (test/helpers/sglang_servers.py, the tiny DeepSeek-V3.2 checkpoint, CPU stand-ins of
docs/sglang_cpu_server.md): a PD prefill at CP=N with the flag ("shared"), the same prefill
without it (replicated CP, "replicated"), a PD decode for both, an ordinary non-CP server (the
oracle, "single") and SGLang's router in front of shared + decode. Then it sends a few greedy
requests through the router (shared-KV PD), through the replicated PD and to the oracle, checks
the tokens are equal, reads SGLang's own capacity and memory reports (/v1/loads,
/get_server_info, each rank's allocation log), prints one report and stops every process, also
on Ctrl-C. Exit status: 0 when every path gave the oracle's tokens, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import requests

from helpers import sglang_servers as S

PROMPT_LENGTHS = (5, 70, 200)  # one page, two pages, four pages (the last one in 2 prefill chunks)
NEW_TOKENS = 8
MAX_CP = 8
# each CP rank's pool allocation (SGLang's mem_cache/memory_pool.py; its GB are rounded to 0.01) and
# the sharded pool's gather scratch (mem_cache/page_interleave_pool.py), tagged with the rank
POOL_LOG = re.compile(r"ATTN_CP(\d+) [^\]]*\] KV Cache is allocated\. dtype: \S+, #tokens: (\d+)")
SCRATCH_LOG = re.compile(r"ATTN_CP(\d+) [^\]]*\] Page-interleave KV sharding enabled: .*?\(([\d.]+) MiB per rank")
TRANSFER_KEYS = ("kv_transfer_speed_gb_s", "kv_transfer_latency_ms")


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    """Every option checked before anything starts; a bad one exits 2 with one line."""
    parser = _OneLineErrors(prog="scripts/demo.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", default="2", help=f"prefill CP size, 2 to {MAX_CP} (default 2)")
    parser.add_argument("--kv-cache-dtype", default="bfloat16", help="bfloat16 (default) or fp8_e4m3")
    parser.add_argument("--hicache", action="store_true", help="HiCache's host tier on both prefills")
    parser.add_argument("--workdir", default=None, help="model and logs (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if not args.cp.isdigit() or not 2 <= int(args.cp) <= MAX_CP:
        parser.error(f"--cp {args.cp}: must be an integer from 2 to {MAX_CP} (prefill CP ranks; 1 is no CP)")
    args.cp = int(args.cp)
    if args.kv_cache_dtype not in ("bfloat16", "fp8_e4m3"):
        parser.error(f"--kv-cache-dtype {args.kv_cache_dtype}: must be bfloat16 or fp8_e4m3")
    if args.workdir is not None and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        parser.error(f"--workdir {args.workdir}: must be a new or empty folder")
    return args


def _with_cp(role_args: list[str], cp: int) -> list[str]:
    """A role's arguments at CP size `cp` instead of sglang_servers.CP (--tp, --attn-cp-size)."""
    out = list(role_args)
    for i, a in enumerate(out[:-1]):
        if a in ("--tp", "--attn-cp-size"):
            out[i + 1] = str(cp)
    return out


def configure_roles(args) -> None:
    """The demo's four servers, as sglang_servers.ROLES entries of this process (the names the
    Cluster and its router look up), at the chosen CP size, KV dtype and HiCache setting."""
    roles = {name: list(S.ROLES[name][0]) for name in ("shared", "replicated", "decode", "single")}
    if args.kv_cache_dtype == "fp8_e4m3":
        roles = {name: list(S.ROLES[f"fp8_{name}"][0]) for name in ("shared", "replicated", "decode")} | {
            "single": roles["single"] + S.FP8_KV_ARGS
        }
    if args.hicache:  # the same logical device capacity on both prefills: shared holds 1/N per rank
        for name, per_rank in (("shared", S.HICACHE_DEVICE_TOKENS // args.cp), ("replicated", S.HICACHE_DEVICE_TOKENS)):
            roles[name] += S.HICACHE_ARGS + ["--max-total-tokens", str(per_rank)]
    for name in ("shared", "replicated"):
        S.ROLES[name] = (_with_cp(roles[name], args.cp), True)
    S.ROLES["decode"] = (roles["decode"], False)
    S.ROLES["single"] = (roles["single"], False)
    # one core-binding entry per CP rank (SGLang requires it when ranks outnumber NUMA nodes)
    S.SERVER_ENV["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % 2) for r in range(args.cp))


def stage(text: str) -> float:
    print(f"demo: {text}", file=sys.stderr, flush=True)
    return time.monotonic()


def capacity(server) -> dict:
    """SGLang's own numbers: logical tokens the scheduler admits against (/v1/loads), and per CP
    rank the KV pool's GB and token capacity (/get_server_info) and its allocation log line."""
    (load,) = requests.get(server.url + "/v1/loads", timeout=10).json()["loads"]
    states = server.info()["internal_states"]  # one per DP rank (the CP group's rank 0 answers)
    log = server.log_text()
    return {
        "logical_tokens": int(load["max_total_num_tokens"]),
        "kv_gb": [s["memory_usage"]["kvcache"] for s in states],
        "pool_rows": {int(r): int(n) for r, n in POOL_LOG.findall(log)},
        "scratch_mib": {int(r): float(m) for r, m in SCRATCH_LOG.findall(log)},
        "transfer": {k: (load.get("disaggregation") or {}).get(k) for k in TRANSFER_KEYS},
    }


def run_requests(cluster) -> list[dict]:
    rows = []
    for length in PROMPT_LENGTHS:
        ids = S.prompt_ids(length, seed=length)
        t = stage(f"request of {length} tokens: shared-KV PD (router), replicated PD, oracle")
        shared = S.generate(cluster.router_url, ids, NEW_TOKENS)["output_ids"]
        _, replicated = S.generate_pd(cluster.servers["replicated"], cluster.servers["decode"], ids, NEW_TOKENS)
        if isinstance(replicated, Exception):
            raise replicated
        oracle = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS)["output_ids"]
        rows.append(dict(length=length, shared=shared, replicated=replicated["output_ids"], oracle=oracle,
                         seconds=time.monotonic() - t))  # fmt: skip
    return rows


def token_bytes(kv_cache_dtype: str) -> int:
    """KV bytes of one pool row (token) over every layer: the MLA latent row (bf16 576 values, or
    FlashMLA's 656-byte fp8 row) + the indexer's K (128 fp8 values + one fp32 scale)."""
    latent = 576 * 2 if kv_cache_dtype == "bfloat16" else 656
    return (latent + S.MODEL["index_head_dim"] + 4) * S.MODEL["num_hidden_layers"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def report(args, rows, shared, replicated, startup_s: float) -> bool:
    n, page = args.cp, S.PAGE
    ok = all(r["shared"] == r["oracle"] == r["replicated"] for r in rows)
    print(f"servers: PD prefill CP={n} with the flag, the same without it (replicated CP), a decode, "
          f"a non-CP oracle, SGLang's router; KV {args.kv_cache_dtype}, page {page}, HiCache "
          f"{'on' if args.hicache else 'off'}; up in {startup_s:.0f} s")  # fmt: skip
    print()
    print("prompt  shared-KV PD (router)               replicated PD  oracle (no CP)  s")
    for r in rows:
        same = "= oracle" if r["shared"] == r["oracle"] else "DIFFERENT"
        rep = "=" if r["replicated"] == r["oracle"] else "DIFFERENT"
        print(f"{r['length']:6d}  {str(r['shared']):34s}  {same:13s}  {rep:14s}  {r['seconds']:.1f}")
    print()
    print("KV per CP rank (SGLang's reports)   shared-KV CP     replicated CP")
    print(
        f"logical capacity (/v1/loads)        {shared['logical_tokens']:>8d} tokens  {replicated['logical_tokens']:>8d} tokens"
    )
    for i, (sh_gb, rep_gb) in enumerate(zip(shared["kv_gb"], replicated["kv_gb"])):
        print(f"KV pool (/get_server_info, state {i})   {sh_gb:8.3f} GB       {rep_gb:8.3f} GB")
    row_bytes = token_bytes(args.kv_cache_dtype)
    rows = [(r, shared["pool_rows"].get(r), replicated["pool_rows"].get(r)) for r in range(n)]
    for r, sh, rep in rows:
        if sh is not None and rep is not None:
            print(f"rank {r} pool rows (allocation log) {sh:>6d} = {_mib(sh * row_bytes):>9s}  "
                  f"{rep:>6d} = {_mib(rep * row_bytes):>9s}")  # fmt: skip
    for r, mib in sorted(shared["scratch_mib"].items()):
        print(f"rank {r} gather scratch (its log)     {mib:8.2f} MiB, charged against the KV budget")
    if all(sh is not None and rep is not None for _, sh, rep in rows):
        sh_per, rep_per = (
            sum(c["pool_rows"][r] for r in range(n)) * row_bytes / n / c["logical_tokens"] for c in (shared, replicated)
        )
        print(f"KV bytes per rank per logical token {sh_per:8.1f} B        {rep_per:8.1f} B   "
              f"(shared / replicated = {sh_per / rep_per:.3f}; 1/N = {1 / n:.3f})")  # fmt: skip
    ratio = shared["logical_tokens"] / replicated["logical_tokens"]
    print(f"logical capacity, shared / replicated = {ratio:.2f} x in the same KV memory per rank")
    pages = [-(-length // page) for length in PROMPT_LENGTHS]
    owned = [sum(1 for p in pages for k in range(p) if k % n == r) for r in range(n)]
    print(f"pages held and sent per CP rank: not in SGLang's reports (/v1/loads is per DP rank; no per-rank page "
          f"count in /get_server_info or the info logs). By SGLang's rule (owner = logical page % {n}, rotating over "
          f"a request's pages) each rank holds and sends about 1/{n} of these prompts' {sum(pages)} pages "
          f"(e.g. {owned}); a replicated rank holds all {sum(pages)}, its rank 0 sends them")  # fmt: skip
    transfer = shared["transfer"]
    if any(transfer.values()):  # SGLang reports 0.0 when it has no recent transfer
        print(f"shared prefill's last KV transfer (/v1/loads): {transfer}")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    configure_roles(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="nsa_cp_demo_"))
    cluster = S.Cluster(workdir)
    # Ctrl-C and SIGTERM both end in `finally`, which stops every server.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ok = False
    try:
        stage(f"starting 4 SGLang servers and the router (CP={args.cp}; logs in {workdir / 'logs'}) ...")
        t = time.monotonic()
        cluster.start()
        startup_s = time.monotonic() - t
        stage(f"servers up in {startup_s:.0f} s")
        rows = run_requests(cluster)
        stage("reading SGLang's capacity and memory reports")
        shared, replicated = capacity(cluster.servers["shared"]), capacity(cluster.servers["replicated"])
        ok = report(args, rows, shared, replicated, startup_s)
    except KeyboardInterrupt:
        stage("interrupted")
    finally:
        stage("stopping every server")
        leftovers = cluster.stop()
        print(f"stopped: {'LEFT OVER ' + str(leftovers) if leftovers else 'no process or port left'}")
        print(f"oracle: {'ok' if ok else 'FAILED'}")
        print(f"wall time: {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
