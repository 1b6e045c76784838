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


# name -> (results file, renderer of its table)
BLOCKS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "kernels": ("bench_kernels.json", kernels),
    "glm5_layer": ("bench_glm5_layer_1xh200.json", glm5_layer),
}
# name -> the command that writes its results file, for blocks that render "not run yet" without it
NOT_RUN_YET = {
    "glm5_layer": "bash scripts/gpu_run.sh layer (on 1 x H200), then copy $OUT/bench_glm5_layer_1xh200.json "
    "to benchmark/results/",
}


def render(name: str) -> str:
    if name not in BLOCKS:
        raise KeyError(f"no renderer {name!r} in scripts/gen_result_tables.py (known: {', '.join(BLOCKS)})")
    results_file, renderer = BLOCKS[name]
    if name in NOT_RUN_YET and not os.path.exists(os.path.join(RESULTS, results_file)):
        return f"not run yet: `{NOT_RUN_YET[name]}`\n"
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
