"""Projected prefill TTFT of one request alone on an 8 x H200 node (GLM-5 FP8), for every arm
(replicated CP, shared CP = the flag, SGLang's layer split, DP attention, plain TP 8) at CP / DP
2, 4 and 8, prompts of 32k to 1M tokens, with no cached prefix and with all but the last chunk
cached; low / mid / high.

    python benchmark/bench_ttft_projection.py            # every point
    python benchmark/bench_ttft_projection.py --quick    # CP 8, three prompts

A PROJECTION, not a measurement: compute from the GLM-5 layer terms measured on one H200
(layer_terms.py; the command refuses, naming the GPU command, while they are missing), traffic
from traffic.py at NVLink busBW, overlap as SGLang's streams allow (trace_cost.py says every term).
The prompt runs in SGLang's chunks (--chunked-prefill-size per node; a DP rank gets its 1/W of it,
as SGLang resolves); a prompt longer than the arm's pool (one radix cache, less the chunk's pages)
is refused as SGLang refuses it. Writes DIR/bench_ttft_projection.json with provenance and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import trace_budget as TB  # noqa: E402
import trace_cost as TK  # noqa: E402
from bench_trace_replay import measure_kv_bytes_per_token, scratch_bytes  # noqa: E402
from provenance import provenance  # noqa: E402
from tables import format_table, parse_comma_list  # noqa: E402

PROMPTS = (32768, 65536, 131072, 262144, 524288, 1048576)
QUICK_PROMPTS = (32768, 131072, 1048576)
GPU_COMMAND = "bash scripts/gpu_run.sh layer   (benchmark/bench_glm5_layer.py on one H200)"


class UsageError(Exception):
    pass


def arms(widths: list[int]) -> list[TB.Layout]:
    out = [TB.Layout(p, w) for w in widths for p in ("replicated", "shared", "layer_split", "dp_attention")]
    return out + [TB.Layout("tp", TB.NODE_GPUS)]


def project(terms, mcfg: dict, layout: TB.Layout, kv: str, prompt: int, cached: int, chunk: int, case: str,
            budget: TB.NodeBudget, kv_bytes: int) -> dict:  # fmt: skip
    """TTFT of one `prompt`-token request with `cached` tokens in the radix cache: its chunks one
    after another on its worker (a CP group, or one DP rank while the others idle)."""
    if prompt > budget.pool_tokens - TB.per_rank_chunk(chunk, layout):
        return {"refused": True, "pool_tokens": budget.pool_tokens}
    cost = TK.StepCost(terms, mcfg, layout.path, layout.width, layout.attn_tp, kv, case, kv_bytes,
                       budget.tokens_per_rank)  # fmt: skip
    step_chunk = TB.per_rank_chunk(chunk, layout)
    done, total_ms, steps, first = cached, 0.0, 0, None
    idle = [[]] * (layout.pools - 1)
    while done < prompt:
        new = min(step_chunk, prompt - done)
        parts = cost.breakdown([[(new, done)], *idle])
        first = first or parts
        total_ms += parts["step_ms"]
        done += new
        steps += 1
    return {"refused": False, "ttft_s": total_ms / 1e3, "steps": steps, "first_step": first}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"))
    p.add_argument("--widths", default="2,4,8", help="CP / DP widths")
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt tokens")
    p.add_argument("--kv-dtype", default="fp8", choices=("bf16", "fp8"))
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--layer-terms", default=None, help="layer terms JSON (default: layer_terms.DEFAULT)")
    p.add_argument("--quick", action="store_true", help=f"CP 8 and prompts {QUICK_PROMPTS}")
    args = p.parse_args(argv)
    try:
        args.widths = [8] if args.quick else parse_comma_list(args.widths, int, low=2)
        args.prompts = list(QUICK_PROMPTS) if args.quick else parse_comma_list(args.prompts, int, low=1024)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if set(args.widths) - {2, 4, 8}:
        raise UsageError(f"--widths {args.widths}: each must be 2, 4 or 8")
    if args.chunked_prefill_size % (TB.PAGE * 8) or args.chunked_prefill_size <= 0:
        raise UsageError(f"--chunked-prefill-size {args.chunked_prefill_size}: a positive multiple of {TB.PAGE * 8}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"bench_ttft_projection.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        terms = TK.load_terms(args.layer_terms)
    except ImportError as exc:
        print(f"bench_ttft_projection.py: error: no layer terms (benchmark/layer_terms.py: {exc}); measure them "
              f"first: {GPU_COMMAND}", file=sys.stderr)  # fmt: skip
        return 2
    except (OSError, ValueError, RuntimeError, SystemExit) as exc:
        print(f"bench_ttft_projection.py: error: {exc} (measure them: {GPU_COMMAND})", file=sys.stderr)
        return 2
    mcfg = TB.load_model("glm5")
    kv = args.kv_dtype
    kv_bytes = measure_kv_bytes_per_token(kv, mcfg["num_hidden_layers"])
    chunk = args.chunked_prefill_size
    rows, budgets = [], {}
    for layout in arms(args.widths):
        scratch = (
            scratch_bytes(layout.width, kv, 1, chunk, mcfg["max_position_embeddings"]) if layout.path == "shared" else 0
        )
        budget = TB.node_budget(mcfg, layout, kv, kv_bytes, scratch, chunk)
        budgets[f"{layout.path}/W={layout.width}"] = budget.lines
        for prompt in args.prompts:
            for cached_name, cached in (
                ("none", 0),
                (f"all but the last {chunk:,}", max(prompt - chunk, 0) // TB.PAGE * TB.PAGE),
            ):
                row = {"path": layout.path, "width": layout.width, "attn_tp": layout.attn_tp, "prompt": prompt,
                       "cached": cached, "cached_kind": cached_name, "pool_tokens": budget.pool_tokens}  # fmt: skip
                for case in TK.CASES:
                    got = project(terms, mcfg, layout, kv, prompt, cached, chunk, case, budget, kv_bytes)
                    suffix = "" if case == "mid" else f"_{case}"
                    row["refused"] = got["refused"]
                    row[f"ttft_s{suffix}"] = got.get("ttft_s")
                    if case == "mid" and not got["refused"]:
                        row["steps"], row["first_step"] = got["steps"], got["first_step"]
                rows.append(row)
    table = [["path", "W", "prompt", "cached", "TTFT s (low-high)", "steps"]]
    for r in rows:
        ttft = ("refused (pool " + f"{r['pool_tokens']:,})") if r["refused"] else \
            f"{r['ttft_s']:.3f} ({r['ttft_s_low']:.3f}-{r['ttft_s_high']:.3f})"  # fmt: skip
        table.append([r["path"], r["width"], f"{r['prompt']:,}", f"{r['cached']:,}", ttft, r.get("steps", "-")])
    print("PROJECTION (not measured): " + "; ".join(terms.describe()))
    for name, source, missing in TK.terms_lines():
        print(f"  term {name}: {source}; not modelled: {missing}")
    print(format_table(table, align="lrrrrr"))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "bench_ttft_projection.json")
    raw = {
        "provenance": provenance("GLM-5 FP8 shapes, 8 x H200 node: a projection from measured layer terms",
                                 stand_ins=["NVLink busBW from published nccl-tests, not measured"],
                                 argv=[os.path.join(ROOT, "benchmark", "bench_ttft_projection.py"),
                                       *(sys.argv[1:] if argv is None else argv)]),
        "layer_terms": getattr(terms, "provenance", None), "layer_terms_lines": terms.describe(),
        "cost_terms": TK.terms_lines(), "kv_dtype": kv, "chunked_prefill_size": chunk, "budgets": budgets,
        "rows": rows,
    }  # fmt: skip
    with open(out, "w") as f:
        json.dump(raw, f, indent=1)
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
