"""Command line: `python -m sglang_nsa_cp demo [options]`.

The demo spawns N CPU ranks over gloo, runs a few requests of mixed lengths (one continuing a
cached prefix) through single-rank, replicated-CP and shared-KV-CP prefill of the reference
model, and reports whether the oracle holds, KV bytes per rank and bytes moved per collective.

With `--pd` it then runs PD disaggregation end to end (`sglang_nsa_cp.pd`): the shared-KV prefill
ranks send the pages they own of each finished request to a decode process (this one) over
Mooncake, which decodes a few tokens greedily from that KV; it reports the bytes and transfers
per prefill rank against rank 0 sending every page (today's SGLang default), and whether the
decoded tokens and the decode-side KV match the single-rank oracle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_nsa_cp")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the three prefill paths on CPU ranks and check the oracle")
    demo.add_argument("--cp", type=int, default=4, help="CP ranks (processes), default 4")
    demo.add_argument("--split", choices=["zigzag", "interleave"], default="zigzag")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--extend-lens", type=_int_list, default=[200, 57, 5, 120], help="new tokens per request")
    demo.add_argument("--prefix-lens", type=_int_list, default=[0, 150, 0, 0], help="cached tokens per request")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--config", default="tiny", help="reference model config (tiny, glm5-attn)")
    demo.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    demo.add_argument("--no-prefetch", action="store_true", help="shared path: materialize in place, not one layer ahead")
    demo.add_argument("--pd", action="store_true", help="also transfer to a decode process and decode (PD end to end)")
    demo.add_argument("--decode-steps", type=int, default=4, help="with --pd: greedy decode steps, default 4")
    demo.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    return parser


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _print_report(report: dict) -> None:
    s, paths = report["scenario"], report["paths"]
    print(f"scenario: cp={s['cp_size']} split={s['split']} page_size={s['page_size']} config={s['config']} dtype={s['dtype']}")
    print(f"chunks:   {s['chunks']}")
    print()
    rows = [["path", "oracle", "max rel logit err", "top-k identical", "KV bytes/rank", "wall s"]]
    rows.append(["single", "-", "-", "-", str(paths["single"]["kv_bytes"]), f"{paths['single']['seconds']:.1f}"])
    for name in ("replicated", "shared"):
        p = paths[name]
        rows.append([
            name,
            "ok" if p["ok"] else "FAILED",
            f"{p['max_rel_logit_err']:.2e}",
            str(p["topk_identical"]),
            str(max(p["kv_bytes_per_rank"])),
            f"{p['seconds']:.1f}",
        ])
    print(_table(rows))
    print()
    kinds = sorted(set(paths["replicated"]["bytes_moved"]) | set(paths["shared"]["bytes_moved"]))
    rows = [["bytes moved per collective kind", "replicated", "shared"]]
    for kind in kinds:
        rows.append([kind] + [str(paths[p]["bytes_moved"].get(kind, {}).get("bytes", 0)) for p in ("replicated", "shared")])
    print(_table(rows))
    print()
    ratio = max(paths["shared"]["kv_bytes_per_rank"]) / max(paths["replicated"]["kv_bytes_per_rank"])
    print(f"shared KV per rank = {ratio:.3f} x replicated (1/N = {1 / s['cp_size']:.3f})")
    print("oracle:", "ok" if report["ok"] else "FAILED")


def _print_pd_report(pd: dict) -> None:
    n = pd["cp_size"]
    print(f"PD: {n} shared-KV prefill ranks -> 1 decode process (owned-page transfer over Mooncake TCP)")
    if not pd["committed"]:
        for key, why in pd["failures"].items():
            print(f"  request {key}: {why}")
        print("pd: FAILED")
        return
    rows = [["prefill rank", "pages sent", "bytes sent", "transfers", "batched writes"]]
    for r in range(n):
        rows.append([str(r), str(pd["pages_per_rank"][r]), str(pd["bytes_per_rank"][r]),
                     str(pd["transfers_per_rank"][r]), str(pd["batches_per_rank"][r])])
    base = pd["rank0_sends_all"]
    rows.append(["rank 0 alone, all pages (SGLang default)", str(base["bytes"] // pd["bytes_per_page"]),
                 str(base["bytes"]), str(base["transfers"]), "-"])
    print(_table(rows))
    busiest = max(pd["bytes_per_rank"])
    print(f"busiest rank sends {busiest / base['bytes']:.3f} x rank 0 alone (1/N = {1 / n:.3f}); "
          f"transfers issued in all: {pd['transfers_issued']}")
    kv = pd["kv"]
    print(f"transferred pages equal the owners' shard pages byte for byte: {pd['transfer_exact']}")
    for part in ("transferred", "decoded"):
        d = kv[part]
        print(f"decode KV vs single rank, {part} positions: latent max rel err {d['max_rel_latent_err']:.2e}, "
              f"index K bytes differing {d['index_key_mismatched_bytes']}/{d['index_key_bytes']}, "
              f"index scale max rel err {d['max_rel_index_scale_err']:.2e}")
    print(f"decoded tokens ({pd['decode_steps'] + 1} per request) match single rank: {pd['decoded_tokens_match']}")
    for key, req in pd["requests"].items():
        print(f"  {key}: {req['tokens']}" + ("" if req["tokens"] == req["single_tokens"] else f" (single: {req['single_tokens']})"))
    print("pd:", "ok" if pd["ok"] else "FAILED")


def demo(args: argparse.Namespace) -> int:
    from sglang_nsa_cp.oracle import Scenario, run_oracle

    try:
        scenario = Scenario.from_lens(
            args.extend_lens,
            args.prefix_lens,
            cp_size=args.cp,
            split=args.split,
            page_size=args.page_size,
            config=args.config,
            seed=args.seed,
            dtype=args.dtype,
            prefetch=not args.no_prefetch,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.pd and args.decode_steps < 0:
        print(f"error: --decode-steps must be >= 0, got {args.decode_steps}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    full = run_oracle(scenario)
    full["wall_seconds"] = time.perf_counter() - start
    _print_report(full)
    if args.pd:
        from sglang_nsa_cp.pd import run_pd

        full["oracle_ok"] = full["ok"]
        full["pd"] = run_pd(scenario, decode_steps=args.decode_steps)
        full["ok"] = full["oracle_ok"] and full["pd"]["ok"]
        full["wall_seconds"] = time.perf_counter() - start
        print()
        _print_pd_report(full["pd"])
    print(f"wall time: {full['wall_seconds']:.1f} s")
    if args.json:
        paths = full["paths"]
        summary = {
            "ok": full["ok"],
            "max_rel_logit_err": {p: paths[p]["max_rel_logit_err"] for p in ("replicated", "shared")},
            "kv_bytes_per_rank": {p: paths[p]["kv_bytes_per_rank"] for p in ("replicated", "shared")},
            "bytes_moved": {p: paths[p]["bytes_moved"] for p in ("replicated", "shared")},
            **full,
        }
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if full["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
