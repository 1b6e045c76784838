"""Command line: `python -m sglang_nsa_cp demo [options]`.

The demo spawns N CPU ranks over gloo, runs a few requests of mixed lengths (one continuing a
cached prefix) through single-rank, replicated-CP and shared-KV-CP prefill of the reference
model, and reports whether the oracle holds, the KV each rank holds for these requests (pages in
use that it persists) next to the pool it allocated, and bytes moved per collective. Options are
checked before any work (`demo_options`): a bad one ends the command with one line and status 2.

With `--pd` it then runs PD disaggregation end to end (`sglang_nsa_cp.pd.demo`): the shared-KV prefill
ranks send the pages they own of each finished request to a decode process (this one) over
Mooncake, which decodes a few tokens greedily from that KV; it reports the bytes and transfers
per prefill rank against rank 0 sending every page (today's SGLang default), and whether the
decoded tokens and the decode-side KV match the single-rank oracle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sglang_nsa_cp.cli import format_table
from sglang_nsa_cp.demo_options import DemoOptions, UsageError, add_demo_arguments, check_demo_args


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (unknown option, missing value) as one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m sglang_nsa_cp")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the three prefill paths on CPU ranks and check the oracle")
    add_demo_arguments(demo)
    return parser


def _print_report(report: dict) -> None:
    s, paths, kv = report["scenario"], report["paths"], report["kv_per_rank"]
    print(
        f"scenario: cp={s['cp_size']} split={s['split']} page_size={s['page_size']} config={s['config']} dtype={s['dtype']}"
    )
    print(f"chunks:   {s['chunks']}")
    print()
    single = paths["single"]
    rows = [
        [
            "path",
            "oracle",
            "max rel logit err",
            "top-k identical",
            "pages held",
            "KV bytes held",
            "KV pool bytes",
            "wall s",
        ]
    ]
    rows.append(
        [
            "single",
            "-",
            "-",
            "-",
            str(single["held_pages"]),
            str(single["held_bytes"]),
            str(single["kv_bytes"]),
            f"{single['seconds']:.1f}",
        ]
    )
    for name in ("replicated", "shared"):
        p = paths[name]
        rows.append(
            [
                name,
                "ok" if p["ok"] else "FAILED",
                f"{p['max_rel_logit_err']:.2e}",
                str(p["topk_identical"]),
                str(max(p["held_pages_per_rank"])),
                str(max(p["held_bytes_per_rank"])),
                str(max(p["kv_bytes_per_rank"])),
                f"{p['seconds']:.1f}",
            ]
        )
    print(format_table(rows))
    held = ", ".join(str(n) for n in paths["shared"]["held_pages_per_rank"])
    print(f"(per rank; CP rows show the busiest rank. Shared pages held by ranks 0..{s['cp_size'] - 1}: {held})")
    print()
    kinds = sorted(set(paths["replicated"]["bytes_moved"]) | set(paths["shared"]["bytes_moved"]))
    rows = [["bytes moved per collective kind", "replicated", "shared"]]
    for kind in kinds:
        rows.append(
            [kind] + [str(paths[p]["bytes_moved"].get(kind, {}).get("bytes", 0)) for p in ("replicated", "shared")]
        )
    print(format_table(rows))
    print()
    print(
        f"shared KV held per rank = {kv['held_ratio']:.3f} x replicated "
        f"(busiest rank {kv['busiest_shared_rank_pages']} of {kv['pages_in_use']} pages; 1/N = {1 / s['cp_size']:.3f})"
    )
    print(
        f"shared KV pool per rank = {kv['pool_ratio']:.3f} x replicated (pools sized for these requests, whole pages per rank)"
    )
    print("oracle:", "ok" if report["ok"] else "FAILED")


def _print_pd_report(pd: dict) -> None:
    n = pd["cp_size"]
    keyed = "messages keyed with HMAC-SHA256" if pd.get("keyed") else "messages NOT keyed"
    print(f"PD: {n} shared-KV prefill ranks -> 1 decode process (owned-page transfer over Mooncake TCP; {keyed})")
    if not pd["committed"]:
        for key, why in pd["failures"].items():
            print(f"  request {key}: {why}")
        print("pd: FAILED")
        return
    rows = [["prefill rank", "pages sent", "bytes sent", "transfers", "batched writes"]]
    for r in range(n):
        rows.append(
            [
                str(r),
                str(pd["pages_per_rank"][r]),
                str(pd["bytes_per_rank"][r]),
                str(pd["transfers_per_rank"][r]),
                str(pd["batches_per_rank"][r]),
            ]
        )
    base = pd["rank0_sends_all"]
    rows.append(
        [
            "rank 0 alone, all pages (SGLang default)",
            str(base["bytes"] // pd["bytes_per_page"]),
            str(base["bytes"]),
            str(base["transfers"]),
            "-",
        ]
    )
    print(format_table(rows))
    busiest = max(pd["bytes_per_rank"])
    print(
        f"busiest rank sends {busiest / base['bytes']:.3f} x rank 0 alone (1/N = {1 / n:.3f}); "
        f"transfers issued in all: {pd['transfers_issued']}"
    )
    kv = pd["kv"]
    print(f"transferred pages equal the owners' shard pages byte for byte: {pd['transfer_exact']}")
    for part in ("transferred", "decoded"):
        d = kv[part]
        print(
            f"decode KV vs single rank, {part} positions: latent max rel err {d['max_rel_latent_err']:.2e}, "
            f"index K bytes differing {d['index_key_mismatched_bytes']}/{d['index_key_bytes']}, "
            f"index scale max rel err {d['max_rel_index_scale_err']:.2e}"
        )
    print(f"decoded tokens ({pd['decode_steps'] + 1} per request) match single rank: {pd['decoded_tokens_match']}")
    for key, req in pd["requests"].items():
        print(
            f"  {key}: {req['tokens']}"
            + ("" if req["tokens"] == req["single_tokens"] else f" (single: {req['single_tokens']})")
        )
    print("pd:", "ok" if pd["ok"] else "FAILED")


def demo(opts: DemoOptions) -> int:
    from sglang_nsa_cp.oracle import Scenario, run_oracle

    scenario = Scenario.from_lens(
        opts.extend_lens,
        opts.prefix_lens,
        cp_size=opts.cp,
        split=opts.split,
        page_size=opts.page_size,
        config=opts.config,
        seed=opts.seed,
        dtype=opts.dtype,
        prefetch=opts.prefetch,
    )
    start = time.perf_counter()
    full = run_oracle(scenario)
    full["wall_seconds"] = time.perf_counter() - start
    _print_report(full)
    if opts.pd:
        from sglang_nsa_cp.pd.demo import run_pd

        full["oracle_ok"] = full["ok"]
        full["pd"] = run_pd(scenario, decode_steps=opts.decode_steps)
        full["ok"] = full["oracle_ok"] and full["pd"]["ok"]
        full["wall_seconds"] = time.perf_counter() - start
        print()
        _print_pd_report(full["pd"])
    print(f"wall time: {full['wall_seconds']:.1f} s")
    if opts.json_path is not None:
        paths = full["paths"]
        summary = {
            "ok": full["ok"],
            **{
                key: {p: paths[p][key] for p in ("replicated", "shared")}
                for key in (
                    "max_rel_logit_err",
                    "held_pages_per_rank",
                    "held_bytes_per_rank",
                    "kv_bytes_per_rank",
                    "bytes_moved",
                )
            },
            **full,
        }
        try:
            with open(opts.json_path, "w") as f:
                json.dump(summary, f, indent=2)
        except OSError as e:
            print(
                f"python -m sglang_nsa_cp demo: error: --json {opts.json_path}: cannot be written ({e.strerror})",
                file=sys.stderr,
            )
            return 1
    return 0 if full["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        opts = check_demo_args(args)
    except UsageError as e:
        parser.exit(2, f"{parser.prog} demo: error: {e}\n")
    if opts.pd:
        set_mooncake_log_level(opts.mooncake_log)
    return demo(opts)


def set_mooncake_log_level(level: str | None) -> None:
    """Mooncake reads MC_LOG_LEVEL when its engine starts, in this process and in the spawned
    prefill ranks (they inherit the environment). Without --mooncake-log: warnings and errors,
    unless the environment already chose; its INFO lines are start-up chatter."""
    if level is not None:
        os.environ["MC_LOG_LEVEL"] = level.upper()
    else:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


if __name__ == "__main__":
    sys.exit(main())
