"""The figures docs carry from results files, generated: each block between
`<!-- results:NAME:begin -->` and `<!-- results:NAME:end -->` in docs/*.md or README.md is rendered
from its results file by the renderer NAME below, never typed by hand.

    .venv/bin/python scripts/gen_result_tables.py           # print every block
    .venv/bin/python scripts/gen_result_tables.py --write   # replace them where they stand

test/test_docs.py keeps every block equal to what this renders, so a re-run benchmark's new
results reach the docs only through --write, and a stale figure fails CI.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmark", "results")
BLOCK = re.compile(r"(<!-- results:([a-z0-9_]+):begin -->\n)(.*?)(<!-- results:\2:end -->)", re.S)


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def source_line(name: str, raw: dict) -> str:
    """Which file, commit and machine a block comes from (the results file's provenance)."""
    p = raw["provenance"]
    m = p["machine"]
    where = ", ".join(m.get("gpus") or [m["cpu"]])
    dirty = " + uncommitted changes" if p["dirty"] else ""
    return (f"From `benchmark/results/{name}` (commit {p['commit'][:10]}{dirty}; {where}; "
            f"torch {m.get('torch', '?')}; {p['date_utc'][:10]}; `{p['command']}`).")  # fmt: skip


KERNEL_SHARE_TOKENS = 8192  # the chunk the README gives the saving at


def kernels(raw: dict) -> str:
    head = ("| tokens | CP | fused us | GB/s moved | of copy (min-max) | SGLang's pool write us | fused speed-up |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    rows = [
        f"| {r['tokens']:,} | {r['cp']} | {r['fused_us']:.1f} | {r['gbps']:,.0f} | {r['of_copy']:.3f} "
        f"({r['of_copy_range'][0]:.3f}-{r['of_copy_range'][1]:.3f}) | {r['sglang_us']:,.1f} | {r['speedup']:.1f} x |"
        for r in raw["results"]
    ]
    store = raw["provenance"].get("sglang_row_store", "not recorded (the file predates the field)")
    return "\n".join([head, *rows, "", f"SGLang's row store in this run: {store}.", kernel_saving(raw)])


def kernel_saving(raw: dict) -> str:
    """What the fused store saves at a KERNEL_SHARE_TOKENS chunk and the largest CP, against one
    rank's GLM-5 fp8 layer over that chunk (E1's fits)."""
    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    import layer_terms

    terms = layer_terms.LayerTerms(
        load("bench_glm5_layer_1xh200.json"), os.path.join(RESULTS, "bench_glm5_layer_1xh200.json")
    )
    w = max(r["cp"] for r in raw["results"])
    (r,) = [r for r in raw["results"] if r["tokens"] == KERNEL_SHARE_TOKENS and r["cp"] == w]
    n = r["tokens"]
    layer_ms = terms.layer_ms("fp8", n / w, n / 2 - n / (2 * w))  # trace_cost's split of a chunk over W ranks
    saved_ms = (r["sglang_us"] - r["fused_us"]) / 1000
    speedups = [x["speedup"] for x in raw["results"]]
    return (f"The fused store is {min(speedups):.1f}-{max(speedups):.1f} x faster than SGLang's pool write (E8); for a "
            f"chunk of {n:,} tokens without history at CP {w} it saves {saved_ms:.3f} ms of a rank's {layer_ms:.2f} ms "
            f"GLM-5 fp8 layer ({100 * saved_ms / layer_ms:.1f} %; the layer from E1's fits, split over the ranks as "
            f"benchmark/trace_cost.py splits it).")  # fmt: skip


def _pick(values: list[int], wanted: tuple[int, ...]) -> list[int]:
    """The wanted values the grid has (two or more), else its first, middle and last."""
    have = [v for v in wanted if v in values]
    return have if len(have) > 1 else sorted({values[0], values[len(values) // 2], values[-1]})


def glm5_layer(raw: dict) -> str:
    """Measured ms per part at a few grid points, then every part's fit (benchmark/layer_terms.py)."""
    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    import layer_terms

    terms = layer_terms.LayerTerms(raw, os.path.join(RESULTS, "bench_glm5_layer_1xh200.json"))
    ms = {(p["part"], p["kv"], p.get("new"), p.get("history")): p["ms"] for p in raw["points"]}
    grid = raw["grid"]
    head = ("| KV | q (new tokens) | history | attention ms | indexer ms | gemms ms | moe ms | sum ms |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    rows = []
    for kv in layer_terms.KV:
        for q in _pick(grid["new"], (1024, 4096, 16384)):
            for h in _pick(grid["history"], (0, 131072, 1048576)):
                parts = [ms[("attention", kv, q, h)], ms[("indexer", None, q, h)], ms[("gemms", None, q, None)],
                         ms[("moe", None, q, None)]]  # fmt: skip
                rows.append(
                    f"| {kv} | {q:,} | {h:,} | " + " | ".join(f"{v:,.3f}" for v in parts) + f" | {sum(parts):,.3f} |"
                )
    fits = ["| part | KV | ms = | max rel err | points |", "| --- | --- | --- | ---: | ---: |"]
    seen = set()
    for (part, kv), fit in terms.fits.items():
        if id(fit) not in seen:
            seen.add(id(fit))
            fits.append(
                f"| {part} | {kv if fit.kv else 'both'} | {fit.formula()} | {100 * fit.max_rel_err:.1f} % | {fit.points} |"
            )
    modes = raw["modes"]
    gemm_modes = sorted(set(modes["gemms"].values()))
    note = (f"GEMMs through `torch._scaled_mm`: {', '.join(gemm_modes)}; MoE: {modes['moe']}, shared expert "
            f"{modes['moe_dense']}; {len(raw['points'])} points in {raw['wall_s']:.0f} s.")  # fmt: skip
    return "\n".join([head, *rows, "", *fits, "", note])


def _w8_rows(raw: dict) -> list[dict]:
    """The trace replay's rows at CP/DP 8, fp8, cache-aware routing (or none needed), C = 1."""
    return [r for r in raw["rows"] if r["width"] == 8 and r["kv_dtype"] == "fp8"
            and r["routing"] in ("-", "cache_aware") and r.get("scratch_contexts") in (None, 1)]  # fmt: skip


def _arms(rows: list[dict]) -> list[tuple[tuple, dict[int, dict]]]:
    """((path, dispatch, hicache), {nodes: row}) in the replay's order."""
    keys = list(dict.fromkeys((r["path"], r["dp_dispatch"], r["hicache"]) for r in rows))
    return [(k, {r["nodes"]: r for r in rows if (r["path"], r["dp_dispatch"], r["hicache"]) == k}) for k in keys]


def _capacity(r: dict) -> str:
    device = (f"{r['capacity_tokens_per_node']:,}" if r["radix_caches"] == r["nodes"]
              else f"{r['radix_caches'] // r['nodes']} x {r['pool_tokens']:,}")  # fmt: skip
    if not r["hicache"]:
        return device
    per = r["radix_caches"] // r["nodes"]
    host = f"{r['host_tokens_per_pool']:,}" if per == 1 else f"{per} x {r['host_tokens_per_pool']:,}"
    return f"{device} + host {host}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}" if v < 100 else f"{v:,.0f}"


def _ttft(r: dict | None, q: int, ranges: bool) -> str:
    if r is None or r[f"ttft_p{q}_s"] is None:
        return "-"
    mid = _s(r[f"ttft_p{q}_s"])
    return f"{mid} ({_s(r[f'ttft_p{q}_s_low'])}-{_s(r[f'ttft_p{q}_s_high'])})" if ranges else mid


def _arm_name(path: str, dispatch: str) -> str:
    return path + (f" ({dispatch})" if dispatch != "-" else "")


def trace_replay_arms(raw: dict) -> str:
    """Every arm at CP/DP 8, fp8, cache-aware routing, with and without HiCache: capacity, hits on
    1/2/4 nodes (of them from the host tier), KV bytes of the reference forward, and TTFT p50 and
    p90 of the trace's requests queued on their nodes, mid (low-high) of the cost model's range."""
    ref, rows = raw["reference_forward"], _w8_rows(raw)
    nodes = sorted({r["nodes"] for r in rows})
    k = " / ".join(map(str, nodes))
    head = (f"| arm | HiCache | capacity per node (tokens) | hits, {k} nodes | of them from host | KV moved per "
            f"forward ({ref['new']:,} new after {ref['history']:,}), busiest rank | "
            + " | ".join(f"TTFT p50; p90 s, {n} node{'s' * (n > 1)}" for n in nodes) + " |\n"
            + "| --- | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in nodes) + " |")  # fmt: skip
    lines = [head]
    for (path, dispatch, hicache), mine in _arms(rows):
        one = next(iter(mine.values()))
        hits = " / ".join(f"{100 * mine[n]['prefix_hit_fraction']:.1f}" if n in mine else "-" for n in nodes)
        host = " / ".join(f"{100 * mine[n]['host_hit_fraction']:.1f}" if n in mine else "-" for n in nodes)
        ttft = " | ".join(f"{_ttft(mine.get(n), 50, True)}; {_ttft(mine.get(n), 90, True)}" for n in nodes)
        lines.append(f"| {_arm_name(path, dispatch)} | {'on' if hicache else 'off'} | {_capacity(one)} | {hits} % | "
                     f"{host + ' %' if hicache else '-'} | {one['kv_bytes_per_forward'] / 1e9:,.2f} GB | {ttft} |")  # fmt: skip
    return "\n".join(lines) + "\n\n" + _ttft_note(raw)


def _ttft_note(raw: dict) -> str:
    if all(r["ttft_p50_s"] is None for r in raw["rows"]):
        return f"TTFT: not projected in this run ({raw['ttft']})."
    terms = raw.get("layer_terms") or {}
    return ("TTFT: every request of the trace at its own timestamp, queued on its node (chunked prefill, FIFO), "
            "each step's time from the GLM-5 layer terms measured on one H200 (commit "
            f"{str(terms.get('commit', '?'))[:10]}) and the bytes each arm moves at assumed NVLink bus bandwidths: "
            "a PROJECTION, mid (low-high) of the cost model's range; capacity and hits are SGLang's sizing and "
            "radix cache replayed on CPU.")  # fmt: skip


def trace_replay_summary(raw: dict) -> str:
    """README's table: trace_replay_arms without the ranges and the host split."""
    ref, rows = raw["reference_forward"], _w8_rows(raw)
    nodes = sorted({r["nodes"] for r in rows})
    k = " / ".join(map(str, nodes))
    head = (f"| arm | HiCache | capacity per node (tokens) | hits, {k} nodes | KV per forward ({ref['new'] // 1024}k "
            f"new after {ref['history'] // 1024}k) | TTFT p50, {k} nodes (s) | TTFT p90, {k} nodes (s) |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    lines = [head]
    for (path, dispatch, hicache), mine in _arms(rows):
        one = next(iter(mine.values()))
        hits = " / ".join(f"{100 * mine[n]['prefix_hit_fraction']:.1f}" if n in mine else "-" for n in nodes)
        p50, p90 = (" / ".join(_ttft(mine.get(n), q, False) for n in nodes) for q in (50, 90))
        lines.append(f"| {_arm_name(path, dispatch)} | {'on' if hicache else 'off'} | {_capacity(one)} | {hits} % | "
                     f"{one['kv_bytes_per_forward'] / 1e9:,.2f} GB | {p50} | {p90} |")  # fmt: skip
    note = _ttft_note(raw).replace("mid (low-high)", "mid")
    return "\n".join(lines) + "\n\n" + note.replace("range;", "range (docs/trace_replay.md gives low-high);")


def ttft_projection(raw: dict) -> str:
    rows = [r for r in raw["rows"] if r["width"] == 8 or r["path"] == "tp"]
    prompts = sorted({r["prompt"] for r in rows})
    kinds = list(dict.fromkeys(r["cached_kind"] for r in rows))
    head = ("| arm, cached | " + " | ".join(f"{p // 1024}k" for p in prompts) + " |\n| --- | "
            + " | ".join("---:" for _ in prompts) + " |")  # fmt: skip
    lines = [head]
    for path in dict.fromkeys(r["path"] for r in rows):
        for kind in kinds:
            cells = []
            for p in prompts:
                r = next((r for r in rows if (r["path"], r["prompt"], r["cached_kind"]) == (path, p, kind)), None)
                cells.append("-" if r is None else "refused" if r["refused"] else
                             f"{r['ttft_s']:.2f} ({r['ttft_s_low']:.2f}-{r['ttft_s_high']:.2f})")  # fmt: skip
            lines.append(f"| {path}, {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nTTFT in seconds, one request alone on the node, mid (low-high): a PROJECTION."


def alternatives(raw: dict) -> str:
    """One sentence per alternative at W = 8, fp8, cache-aware routing: capacity (SGLang's sizing),
    hits replayed on 1/2/4 nodes, KV bytes per forward (traffic.py's formulas), and TTFT p50 / p90
    over the trace on the most nodes, projected, without and with HiCache, against the flag's in
    each of the cost model's cases (low, mid, high)."""
    rows = _w8_rows(raw)
    arms = dict(_arms(rows))
    most = max(r["nodes"] for r in rows)
    flag = arms[("shared", "-", False)]
    f1 = next(iter(flag.values()))
    nodes = "/".join(str(k) for k in sorted(flag))
    ttft_run = any(r["ttft_p50_s"] is not None for r in rows)

    def hits(mine):
        return "/".join(f"{100 * mine[k]['prefix_hit_fraction']:.1f}" for k in sorted(mine)) + " %"

    def ttft(r):
        return f"p50 {_ttft(r, 50, True)} s, p90 {_ttft(r, 90, False)} s" if ttft_run else "not projected"

    def versus(r, f):
        """Where the flag's TTFT p50 is lower than r's, in the cost model's cases."""
        if not ttft_run:
            return ""
        lower = [c for c in ("low", "mid", "high") if f["ttft_p50_s" + ("" if c == "mid" else f"_{c}")]
                 < r["ttft_p50_s" + ("" if c == "mid" else f"_{c}")]]  # fmt: skip
        return ("; the flag's p50 is lower in every case" if len(lower) == 3 else
                "; the flag's p50 is lower in no case" if not lower else
                f"; the flag's p50 is lower only in the {', '.join(lower)} case(s)")  # fmt: skip

    on = arms.get(("shared", "-", True))
    lines = [
        f"Capacity by SGLang's sizing, hits replayed on {nodes} nodes, KV per forward by the formulas the CPU "
        f"servers count; TTFT over the trace on {most} nodes, projected, mid (low-high). The flag: "
        f"{f1['capacity_tokens_per_node']:,} tokens a node, hits {hits(flag)}, "
        f"{f1['kv_bytes_per_forward'] / 1e9:.2f} GB of KV moved per forward by the busiest rank, TTFT "
        f"{ttft(flag[most])}" + (f"; with HiCache hits {hits(on)}, TTFT {ttft(on[most])}." if on else "."),
    ]
    for path, dispatch, name in (("layer_split", "-", "SGLang's layer split"),
                                 ("dp_attention", "dp_aware", "DP attention, router --dp-aware"),
                                 ("dp_attention", "bootstrap_room", "DP attention, SGLang's default dispatch"),
                                 ("tp", "-", "plain --tp 8"), ("replicated", "-", "replicated CP")):  # fmt: skip
        mine = arms[(path, dispatch, False)]
        one = next(iter(mine.values()))
        ratio = f1["capacity_tokens_per_node"] / one["capacity_tokens_per_node"]
        line = (f"- {name}: {_capacity(one)} tokens a node ({ratio:.2f} x less than the flag), hits {hits(mine)}, "
                f"{one['kv_bytes_per_forward'] / 1e9:.2f} GB of KV per forward, TTFT {ttft(mine[most])}"
                f"{versus(mine[most], flag[most])}")  # fmt: skip
        hc = arms.get((path, dispatch, True))
        if hc and on:
            line += f"; with HiCache hits {hits(hc)}, TTFT {ttft(hc[most])}{versus(hc[most], on[most])}"
        lines.append(line + ".")
    return "\n".join(lines)


def scratch(raw: dict) -> str:
    """The gather scratch at SGLang's eight contexts and the flag's one, per KV dtype and context."""
    lines = ["| KV | context | SGLang's default, 8 contexts | the flag's default, 1 context | "
             f"KV of a {raw['results'][0]['layers']}-layer model that the difference holds, per rank |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    seen = set()
    for r in raw["results"]:
        key = (r["kv_dtype"], r["context"])
        if key in seen:  # one row per dtype and context (the scratch does not depend on CP)
            continue
        seen.add(key)
        mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
        lines.append(f"| {r['kv_dtype']} | {r['context'] // 1024}k | {mib(r['sglang_default']['scratch_bytes'])} | "
                     f"{mib(r['plugin_default']['scratch_bytes'])} | {r['saved_tokens']:,.0f} tokens |")  # fmt: skip
    return "\n".join(lines)


def toy_server_check(raw: dict) -> str:
    """Each configuration of the toy model's server check: start-up, every case against the oracle,
    capacity, scratch and the long prompt (scripts/sglang_server_check.py's JSON)."""
    lines = ["| KV, CP | servers up | cases through the three paths | the client that leaves | logical capacity, shared vs "
             "replicated (pool rows per rank) | gather scratch per rank | long prompt: replicated | long prompt: shared |",
             "| --- | ---: | --- | --- | --- | ---: | --- | --- |"]  # fmt: skip
    for c in raw["configs"]:
        cases = [r for r in c["requests"] if r["case"] != "abort"]
        (abort,) = [r for r in c["requests"] if r["case"] == "abort"]
        same = sum(r["equal"] for r in cases)
        saw = [who for who, seen in abort["saw_client_leave"].items() if seen]
        cap = c["capacity"]
        rows = {cap[k]["pool_rows"][r] for k in ("shared", "replicated") for r in cap[k]["pool_rows"]}
        scratch = {round(v, 2) for v in cap["shared"]["scratch_mib"].values()}
        lp = c["long_prompt"]
        refused = lp["replicated"].split(":")[0] if lp["replicated_refused"] else "served"
        lines.append(
            f"| {c['kv_cache_dtype']}, {c['cp']} | {c['startup_s']:.1f} s | {same} of {len(cases)} = oracle "
            f"({', '.join(r['case'] for r in cases)}) | seen by {' and '.join(saw) or 'nobody'}; "
            f"{'its check passed' if abort['equal'] else 'its check FAILED'} | "
            f"{cap['shared']['logical_tokens']:,} vs {cap['replicated']['logical_tokens']:,} tokens: "
            f"{cap['shared']['logical_tokens'] / cap['replicated']['logical_tokens']:.2f} x "
            f"({', '.join(f'{n:,}' for n in sorted(rows))}) | {', '.join(f'{v:.2f}' for v in sorted(scratch))} MiB | "
            f"{lp['tokens']:,} tokens: {refused} | {'= oracle' if lp['shared'] == lp['oracle'] else 'differs from the oracle'} |"
        )
    return "\n".join(lines)


def mtp_server_check(raw: dict) -> str:
    """`sglang_server_check.py --model mtp-toy`: per configuration, each case's tokens on the three paths
    and SGLang's speculative counters, shared against replicated, and the mean accept length."""
    lines = ["| KV, CP | servers up | case | prompt tokens | tokens: shared / replicated / oracle | "
             "speculative counters: shared = replicated | accept length | verify steps |",
             "| --- | ---: | --- | ---: | --- | --- | ---: | ---: |"]  # fmt: skip
    for c in raw["configs"]:
        for r in c["requests"]:
            head = f"{c['kv_cache_dtype']}, {c['cp']} | {c['startup_s']:.1f} s"
            if r["case"] == "drafts accepted":
                lines.append(f"| {head} | mean over the cases | | | | {r['mean_accept_length']:.2f} | |")
                continue
            same = r["shared"] == r["replicated"] == r["oracle"]
            spec = r["spec"]["shared"]
            lines.append(f"| {head} | {r['case']} | {r['tokens']:,} | {'all equal' if same else 'DIFFER'} | "
                         f"{'yes' if r['spec']['shared'] == r['spec']['replicated'] else 'NO'} | "
                         f"{spec['spec_accept_length']:.2f} | {spec['spec_verify_ct']} |")  # fmt: skip
    return "\n".join(lines)


# The README's claims and the results file each rests on: (row, claim, file, measured or projected).
EVIDENCE = (
    ("E1", "GLM-5 layer compute terms at real shapes", "bench_glm5_layer_1xh200.json", "measured, 1 x H200"),
    ("E2", "capacity, hits and KV per forward of every arm; TTFT p50/p90 over the trace", "bench_trace_replay.json",
     "replayed on CPU (SGLang's sizing, the Mooncake trace); TTFT projected from E1 and NVLink bus bandwidths"),
    ("E3", "prefill TTFT of every arm on 8 x H200", "bench_ttft_projection.json",
     "projected from E1 and NVLink bus bandwidths"),
    ("E4", "SGLang's forward: shared = replicated bit for bit, CP 2 and 4, bf16 and fp8", "gpu_suite_1xh200.log",
     "measured, 1 x H200 (ranks share the GPU)"),
    ("E5", "real servers at GLM-5's attention shapes, CP 4, bf16", "sglang_server_check_glm5_shaped_bf16_1xh200.json",
     "measured, 1 x H200"),
    ("E5b", "the same with every layer dense (no expert routing): every case = oracle but for 1-ulp ties, bf16 and "
     "fp8", "sglang_server_check_glm5_shaped_dense_1xh200.json", "measured, 1 x H200"),
    ("E6", "real servers at GLM-5's attention shapes, CP 4, fp8", "sglang_server_check_glm5_shaped_fp8_1xh200.json",
     "measured, 1 x H200"),
    ("E7", "real servers, toy model, CP 2 and 4, bf16 and fp8", "sglang_server_check_1xh200.json",
     "measured, 1 x H200"),
    ("E8", "the fused fp8 store against SGLang's pool write", "bench_kernels.json", "measured, 1 x H200"),
    ("E9", "the gather scratch SGLang reserves and the flag's", "bench_scratch_bytes.json", "SGLang's CPU pools"),
    ("E10", "SGLang's layer split beside the flag in real servers: tokens = oracle, counted KV bytes = formula, "
     "toy model, bf16 CP 2 and fp8 CP 4", "sglang_server_check_layer_split_1xh200.json", "measured, 1 x H200"),
    ("E11", "--dsa-prefill-backend flashmla_sparse_q8 with the flag: SGLang's JIT kernel built, shared = replicated "
     "bit for bit, CP 2, bf16 and fp8, GLM-5's attention shapes", "q8_gpu_forward_1xh200.log", "measured, 1 x H200"),
    ("E12", "MTP (EAGLE over GLM-5's NextN layer) live over PD with the flag in real servers: tokens = oracle, SGLang's "
     "speculative counters = replicated CP, toy model, bf16 and fp8 CP 2", "sglang_server_check_mtp_1xh200.json",
     "measured, 1 x H200"),
)  # fmt: skip


def _provenance_of(name: str) -> dict | None:
    path = os.path.join(RESULTS, name)
    if name.endswith(".json"):
        return load(name).get("provenance")
    with open(path) as f:
        first = f.readline()
    return json.loads(first.split(":", 1)[1]) if first.startswith("# provenance:") else None


def evidence() -> str:
    """One row per README claim: its results file, and the commit, machine and model it records."""
    lines = ["| row | claim | results file | commit | machine | model | kind |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row, claim, name, kind in EVIDENCE:
        p = _provenance_of(name)
        if p is None:
            commit = machine = model = "not recorded (the file predates provenance)"
        else:
            commit = p["commit"][:10] + (" + uncommitted changes" if p.get("dirty") else "")
            m = p["machine"]
            machine = ", ".join(m.get("gpus") or [m["cpu"]])
            model = p["model"] if isinstance(p["model"], str) else " ".join(map(str, next(iter(p["model"].items()))))
        lines.append(f"| {row} | {claim} | `benchmark/results/{name}` | {commit} | {machine} | {model} | {kind} |")
    return "\n".join(lines)


def cpu_test_times() -> str:
    """Each timed test file's wall and CPU time (scripts/time_tree.py), with its commit and load."""
    path = os.path.join(RESULTS, "cpu_test_times.json")
    if not os.path.exists(path):
        return "Not run yet: `.venv/bin/python scripts/time_tree.py -- .venv/bin/python -m pytest -q FILE`."
    lines = ["| file | wall s | CPU s (user + sys, whole tree) | CPU s / 2 (its least wall time on 2 cores) | peak PSS GiB | load avg (1 min) at start / end | exit | commit |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]  # fmt: skip
    for name, row in sorted(load("cpu_test_times.json")["files"].items()):
        p = row["provenance"]
        commit = p["commit"][:10] + (" + uncommitted changes" if p.get("dirty") else "")
        lines.append(f"| `{name}` | {row['wall_s']:.0f} | {row['cpu_s']:.0f} | {row['cpu_s'] / 2:.0f} | "
                     f"{row['peak_pss_gib']:.1f} | {row['load_average_start'][0]:.0f} / {row['load_average_end'][0]:.0f} | "
                     f"{row['exit']} | {commit} |")  # fmt: skip
    return (
        "\n".join(lines)
        + "\n\nFrom `benchmark/results/cpu_test_times.json` (`scripts/time_tree.py`, one row per file)."
    )


# name -> (results file, or None for a renderer that reads several and names each; renderer of its table;
# the command that writes the file: "not run yet" until it
# exists with the fields the renderer reads)
BLOCKS: dict[str, tuple[str | None, Callable[..., str], str | None]] = {
    "kernels": ("bench_kernels.json", kernels, None),
    "kernel_saving": ("bench_kernels.json", kernel_saving, None),
    "glm5_layer": (
        "bench_glm5_layer_1xh200.json",
        glm5_layer,
        "bash scripts/gpu_run.sh layer (on 1 x H200), then copy $OUT/bench_glm5_layer_1xh200.json to benchmark/results/",
    ),
    "trace_replay_arms": ("bench_trace_replay.json", trace_replay_arms, "python benchmark/bench_trace_replay.py"),
    "trace_replay_summary": ("bench_trace_replay.json", trace_replay_summary, "python benchmark/bench_trace_replay.py"),
    "evidence": (None, evidence, None),  # many files: each row names its own
    "scratch": ("bench_scratch_bytes.json", scratch, "python benchmark/bench_scratch_bytes.py"),
    "cpu_test_times": (None, cpu_test_times, None),  # one row per timed file, each with its commit
    "toy_server_check": (
        "sglang_server_check_1xh200.json",
        toy_server_check,
        "bash scripts/gpu_run.sh server",
    ),
    "mtp_server_check": (
        "sglang_server_check_mtp_1xh200.json",
        mtp_server_check,
        "bash scripts/gpu_run.sh server --model mtp-toy",
    ),
    "alternatives": (
        "bench_trace_replay.json",
        alternatives,
        "python benchmark/bench_trace_replay.py",
    ),
    "ttft_projection": (
        "bench_ttft_projection.json",
        ttft_projection,
        "bash scripts/gpu_run.sh layer, then python benchmark/bench_ttft_projection.py",
    ),
}


def render(name: str) -> str:
    if name not in BLOCKS:
        raise KeyError(f"no renderer {name!r} in scripts/gen_result_tables.py (known: {', '.join(BLOCKS)})")
    results_file, renderer, command = BLOCKS[name]
    if results_file is None:
        return f"{renderer()}\n"
    if command is not None:
        try:
            raw = load(results_file)
            table = renderer(raw)
        except OSError:
            return f"Not run yet: `{command}` (no {results_file} in benchmark/results).\n"
        except KeyError as exc:  # written by an older version of its benchmark
            return f"Not run yet: `{command}` (`benchmark/results/{results_file}` predates its field {exc}).\n"
        if "provenance" not in raw:
            return f"Not run yet: `{command}` (`benchmark/results/{results_file}` has no provenance).\n"
        return f"{table}\n\n{source_line(results_file, raw)}\n"
    raw = load(results_file)
    return f"{renderer(raw)}\n\n{source_line(results_file, raw)}\n"


def documents() -> list[str]:
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def stale_documents() -> list[str]:
    """The documents whose blocks differ from what their results files render."""
    stale = []
    for path in documents():
        with open(path) as f:
            text = f.read()
        if regenerate(text) != text:
            stale.append(os.path.relpath(path, REPO))
    return stale


def main(argv: list[str]) -> int:
    write = argv == ["--write"]
    if argv and not write:
        print("usage: gen_result_tables.py [--write]", file=sys.stderr)
        return 2
    for path in documents():
        with open(path) as f:
            text = f.read()
        new = regenerate(text)
        if write and new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"wrote {os.path.relpath(path, REPO)}")
        if not write:
            for m in BLOCK.finditer(new):
                print(f"== {os.path.relpath(path, REPO)}: {m.group(2)}\n{m.group(3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
