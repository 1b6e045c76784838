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


def kernels(raw: dict) -> str:
    head = ("| tokens | CP | fused us | GB/s moved | of copy (min-max) | SGLang's pool write us | fused speed-up |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
    rows = [
        f"| {r['tokens']:,} | {r['cp']} | {r['fused_us']:.1f} | {r['gbps']:,.0f} | {r['of_copy']:.3f} "
        f"({r['of_copy_range'][0]:.3f}-{r['of_copy_range'][1]:.3f}) | {r['sglang_us']:,.1f} | {r['speedup']:.1f} x |"
        for r in raw["results"]
    ]
    return "\n".join([head, *rows])


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


def trace_replay_arms(raw: dict) -> str:
    """Every arm at CP/DP 8, fp8, HiCache off, cache-aware routing: capacity, hits on 1/2/4 nodes,
    KV bytes of the reference forward."""
    ref = raw["reference_forward"]
    rows = [r for r in raw["rows"] if r["width"] == 8 and r["kv_dtype"] == "fp8" and not r["hicache"]
            and r["routing"] in ("-", "cache_aware") and r.get("scratch_contexts") in (None, 1)]  # fmt: skip
    arms = list(dict.fromkeys((r["path"], r["dp_dispatch"]) for r in rows))
    nodes = sorted({r["nodes"] for r in rows})
    head = ("| arm | capacity per node (tokens) | " + " | ".join(f"hits, {k} node{'s' * (k > 1)}" for k in nodes)
            + f" | KV moved per forward ({ref['new']:,} new after {ref['history']:,}), busiest rank |\n"
            + "| --- | ---: | " + " | ".join("---:" for _ in nodes) + " | ---: |")  # fmt: skip
    lines = [head]
    for path, dispatch in arms:
        mine = {r["nodes"]: r for r in rows if (r["path"], r["dp_dispatch"]) == (path, dispatch)}
        one = next(iter(mine.values()))
        per_node = f"{one['capacity_tokens_per_node']:,}" if one["radix_caches"] == one["nodes"] else \
            f"{one['radix_caches'] // one['nodes']} x {one['pool_tokens']:,}"  # fmt: skip
        hits = " | ".join(f"{100 * mine[k]['prefix_hit_fraction']:.1f} %" if k in mine else "-" for k in nodes)
        name = path + (f" ({dispatch})" if dispatch != "-" else "")
        lines.append(f"| {name} | {per_node} | {hits} | {one['kv_bytes_per_forward'] / 1e9:,.2f} GB |")
    return "\n".join(lines)


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


# name -> (results file, renderer of its table, the command that writes the file: "not run yet" until it
# exists with the fields the renderer reads)
BLOCKS: dict[str, tuple[str, Callable[[dict], str], str | None]] = {
    "kernels": ("bench_kernels.json", kernels, None),
    "glm5_layer": (
        "bench_glm5_layer_1xh200.json",
        glm5_layer,
        "bash scripts/gpu_run.sh layer (on 1 x H200), then copy $OUT/bench_glm5_layer_1xh200.json to benchmark/results/",
    ),
    "trace_replay_arms": ("bench_trace_replay.json", trace_replay_arms, "python benchmark/bench_trace_replay.py"),
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
