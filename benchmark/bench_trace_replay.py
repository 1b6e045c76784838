"""What the shared KV's capacity buys against what a serving engineer would pick instead: a
production trace replayed through SGLang's radix cache on 8-GPU prefill nodes laid out as
replicated CP, shared CP (the flag), SGLang's layer split, DP attention (the router addressing DP
ranks, or SGLang's default dispatch by bootstrap room) or plain TP 8, with and without HiCache's
host tier, on 1, 2 or 4 nodes behind sticky, round-robin or cache-aware routing.

    python benchmark/bench_trace_replay.py              # every arm on the shipped Mooncake trace
    python benchmark/bench_trace_replay.py --widths 8 --nodes 1 --hicache off --limit 3000   # quick

For each arm: the node budget (trace_budget.py: every term printed), the routing of the trace's
requests at their own timestamps over the arm's radix caches (trace_routing.py), one cache pass
per radix cache (trace_cache.py), the bytes one reference forward moves (traffic.py), and the
prefill queue of each node under the cost model at its low, mid and high values (trace_cost.py, on
the GLM-5 layer terms measured on one H200: without benchmark/results/bench_glm5_layer_1xh200.json
the replay still gives capacity, hits and bytes and names the GPU command for TTFT). One JSON row
per arm, a table, DIR/bench_trace_replay.json and DIR/bench_trace_replay.png. docs/trace_replay.md
says what is measured and what is assumed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import math
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import trace_budget as TB  # noqa: E402
import trace_cache as TC  # noqa: E402
import trace_cost as TK  # noqa: E402
import trace_routing as TR  # noqa: E402
import traffic as TF  # noqa: E402
from provenance import provenance as _provenance  # noqa: E402
from tables import format_table, parse_comma_list, save_plot  # noqa: E402
from trace_cache import PAGE, UsageError  # noqa: E402

DEFAULT_TRACE = os.path.join(ROOT, "benchmark", "data", "mooncake_conversation_trace.jsonl.gz")
INDEX_HEAD_DIM = 128
KV_CACHE_DIM = {"bf16": 576, "fp8": 656}  # SGLang's calculate_mla_kv_cache_dim (fp8: FlashMLA's row)
REF_FORWARD = (8192, 65536)  # bytes per forward are given for one chunk of 8,192 new tokens after 64k cached


# ---------------------------------------------------------------------------------------------
# bytes: SGLang's pool and the shared pool's scratch
# ---------------------------------------------------------------------------------------------


def measure_kv_bytes_per_token(kv_dtype: str, layers: int, kv_lora_rank: int = 512, rope: int = 64) -> int:
    """Bytes one token takes in SGLang's `DSATokenToKVPool` (latent rows and index K with its
    scale, all layers): the difference between two CPU pools of one layer, 64 and 128 pages."""
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_dtype]

    def nbytes(size: int) -> int:
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
            pool = DSATokenToKVPool(
                size=size, page_size=PAGE, kv_lora_rank=kv_lora_rank, dtype=dtype, qk_rope_head_dim=rope,
                layer_num=1, device="cpu", index_head_dim=INDEX_HEAD_DIM, enable_memory_saver=False,
                kv_cache_dim=KV_CACHE_DIM[kv_dtype],
            )  # fmt: skip
        return sum(t.numel() * t.element_size() for t in (*pool.kv_buffer, *pool.index_k_with_scale_buffer))

    per_layer = (nbytes(128 * PAGE) - nbytes(64 * PAGE)) // (64 * PAGE)
    return per_layer * layers


def scratch_row_bytes(kv_dtype: str) -> int:
    """One token of ONE layer in the shared pool's scratch: SGLang's `_page_shard_row_bytes` for
    a DSA model (latent row + FP8 index K + one fp32 scale per 128)."""
    kv_size = 2 if kv_dtype == "bf16" else 1
    return KV_CACHE_DIM[kv_dtype] * kv_size + INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4


def scratch_bytes(cp: int, kv_dtype: str, contexts: int, chunk: int, context_len: int) -> int:
    """SGLang's `compute_page_shard_scratch_bytes` per rank: two slots (double buffer) of one
    layer's [prefix | chunk | trash page] rows, prefix = C contexts each rounded up to N pages
    (`make_page_shard_spec`), chunk = chunked_prefill_size rounded up to a page."""
    rows = contexts * _ceil_to(context_len, cp * PAGE) + _ceil_to(chunk, PAGE) + PAGE
    return 2 * rows * scratch_row_bytes(kv_dtype)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------
# one arm
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm:
    kv_dtype: str
    path: str  # replicated, shared, layer_split, dp_attention, tp
    width: int  # attention CP size, or attention DP size (tp: 8)
    scratch_contexts: int | None
    nodes: int
    routing: str  # "-" when there is one radix cache
    dp_dispatch: str = "-"  # dp_attention: dp_aware or bootstrap_room


_REQUESTS: list = []  # the trace, shared with the worker processes (fork)
_TERMS: list = []  # the layer terms (or nothing: no TTFT), shared the same way
_MCFG: list = []  # the model config


def run_arm(arm: Arm, budget: TB.NodeBudget, mcfg: dict, chunk: int, speed: float, kv_bytes: int,
            hicache_modes: list[str]) -> list[dict]:  # fmt: skip
    """The arm's rows: one per HiCache mode, sharing the routing and the device-tier pass."""
    t0 = time.monotonic()
    reqs = _REQUESTS
    if speed != 1.0:
        reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / speed) for r in reqs]
    pools = budget.layout.pools
    workers = arm.nodes * pools
    if arm.path == "dp_attention":
        policy = arm.routing if arm.routing != "-" else "round_robin"
        where = TR.route_dp(reqs, arm.nodes, pools, policy, arm.dp_dispatch)
    else:
        where = TR.route(reqs, workers, arm.routing if workers > 1 else "round_robin")
    per_worker = [[] for _ in range(workers)]
    for i, w in enumerate(where):
        per_worker[w].append(i)
    device = [None] * len(reqs)
    for w, idx in enumerate(per_worker):
        for i, hit in zip(idx, TC.fast_cache_pass([reqs[i] for i in idx], budget.pool_tokens)):
            device[i] = hit
    rows = []
    for mode in hicache_modes:
        if mode == "on":
            total = [None] * len(reqs)
            for w, idx in enumerate(per_worker):
                for i, hit in zip(idx, TC.fast_cache_pass([reqs[i] for i in idx], budget.host_tokens_per_pool)):
                    total[i] = hit
        else:
            total = device
        served = [i for i in range(len(reqs)) if total[i] is not None]
        hit_tok = {i: total[i] * PAGE for i in served}
        load_tok = {i: max(total[i] - (device[i] or 0), 0) * PAGE for i in served}
        input_tokens = sum(reqs[i].input_len for i in served)
        ttft = {}
        busy = {}
        for case in TK.CASES if _TERMS else ():
            cost = TK.StepCost(_TERMS[0], mcfg, arm.path, arm.width, budget.layout.attn_tp, arm.kv_dtype, case,
                               kv_bytes, budget.tokens_per_rank)  # fmt: skip
            all_ttft, node_busy = [], []
            for node in range(arm.nodes):
                lists = [[(reqs[i].arrival_s, reqs[i].input_len, hit_tok[i], load_tok[i])
                          for i in per_worker[node * pools + p] if i in hit_tok] for p in range(pools)]  # fmt: skip
                t, b = TK.simulate_node(lists, TB.per_rank_chunk(chunk, budget.layout), cost)
                all_ttft += t
                node_busy.append(b)
            ttft[case], busy[case] = all_ttft, node_busy
        rows.append(_row(arm, budget, mode, input_tokens, sum(hit_tok.values()), sum(load_tok.values()),
                         len(reqs) - len(served), ttft, busy, time.monotonic() - t0))  # fmt: skip
    return rows


def forward_bytes(arm: Arm, budget: TB.NodeBudget, mcfg: dict) -> dict:
    """Bytes of the reference forward (REF_FORWARD on one worker), per kind, on the busiest rank."""
    terms = TF.forward_terms(arm.path, budget.layout.attn_cp, arm.kv_dtype, mcfg, TF.Batch((REF_FORWARD,)),
                             budget.tokens_per_rank)  # fmt: skip
    return {"kv_bytes_per_forward": TF.kv_bytes_per_forward(terms),
            "hidden_bus_bytes_per_forward": sum(t.forward_bus_bytes for t in terms if "hidden" in t.name),
            "traffic_terms": TF.describe(terms)}  # fmt: skip


def _row(arm, budget, mode, input_tokens, hit_tokens, load_tokens, rejected, ttft, busy, wall_s) -> dict:
    import numpy as np

    row = {
        "cp": budget.layout.attn_cp, "kv_dtype": arm.kv_dtype, "path": arm.path, "width": arm.width,
        "dp_dispatch": arm.dp_dispatch, "mem_fraction_static": budget.mem_fraction_static,
        "cell_bytes": budget.cell_bytes,
        "attn_dp": budget.layout.attn_dp, "attn_tp": budget.layout.attn_tp,
        "scratch_contexts": arm.scratch_contexts, "hicache": mode == "on", "nodes": arm.nodes, "routing": arm.routing,
        "capacity_tokens": budget.capacity_tokens * arm.nodes, "capacity_tokens_per_node": budget.capacity_tokens,
        "radix_caches": budget.layout.pools * arm.nodes, "pool_tokens": budget.pool_tokens,
        "host_tokens_per_pool": budget.host_tokens_per_pool if mode == "on" else 0,
        "host_bytes_per_node": budget.host_bytes_per_node if mode == "on" else 0,
        "weights_gib_per_gpu": budget.weights_bytes / TB.GIB, "kv_pool_gib_per_gpu": budget.kv_pool_bytes / TB.GIB,
        "prefix_hit_fraction": hit_tokens / max(input_tokens, 1),
        "host_hit_fraction": load_tokens / max(input_tokens, 1),
        "prefill_tokens_computed": input_tokens - hit_tokens, "input_tokens": input_tokens, "rejected": rejected,
        "replay_wall_s": wall_s, **forward_bytes(arm, budget, _MCFG[0]),
    }  # fmt: skip
    for case in TK.CASES:
        suffix = "" if case == "mid" else f"_{case}"
        if case not in ttft:  # no layer terms: no TTFT
            for q in (50, 90, 99):
                row[f"ttft_p{q}_s{suffix}"] = None
            row[f"busiest_node_s{suffix}"] = None
            continue
        t = np.array(ttft[case]) if ttft[case] else np.array([float("nan")])
        for q in (50, 90, 99):
            row[f"ttft_p{q}_s{suffix}"] = float(np.percentile(t, q))
        row[f"busiest_node_s{suffix}"] = max(busy[case])
    return row


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage too)
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSON lines, plain or .gz")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"), help="directory for JSON and PNG")
    p.add_argument("--model", default="glm5", help="glm5 or deepseek_v32 (benchmark/data/models/)")
    p.add_argument("--widths", default="2,4,8", help="GPUs per attention group: CP size, or DP size (2, 4, 8)")
    p.add_argument("--paths", default=",".join(TB.PATHS), help=", ".join(TB.PATHS) + " (tp: width 8 only)")
    p.add_argument(
        "--dp-dispatch",
        default=",".join(TR.DP_DISPATCH),
        help="DP attention's request to DP rank: dp_aware (router --dp-aware), bootstrap_room (SGLang's default)",
    )
    p.add_argument("--nodes", default="1,2,4", help="prefill nodes, e.g. 1,2,4")
    p.add_argument("--node-widths", default="8", help="the widths at which more than one node runs")
    p.add_argument("--routing", default=",".join(TR.ROUTINGS), help="sticky, round_robin, cache_aware")
    p.add_argument("--hicache", default="off,on", help="HiCache host tier: off, on or off,on")
    p.add_argument("--kv-dtypes", default="fp8", help="bf16 and/or fp8")
    p.add_argument("--scratch-contexts", default="1", help="shared pool's scratch prefix contexts C (8: SGLang's)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="new tokens per prefill batch (per node)")
    p.add_argument("--speed", type=float, default=1.0, help="arrival-rate factor: 2 replays the trace twice as fast")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--layer-terms", default=None, help="layer terms JSON (default: layer_terms.DEFAULT)")
    p.add_argument("--no-ttft", action="store_true", help="capacity, hits and bytes only (no layer terms needed)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every value before any work; UsageError names the value, the rule and the fix."""
    for name, low in (("widths", 2), ("node_widths", 2), ("nodes", 1), ("scratch_contexts", 1)):
        try:
            setattr(args, name, parse_comma_list(getattr(args, name), int, low=low))
        except ValueError as exc:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: {exc}") from None
    if set(args.widths) - {2, 4, 8}:
        raise UsageError(f"--widths {args.widths}: each must be 2, 4 or 8 (a divisor of the node's TP 8)")
    if max(args.nodes) > 16:
        raise UsageError(f"--nodes {max(args.nodes)}: must be from 1 to 16")
    if max(args.scratch_contexts) > 64:
        raise UsageError(f"--scratch-contexts {max(args.scratch_contexts)}: must be from 1 to 64")
    for name, allowed in (("paths", TB.PATHS), ("routing", TR.ROUTINGS), ("hicache", ("off", "on")),
                          ("kv_dtypes", ("bf16", "fp8")), ("dp_dispatch", TR.DP_DISPATCH)):  # fmt: skip
        items = [s.strip() for s in getattr(args, name).split(",")]
        if not items or set(items) - set(allowed):
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: each must be one of "
                             f"{', '.join(allowed)}")  # fmt: skip
        setattr(args, name, list(dict.fromkeys(items)))
    if args.model not in TB.MODELS:
        raise UsageError(f"--model {args.model!r}: must be one of {', '.join(TB.MODELS)}")
    if not (0 < args.speed <= 1000 and math.isfinite(args.speed)):
        raise UsageError(f"--speed {args.speed}: must be above 0 and at most 1000 (1 = the trace's own arrival times)")
    if not (PAGE * 8 <= args.chunked_prefill_size <= 1 << 20 and args.chunked_prefill_size % (PAGE * 8) == 0):
        raise UsageError(f"--chunked-prefill-size {args.chunked_prefill_size}: must be a multiple of {PAGE * 8} "
                         f"(a page per DP rank) from {PAGE * 8} to 1048576")  # fmt: skip
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be at least 1 (the first N requests)")
    if not 1 <= args.jobs <= 64:
        raise UsageError(f"--jobs {args.jobs}: must be from 1 to 64")
    if not os.path.isfile(args.trace):
        raise UsageError(
            f"--trace {args.trace}: no such file; give a Mooncake-format JSON lines file (.jsonl or .jsonl.gz)"
        )
    if args.layer_terms is not None and not os.path.isfile(args.layer_terms):
        raise UsageError(f"--layer-terms {args.layer_terms}: no such file (the GLM-5 layer terms JSON that "
                         f"benchmark/bench_glm5_layer.py writes)")  # fmt: skip
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: exists and is not a directory")


def load_terms(args) -> tuple[object | None, str]:
    """(the layer terms, a line for the report); None and the reason where they are missing."""
    if args.no_ttft:
        return None, "TTFT not projected (--no-ttft)"
    try:
        terms = TK.load_terms(args.layer_terms)
    except ImportError as exc:
        return None, f"TTFT not projected: benchmark/layer_terms.py is not importable ({exc})"
    except (OSError, ValueError, RuntimeError, SystemExit) as exc:
        return None, f"TTFT not projected: {exc}"
    return terms, "TTFT on the measured layer terms: " + "; ".join(terms.describe())


def plan(args, mcfg: dict, kv_bytes: dict[str, int]) -> list[tuple[Arm, TB.NodeBudget]]:
    arms = []
    for kv in args.kv_dtypes:
        for width in sorted(set(args.widths) | ({TB.NODE_GPUS} if "tp" in args.paths else set())):
            for path in args.paths:
                if (path == "tp" and width != TB.NODE_GPUS) or (path != "tp" and width not in args.widths):
                    continue  # plain TP has one layout: attention TP 8
                for c in args.scratch_contexts if path == "shared" else [None]:
                    scratch = scratch_bytes(width, kv, c, args.chunked_prefill_size,
                                            mcfg["max_position_embeddings"]) if c else 0  # fmt: skip
                    layout = TB.Layout(path, width)
                    budget = TB.node_budget(mcfg, layout, kv, kv_bytes[kv], scratch, args.chunked_prefill_size)
                    if budget.tokens_per_rank <= 0:
                        raise UsageError(f"{path} W={width} {kv}: no KV pool left after the weights and scratch "
                                         f"({budget.kv_pool_bytes / TB.GIB:.1f} GiB); lower --scratch-contexts")  # fmt: skip
                    for k in args.nodes if width in args.node_widths else [1]:
                        for dispatch in args.dp_dispatch if path == "dp_attention" else ["-"]:
                            # bootstrap_room on one node: the rank is the room's draw, no routing
                            routed = k if dispatch == "bootstrap_room" else k * layout.pools
                            for routing in ["-"] if routed == 1 else args.routing:
                                arms.append((Arm(kv, path, width, c, k, routing, dispatch), budget))
    return arms


def provenance(argv: list[str] | None) -> dict:
    argv = [os.path.join(ROOT, "benchmark", "bench_trace_replay.py"), *(sys.argv[1:] if argv is None else argv)]
    return _provenance("model config benchmark/data/models/ (no weights); SGLang's radix cache on CPU",
                       stand_ins=["the Mooncake conversation trace's timestamps stand in for live traffic"], argv=argv)  # fmt: skip


def machine() -> dict:
    from importlib.metadata import version

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None  # fmt: skip
    except OSError:
        commit = None
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), cpu=cpu,
                cores=os.cpu_count(), python=platform.python_version(), sglang=version("sglang"), commit=commit)  # fmt: skip


def run_all(args, arms, mcfg, kv_bytes) -> list[dict]:
    hicache = args.hicache
    jobs = [(arm, budget, mcfg, args.chunked_prefill_size, args.speed, kv_bytes[arm.kv_dtype], hicache)
            for arm, budget in arms]  # fmt: skip
    t0, rows = time.monotonic(), []
    if args.jobs == 1:
        results = map(lambda j: run_arm(*j), jobs)
    else:
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork"))
        results = pool.map(run_arm, *zip(*jobs))
    for n, r in enumerate(results, 1):
        rows += r
        if not args.no_progress:
            print(f"\rarms {n}/{len(jobs)}, {time.monotonic() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    if not args.no_progress:
        print(file=sys.stderr)
    return rows


def _fmt_range(r: dict, key: str) -> str:
    if r[key] is None:
        return "-"
    return f"{r[key]:.2f} ({r[key + '_low']:.2f}-{r[key + '_high']:.2f})"


def print_report(info, args, budgets, kv_bytes, terms_line, rows, n_requests) -> None:
    print(f"machine: {info['cpu']}, {info['cores']} cores; python {info['python']}, sglang {info['sglang']}; "
          f"commit {info['commit']}; {info['date']}")  # fmt: skip
    print(f"trace: {os.path.relpath(args.trace, ROOT) if args.trace.startswith(ROOT) else args.trace}, "
          f"{n_requests} requests, speed x{args.speed}, model {args.model}, chunked prefill {args.chunked_prefill_size} "
          f"per node")  # fmt: skip
    for kv, b in kv_bytes.items():
        print(
            f"KV per token ({kv}): {b} B, measured on SGLang's DSATokenToKVPool; scratch row {scratch_row_bytes(kv)} B"
        )
    seen = set()
    for budget in budgets:
        key = (budget.layout, budget.kv_dtype)
        if key not in seen:
            seen.add(key)
            print("\n".join("budget: " + line for line in budget.lines))
    print(f"cost model: {terms_line}")
    for name, source, missing in TK.terms_lines():
        print(f"  term {name}: {source}; not modelled: {missing}")
    seen = set()
    for r in rows:
        if (r["path"], r["width"], r["kv_dtype"]) not in seen:
            seen.add((r["path"], r["width"], r["kv_dtype"]))
            print(f"bytes {r['path']} W={r['width']} {r['kv_dtype']}, one forward of {REF_FORWARD[0]:,} new after "
                  f"{REF_FORWARD[1]:,} cached:")  # fmt: skip
            print("\n".join("  " + line for line in r["traffic_terms"]))
    print()
    table = [["kv", "path", "W", "C", "dispatch", "hicache", "nodes", "routing", "capacity tok", "hit %", "host hit %",
              "KV GB/fwd", "TTFT p50 s (low-high)", "p90 s (low-high)", "busiest node s"]]  # fmt: skip
    for r in rows:
        table.append([r["kv_dtype"], r["path"], r["width"], r["scratch_contexts"] or "-", r["dp_dispatch"],
                      "on" if r["hicache"] else "off", r["nodes"], r["routing"], f"{r['capacity_tokens']:,}",
                      f"{100 * r['prefix_hit_fraction']:.1f}", f"{100 * r['host_hit_fraction']:.1f}",
                      f"{r['kv_bytes_per_forward'] / 1e9:.2f}", _fmt_range(r, "ttft_p50_s"), _fmt_range(r, "ttft_p90_s"),
                      "-" if r["busiest_node_s"] is None else f"{r['busiest_node_s']:.0f}"])  # fmt: skip
    print(format_table(table, align="llrlllrlrrrrrrr"))


def plot(rows: list[dict], png: str) -> None:
    """Hits and TTFT against the KV an arm caches (device + host), one line per arm: across widths
    on one node; across node counts at the largest width (cache-aware routing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    colors = {"replicated": "black", "shared": "C3", "layer_split": "C2", "dp_attention": "C0", "tp": "C4"}
    width = max(r["width"] for r in rows)

    def key(r):
        return r["path"], r["dp_dispatch"], r["hicache"], r["kv_dtype"], r["scratch_contexts"]

    arms = dict.fromkeys(key(r) for r in rows)

    def cached(r):
        return (r["capacity_tokens"] + r["host_tokens_per_pool"] * r["radix_caches"]) / 1e6

    def lines(ax, pick_rows, y, label_of, errors=False):
        for arm in arms:
            pick = [r for r in pick_rows if key(r) == arm]
            if not pick or any(y(r) is None for r in pick):
                continue
            path, dispatch, hicache, kv, c = arm
            style = dict(color=colors[path], linestyle="--" if hicache else "-", marker="s" if hicache else "o",
                         fillstyle="none" if hicache else "full", alpha=0.5 if dispatch == "bootstrap_room" else 1)  # fmt: skip
            label = (f"{path}{' (' + dispatch + ')' if dispatch != '-' else ''}{' + HiCache' if hicache else ''}"
                     + (f" C={c}" if c else ""))  # fmt: skip
            x, ys = [cached(r) for r in pick], [y(r) for r in pick]
            if errors:
                lo, hi = [y(r, "_low") for r in pick], [y(r, "_high") for r in pick]
                ax.errorbar(x, ys, yerr=[[m - a for m, a in zip(ys, lo)], [b - m for m, b in zip(ys, hi)]], capsize=3,
                            label=label, **style)  # fmt: skip
            else:
                ax.plot(x, ys, label=label, **style)
            for r, xi, yi in zip(pick, x, ys):
                ax.annotate(label_of(r), (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)

    one = sorted(
        (r for r in rows if r["nodes"] == 1 and r["routing"] in ("-", "cache_aware")), key=lambda r: r["width"]
    )
    many = sorted((r for r in rows if r["width"] == width and r["routing"] in ("-", "cache_aware")),
                  key=lambda r: r["nodes"])  # fmt: skip
    served = [r for r in many if r["nodes"] > 1] or many
    hit = lambda r, s="": 100 * r["prefix_hit_fraction"]  # noqa: E731
    lines(axes[0][0], one, hit, lambda r: f"W={r['width']}")
    axes[0][0].set(title="one prefill node: W = 2, 4, 8 GPUs per attention group", ylabel="prefix hit (% of input)")
    lines(axes[0][1], many, hit, lambda r: f"{r['nodes']} node" + ("s" if r["nodes"] > 1 else ""))
    axes[0][1].set(title=f"W={width}, 1/2/4 nodes, cache-aware routing", ylabel="prefix hit (% of input)")
    lines(axes[1][0], one, lambda r, s="": max(r["kv_bytes_per_forward"], 1e6) / 1e9, lambda r: f"W={r['width']}")
    axes[1][0].set(yscale="log", title=f"KV moved per forward ({REF_FORWARD[0]:,} new after {REF_FORWARD[1]:,}; "
                   "floor 1 MB)", ylabel="GB, busiest rank")  # fmt: skip
    if all(r["ttft_p50_s"] is None for r in served):
        axes[1][1].text(0.5, 0.5, "TTFT not projected:\nno layer terms measured yet", ha="center", va="center")
    else:
        lines(axes[1][1], served, lambda r, s="": r[f"ttft_p50_s{s}"], lambda r: f"{r['nodes']} nodes", errors=True)
        axes[1][1].set(yscale="log", title=f"W={width}, cache-aware routing: TTFT p50 (bars: low-high)",
                       ylabel="TTFT p50, s")  # fmt: skip
    for ax in axes.flat:
        ax.set_xlabel("KV the arm caches, device + host, all nodes (M tokens)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Mooncake conversation trace, GLM-5 fp8 on 8 x H200 prefill nodes: replicated CP, shared CP, "
                 "layer split, DP attention, TP 8, HiCache")  # fmt: skip
    save_plot(fig, png)


def main(argv: list[str] | None = None) -> int:
    import json

    try:
        args = parse_args(argv)
        check_args(args)
        requests = TC.load_trace(args.trace, args.limit)
        mcfg = TB.load_model(args.model)
        kv_bytes = {d: measure_kv_bytes_per_token(d, mcfg["num_hidden_layers"]) for d in args.kv_dtypes}
        arms = plan(args, mcfg, kv_bytes)
    except UsageError as exc:
        print(f"bench_trace_replay.py: error: {exc}", file=sys.stderr)
        return 2
    terms, terms_line = load_terms(args)
    _REQUESTS[:] = requests
    _TERMS[:] = [terms] if terms is not None else []
    _MCFG[:] = [mcfg]
    info = machine()
    rows = run_all(args, arms, mcfg, kv_bytes)
    budgets = [b for _, b in arms]
    print_report(info, args, budgets, kv_bytes, terms_line, rows, len(requests))
    os.makedirs(args.out, exist_ok=True)
    raw = {"provenance": provenance(argv), "machine": info, "args": vars(args), "kv_bytes_per_token": kv_bytes,
           "budgets": {f"{b.layout.path}/W={b.layout.width}/{b.kv_dtype}": b.lines for b in budgets},
           "reference_forward": {"new": REF_FORWARD[0], "history": REF_FORWARD[1]},
           "cost_terms": TK.terms_lines(), "ttft": terms_line,
           "layer_terms": getattr(terms, "provenance", None), "rows": rows}  # fmt: skip
    with open(os.path.join(args.out, "bench_trace_replay.json"), "w") as f:
        json.dump(raw, f, indent=1)
    print(f"json: {os.path.join(args.out, 'bench_trace_replay.json')}")
    plot(rows, os.path.join(args.out, "bench_trace_replay.png"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's imports reach Triton; no GPU here
    sys.exit(main())
