"""Bandwidth of the plugin's fused fp8 store on CUDA, next to a device copy and SGLang's own path (GPU, ~1 min).

    PYTHONPATH=python python benchmark/bench_kernels.py [--tokens 8192] [--out DIR] [--plot] [--sweep] [--dry-run]

fp8-store-sglang = store_mla_fp8_owned_and_scratch at rank 0 of CP 2, 4, 8 for --tokens tokens:
every row to the layer's scratch, the owned ones to the shard, against what SGLang's
PageInterleaveDSATokenToKVPool.set_mla_kv_buffer does (quantize_k_cache_separate twice, the owned
rows index_select-ed first, then two stores: index_copy_ of the nope and rope parts, or SGLang's
set_mla_kv_buffer_triton where it runs). All write the same bytes (checked first, on poisoned
outputs); times are CUDA-event medians after warm-up with L2 flushed; "of copy" is the time of a
device-to-device copy of the same bytes / the kernel's. Results go to DIR/bench_kernels.json and
.csv (default benchmark/results/), with --plot to DIR/bench_kernels.png; --sweep first times
launch shapes and runs the table with the best. (The copy, materialize and store kernels of the
plugin's former pool, and their rows in docs/kernels.md, went with that pool.)

--dry-run checks the fp8-store-sglang cases on CPU under TRITON_INTERPRET=1 (use a small --tokens,
e.g. 130) and times nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton

from tables import comma_list, format_table
from sglang_nsa_cp.kernels import formats, mla_fp8_owned_and_scratch

MIB = 1 << 20
PAGE = 64
DEV = torch.device("cuda")
GOALS = {"fp8-store-sglang": 0.90}
GOAL_MIN_MIB = 64


@dataclass
class Case:
    kernel: str  # the public function
    use: str  # rerange / materialize / materialize-scatter / store
    rows: str
    pattern: str
    mib_in: int
    moved_bytes: int
    triton_fn: Callable[[], object] = field(repr=False)
    torch_fns: dict[str, Callable[[], object]] = field(repr=False)
    check: Callable[[], bool] = field(repr=False)


# ---- inputs ----------------------------------------------------------------------------------
def random_rows(rows: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, device=DEV).view(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xAB)
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def word_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's rows as the widest integer words that divide them (for torch's kernels)."""
    nbytes = t.shape[1] * t.element_size()
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0:
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


def views(*tensors: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
    return {"native": tensors, "words": tuple(word_view(t) for t in tensors)}


def random_pages_slots(pages: int, tokens: int, owner_rank: int | None = None, cp_size: int = 1) -> torch.Tensor:
    """out_cache_loc-like slots: 64-token pages in random order (only `owner_rank`'s pages if
    given), each filled in order."""
    ids = torch.arange(pages, device=DEV)
    if owner_rank is not None:
        ids = ids[ids % cp_size == owner_rank]
    ids = ids[torch.randperm(ids.numel(), device=DEV)]
    return (ids[:, None] * PAGE + torch.arange(PAGE, device=DEV)).reshape(-1)[:tokens].contiguous()


def fp8_store_sglang_case(tokens: int, n: int) -> Case:
    """SGLang's sharded DSA pool write of a chunk at rank 0 of CP n: the chunk (replicated on
    every rank) staged to scratch rows after a page of other rows, the owned ~1/n to the shard."""
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate

    op = mla_fp8_owned_and_scratch
    pages = -(-tokens // PAGE)
    pages += -pages % n
    slots = random_pages_slots(pages, tokens) + n * PAGE  # never the reserved first n pages
    shard = torch.empty(((pages + n) // n * PAGE, formats.MLA_FP8_ROW_BYTES), dtype=torch.uint8, device=DEV)
    scratch = torch.empty((pages * PAGE + 2 * PAGE, formats.MLA_FP8_ROW_BYTES), dtype=torch.uint8, device=DEV)
    scratch_rows = PAGE + torch.arange(tokens, device=DEV)
    # As DeepSeek's attention passes them: k_nope a [T, 1, 512] tensor, k_rope a slice of the latent.
    latent = torch.randn(tokens, 1, formats.MLA_DIM, device=DEV) * torch.exp(torch.randn(tokens, 1, 1, device=DEV))
    latent = latent.to(torch.bfloat16)
    k_nope, k_rope = latent[..., : formats.MLA_NOPE_DIM].contiguous(), latent[..., formats.MLA_NOPE_DIM :]
    # SGLang caches this write plan per batch (_get_write_plan): computed outside the timed region.
    local = formats.owned_physical_rows(slots, 0, n, PAGE)
    owned_idx = (local >= 0).nonzero().squeeze(1)
    local_rows = local[owned_idx]
    nope_bytes = formats.MLA_NOPE_DIM + 4 * (formats.MLA_NOPE_DIM // formats.MLA_FP8_BLOCK)
    args = (scratch_rows, shard, slots, k_nope, k_rope, 0, n, PAGE)

    def index_copy_parts(dst, rows, nope, rope):
        dst[:, :nope_bytes].index_copy_(0, rows, nope.squeeze(1))
        dst[:, nope_bytes:].index_copy_(0, rows, rope.squeeze(1))

    def set_mla_kv_buffer(dst, rows, nope, rope):
        from sglang.kernels.ops.kvcache.mla_buffer import set_mla_kv_buffer_triton

        set_mla_kv_buffer_triton(dst, rows, nope, rope)

    def sglang_pool(store):
        def write():
            store(scratch, scratch_rows, *quantize_k_cache_separate(k_nope, k_rope))
            owned = quantize_k_cache_separate(k_nope.index_select(0, owned_idx), k_rope.index_select(0, owned_idx))
            store(shard, local_rows, *owned)

        return write

    torch_fns = {
        "sglang x2+index_copy_": sglang_pool(index_copy_parts),
        "sglang x2+set_mla_kv_buffer_triton": sglang_pool(set_mla_kv_buffer),
    }

    def check():
        got = op.store_mla_fp8_owned_and_scratch_triton(poison(scratch), scratch_rows, poison(shard), *args[2:])
        got = [t.clone() for t in got]
        want = op.store_mla_fp8_owned_and_scratch_torch(poison(scratch), scratch_rows, poison(shard), *args[2:])
        ok = all(map(same_bytes, got, want))
        for name in list(torch_fns):
            poison(scratch), poison(shard)
            try:
                torch_fns[name]()
            except (ImportError, RuntimeError) as exc:  # SGLang's JIT store needs its toolchain
                print(f"fp8-store-sglang: {name} does not run here ({type(exc).__name__}: {exc}); not timed")
                del torch_fns[name]
                continue
            ok &= same_bytes(scratch, got[0]) and same_bytes(shard, got[1])
        return ok

    return Case(
        "store_mla_fp8_owned_and_scratch",
        "fp8-store-sglang",
        "bf16 -> fp8-656B x2",
        f"{tokens} tok gathered cp{n}",
        tokens * formats.MLA_DIM * 2 // MIB,
        tokens * (formats.MLA_DIM * 2 + formats.MLA_FP8_ROW_BYTES) + owned_idx.numel() * formats.MLA_FP8_ROW_BYTES,
        lambda: op.store_mla_fp8_owned_and_scratch_triton(scratch, *args),
        torch_fns,
        check,
    )


def fp8_store_sglang_cases(tokens: int) -> list[Case]:
    return [fp8_store_sglang_case(tokens, n) for n in (2, 4, 8)]


def dry_run(tokens: list[int]) -> None:
    """Correctness of the fp8-store-sglang cases on CPU (Triton's interpreter); nothing timed."""
    global DEV
    DEV = torch.device("cpu")
    bad = []
    for t in tokens:
        for case in fp8_store_sglang_cases(t):
            ok = case.check()
            print(f"dry run {case.kernel} {case.pattern}: {'ok' if ok else 'BAD'} (against {list(case.torch_fns)})")
            bad += [] if ok else [case.pattern]
    sys.exit(f"{len(bad)} cases differ: {bad}" if bad else 0)


# ---- timing ----------------------------------------------------------------------------------
class Timer:
    """Median CUDA-event time of one call, L2 flushed before each run."""

    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup
        # Flushed by reading, not writing: dirty flush lines would be written back inside the
        # timed region.
        self.flush = torch.ones(64 * MIB, dtype=torch.int64, device=DEV)

    def us(self, fn: Callable[[], object], iters: int | None = None) -> float:
        iters = iters or self.iters
        for _ in range(self.warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            self.flush.amax()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in events)

    def copy_us(self, nbytes: int) -> float:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        return self.us(lambda: dst.copy_(src))


def measure(case: Case, timer: Timer) -> dict:
    ok = case.check()
    t_triton = timer.us(case.triton_fn)
    t_copy = timer.copy_us(case.moved_bytes)
    torch_times = {name: timer.us(fn, max(timer.iters // 3, 5)) for name, fn in case.torch_fns.items()}
    best = min(torch_times, key=torch_times.get)
    return dict(
        kernel=case.kernel,
        use=case.use,
        rows=case.rows,
        pattern=case.pattern,
        mib_in=case.mib_in,
        moved_bytes=case.moved_bytes,
        ok=ok,
        triton_us=t_triton,
        gbps=case.moved_bytes / t_triton / 1e3,
        copy_us=t_copy,
        copy_gbps=case.moved_bytes / t_copy / 1e3,
        of_copy=t_copy / t_triton,
        torch_us=torch_times[best],
        torch_impl=best,
        torch_all_us=torch_times,
        speedup=torch_times[best] / t_triton,
    )


# family: (launch-shape names in the op's module, candidate values, which cases to time)
SWEEP_MODULES = {"fp8_sglang": mla_fp8_owned_and_scratch}
SWEEPS = {
    "fp8_sglang": (
        ("FP8_ROWS_PER_PROGRAM", "FP8_NUM_WARPS"),
        [(4, 2), (4, 4), (8, 4), (16, 8)],
        lambda c: c.kernel == "store_mla_fp8_owned_and_scratch",
    ),
}


def sweep(cases: list[Case], timer: Timer) -> list[dict]:
    """Time every candidate launch shape of each family on its cases."""
    rows = []
    for family, (names, configs, wanted) in SWEEPS.items():
        module = SWEEP_MODULES[family]
        saved = [getattr(module, n) for n in names]
        for case in filter(wanted, cases):
            t_copy = timer.copy_us(case.moved_bytes)
            for config in configs:
                for n, v in zip(names, config, strict=True):
                    setattr(module, n, v)
                t = timer.us(case.triton_fn)
                rows.append(
                    dict(
                        family=family,
                        config=config,
                        kernel=case.kernel,
                        rows=case.rows,
                        pattern=case.pattern,
                        mib_in=case.mib_in,
                        us=t,
                        of_copy=t_copy / t,
                    )
                )
                print(
                    f"sweep {family:6} {str(config):20} {case.kernel:20} {case.rows:22} {case.pattern:24} {case.mib_in:4} MiB {t:9.1f} us {t_copy / t:6.3f} of copy",
                    flush=True,
                )
        for n, v in zip(names, saved, strict=True):
            setattr(module, n, v)
    return rows


def apply_best(rows: list[dict]) -> None:
    """Set each family's launch shape with the highest geometric-mean fraction of copy."""
    for family, (names, _, _) in SWEEPS.items():
        scores = {}
        for r in rows:
            if r["family"] == family:
                scores.setdefault(tuple(r["config"]), []).append(math.log(r["of_copy"]))
        if not scores:  # no case of this family ran (--only)
            continue
        best = max(scores, key=lambda c: statistics.fmean(scores[c]))
        for n, v in zip(names, best, strict=True):
            setattr(SWEEP_MODULES[family], n, v)
        print(
            f"sweep {family}: using {dict(zip(names, best, strict=True))} (geomean {math.exp(statistics.fmean(scores[best])):.3f} of copy)"
        )


# ---- report ----------------------------------------------------------------------------------
def machine() -> dict:
    props = torch.cuda.get_device_properties(DEV)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (no git checkout)"
    return {
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "launch_shapes": {n: getattr(SWEEP_MODULES[f], n) for f, (names, _, _) in SWEEPS.items() for n in names},
    }


def print_table(results: list[dict]) -> None:
    head = [
        "kernel",
        "use",
        "rows",
        "pattern",
        "MiB in",
        "MiB mv",
        "us",
        "GB/s",
        "copy GB/s",
        "of copy",
        "torch us",
        "speedup",
        "ok",
        "torch impl",
    ]
    rows = [
        [r["kernel"], r["use"], r["rows"], r["pattern"], r["mib_in"], f"{r['moved_bytes'] / MIB:.1f}", f"{r['triton_us']:.1f}",
         f"{r['gbps']:.0f}", f"{r['copy_gbps']:.0f}", f"{r['of_copy']:.3f}", f"{r['torch_us']:.1f}", f"{r['speedup']:.2f}",
         "ok" if r["ok"] else "BAD", r["torch_impl"]]
        for r in results
    ]  # fmt: skip
    print(format_table([head, *rows], align="llll" + "r" * 8 + "ll", header_rule=True))
    print(f"geometric mean: {geomean(results, 'of_copy'):.3f} of copy, {geomean(results, 'speedup'):.2f}x plain torch")


def geomean(results: list[dict], key: str) -> float:
    return math.exp(statistics.fmean(math.log(r[key]) for r in results))


def goal_misses(results: list[dict]) -> list[str]:
    misses = []
    for r in results:
        label = f"{r['kernel']} {r['rows']} {r['pattern']} {r['mib_in']} MiB"
        if not r["ok"]:
            misses.append(f"{label}: output differs from the reference")
        if r["mib_in"] >= GOAL_MIN_MIB and r["of_copy"] < GOALS[r["use"]]:
            misses.append(f"{label}: {r['of_copy']:.3f} of copy < {GOALS[r['use']]}")
        if r["speedup"] <= 1.0:
            misses.append(f"{label}: {r['speedup']:.2f}x plain torch ({r['torch_impl']})")
    return misses


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"{r['kernel']} | {r['rows']} | {r['pattern']}" for r in results))
    sizes = sorted({r["mib_in"] for r in results})
    value = {(f"{r['kernel']} | {r['rows']} | {r['pattern']}", r["mib_in"]): r["of_copy"] for r in results}
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(labels) * len(sizes) / 2 + 1.5))
    height = 0.8 / len(sizes)
    for k, size in enumerate(sizes):
        ys = [i + k * height for i in range(len(labels))]
        ax.barh(ys, [value.get((lab, size), 0.0) for lab in labels], height=height, label=f"{size} MiB in")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels, fontsize=7)
    ax.invert_yaxis()
    for goal, style in ((0.85, ":"), (0.90, "--")):
        ax.axvline(goal, color="k", linestyle=style, linewidth=0.8)
    ax.set_xlabel("fraction of device-to-device copy bandwidth (same bytes, same run); goals 0.85 rerange, 0.90 others")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


GROUPS = {  # --only: name -> the cases of one chunk size (tokens)
    "fp8_store_sglang": fp8_store_sglang_cases,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=comma_list(low=1), default=[16, 64, 256], help="input sizes in MiB, comma-separated"
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--iters", type=int, default=60, help="timed runs per measurement (median)")
    parser.add_argument("--plot", action="store_true", help="draw fraction-of-copy bars to OUT/bench_kernels.png")
    parser.add_argument(
        "--sweep", action="store_true", help="first time launch shapes (64 MiB and the largest size) and use the best"
    )
    parser.add_argument(
        "--only",
        type=comma_list(str, noun="group"),
        default=list(GROUPS),
        help=f"case groups to run, comma-separated, of {','.join(GROUPS)}",
    )
    parser.add_argument(
        "--tokens", type=comma_list(low=1), default=[8192], help="chunk tokens of the fp8_store_sglang cases"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the fp8_store_sglang cases on CPU (TRITON_INTERPRET=1), no timing"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.only) - set(GROUPS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown group; expected some of {','.join(GROUPS)}")
    if args.dry_run:
        if not triton.knobs.runtime.interpret:
            sys.exit("--dry-run runs Triton's interpreter on CPU: set TRITON_INTERPRET=1")
        dry_run(args.tokens)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the benchmark times compiled kernels")
    os.makedirs(args.out, exist_ok=True)
    sizes = args.sizes
    info = machine()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    timer = Timer(args.iters, warmup=5)

    per_size = [GROUPS[g] for g in args.only if g != "fp8_store_sglang"]
    per_tokens = [fp8_store_sglang_cases] if "fp8_store_sglang" in args.only else []
    sweep_rows = []
    if args.sweep:
        for mib in sorted({GOAL_MIN_MIB, max(sizes)}) if per_size else []:  # shapes are reused across sizes
            sweep_rows += sweep([case for make in per_size for case in make(mib)], timer)
            torch.cuda.empty_cache()
        for tokens in args.tokens if per_tokens else []:
            sweep_rows += sweep(fp8_store_sglang_cases(tokens), timer)
        apply_best(sweep_rows)
        info["launch_shapes"] = machine()["launch_shapes"]

    results = []
    for make, size in [(m, mib) for mib in sizes for m in per_size] + [(m, t) for t in args.tokens for m in per_tokens]:
        for case in make(size):
            results.append(measure(case, timer))
        torch.cuda.empty_cache()
    print_table(results)
    misses = goal_misses(results)
    print(
        f"goals (>= {GOAL_MIN_MIB} MiB in: of copy >= {GOALS}; every kernel faster than plain torch):",
        "all met" if not misses else f"{len(misses)} missed",
    )
    for m in misses:
        print("  MISSED", m)

    command = "PYTHONPATH=python python " + " ".join(sys.argv)
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(
            {
                "machine": info,
                "command": command,
                "goals": GOALS,
                "results": results,
                "sweep": sweep_rows,
                "missed": misses,
            },
            f,
            indent=1,
        )
    keys = [k for k in results[0] if k != "torch_all_us"]
    with open(os.path.join(args.out, "bench_kernels.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    if args.plot:
        plot(
            results,
            os.path.join(args.out, "bench_kernels.png"),
            f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, {info['date_utc']} UTC",
        )
    print(f"wrote {args.out}/bench_kernels.json, .csv" + (", .png" if args.plot else ""))


if __name__ == "__main__":
    main()
