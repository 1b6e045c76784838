"""The plugin's fused fp8 store against SGLang's own pool write and a device copy (1 x H200, ~2 min).

    # on the GPU machine, after `source scripts/gpu_unpack.sh /tmp/site` (docs/gpu_bundle.md):
    python3 benchmark/bench_kernels.py [--tokens 8192,65536,262144] [--cp 2,4,8] [--repeats 5] [--out DIR]
        [--launch-shapes 8:4,16:8]   # the fused kernel's rows per program : warps, each timed in turn
    # on CPU, correctness only (small chunks):
    TRITON_INTERPRET=1 PYTHONPATH=python:test python benchmark/bench_kernels.py --dry-run --tokens 130

For each chunk of --tokens tokens and each CP size N, rank 0 of N writes one layer's chunk into
SGLang's own `PageInterleaveDSATokenToKVPool` (fp8 KV, one layer, the chunk's plan from SGLang's
`begin_shard_extend`; a chunk without history gathers nothing, so no communicator is built):
- fused: `kernels.store_mla_fp8_owned_and_scratch`'s Triton kernel into the pool's scratch slot
  and shard, as the plugin's `set_mla_kv_buffer` calls it;
- sglang: SGLang's `set_mla_kv_buffer` on that pool (`quantize_k_cache_separate` for the
  scratch, again for the owned rows, and its row stores: the JIT TMA store SGLang runs on SM90
  where it builds, else its Triton fallback; the results file's `sglang_row_store` says which);
- copy: a device-to-device copy whose reads plus writes equal the bytes the fused store reads plus
  writes (it copies half of them: a copy of N bytes moves 2N).
Both writes give the same bytes (checked first, from poisoned scratch and shard). A time is the
median of --iters CUDA-event runs after --warmup calls, L2 flushed before each; the whole table
is measured --repeats times and each cell is the median over repeats with its min-max spread.
"of copy" = copy time / fused time. The goal, >= 0.90 of copy, applies to chunks of >= 64 MiB
of bf16 input (65,536 tokens and up); the run prints how many rows it checked. Raw numbers,
every repeat, the machine and the command go to DIR/bench_kernels.json (default
benchmark/results/).

On the GPU machine SGLang's Python tree comes from the bundle and its quantizer's import chain
loads sgl_kernel's op library, which does not load there: with CUDA the script installs
test/helpers/gpu_stand_ins.py before it imports SGLang (no stand-in runs in the timed code).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from types import SimpleNamespace
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test"))
sys.path.insert(0, os.path.join(REPO, "python"))

from sglang_nsa_cp.kernels.formats import MLA_DIM, MLA_FP8_ROW_BYTES, MLA_NOPE_DIM  # noqa: E402
from provenance import provenance  # noqa: E402
from tables import comma_list, format_table  # noqa: E402

MIB = 1 << 20
PAGE = 64
GOAL_OF_COPY = 0.90
GOAL_MIN_MIB = 64
ROW_BYTES = MLA_FP8_ROW_BYTES  # FlashMLA's fp8 row: 512 codes, 4 fp32 scales, 64 bf16 rope values
LATENT = MLA_DIM


def install_gpu_stand_ins() -> None:
    """sgl_kernel's op library and DeepGEMM do not load on the GPU machine: stand in for them
    before SGLang is imported (test/helpers/gpu_stand_ins.py)."""
    from helpers import gpu_stand_ins

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    gpu_stand_ins.install()


class _NoGather:
    """SGLang's pool builds a PyNccl communicator for history gathers; a chunk without history
    never gathers, and one process cannot hold an N-rank NCCL group."""

    def __init__(self, *args, **kwargs):
        pass


def sglang_pool(tokens: int, n: int, device: torch.device):
    """SGLang's own fp8 `PageInterleaveDSATokenToKVPool` at rank 0 of N, one layer, room for a
    chunk of `tokens` tokens (no cached prefix)."""
    from sglang.srt.mem_cache import page_interleave_pool
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.runtime_context import get_parallel

    pages = -(-tokens // PAGE)
    pages += -pages % n
    # A prefix region of one gather span, as a server's: the chunk's scratch rows start after it
    # (SGLang's row stores skip destination row 0, CUDA-graph padding).
    spec = PageShardSpec(0, n, PAGE, max_prefix_tokens=n * PAGE, chunk_tokens=pages * PAGE)
    group = SimpleNamespace(world_size=n, rank_in_group=0, cpu_group=None, device=device)
    page_interleave_pool.PyNcclCommunicator = _NoGather
    os.environ["SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER"] = "0"  # an NCCL window; no NCCL here
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)  # no server here
    return page_interleave_pool.PageInterleaveDSATokenToKVPool(
        size=(pages // n + 1) * PAGE, page_size=PAGE, kv_lora_rank=MLA_NOPE_DIM, dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=64, layer_num=1, device=device, index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=ROW_BYTES, shard_spec=spec, shard_group=group,
    )  # fmt: skip


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8:4,16:8' -> [(8, 4), (16, 8)]: the fused kernel's rows per program and warps (powers of 2)."""
    shapes = []
    for item in text.split(","):
        rows, _, warps = item.partition(":")
        if not (rows.isdigit() and warps.isdigit()) or any(v < 1 or v & (v - 1) for v in (int(rows), int(warps))):
            raise argparse.ArgumentTypeError(f"{item!r}: expected ROWS:WARPS, powers of 2 (e.g. 8:4)")
        shapes.append((int(rows), int(warps)))
    return shapes


def use_shape(shape: tuple[int, int]) -> None:
    from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as fused

    fused.FP8_ROWS_PER_PROGRAM, fused.FP8_NUM_WARPS = shape


def chunk_case(tokens: int, n: int, device: torch.device) -> dict:
    """The pool, one request's chunk in pages of random order (never SGLang's first N padding
    pages), its plan, and the fused and SGLang writes of it."""
    from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as fused

    pool = sglang_pool(tokens, n, device)
    pages = pool.shard_spec.chunk_tokens // PAGE
    order = torch.randperm(pages, device=device) + n
    slots = (order[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)[:tokens].contiguous()
    req_to_token = slots.to(torch.int32)[None, :]
    pool.begin_shard_extend(req_to_token, torch.zeros(1, dtype=torch.int64, device=device), [0], [tokens])
    # As DeepSeek's attention passes them: k_nope a [T, 1, 512] tensor, k_rope a slice of the latent.
    latent = torch.randn(tokens, 1, LATENT, device=device) * torch.exp(torch.randn(tokens, 1, 1, device=device))
    latent = latent.to(torch.bfloat16)
    k_nope, k_rope = latent[..., :MLA_NOPE_DIM].contiguous(), latent[..., MLA_NOPE_DIM:]
    layer = SimpleNamespace(layer_id=0)
    scratch = pool._slots[0].tensors["kv"].view(-1, ROW_BYTES)
    shard = pool.kv_buffer[0].view(-1, ROW_BYTES)
    scratch_rows = pool._translate_loc_cached(slots)  # SGLang's per-batch plan, as the plugin reads it
    owned = int((slots // PAGE % n == 0).sum())

    def run_fused():
        fused.store_mla_fp8_owned_and_scratch_triton(scratch, scratch_rows, shard, slots, k_nope, k_rope, 0, n, PAGE)

    def run_sglang():
        pool.set_mla_kv_buffer(layer, slots, k_nope, k_rope)

    def same_bytes() -> bool:
        outs = []
        for write in (run_sglang, run_fused):
            scratch.view(torch.uint8).fill_(0xAB)
            shard.view(torch.uint8).fill_(0xAB)
            write()
            outs.append((scratch.view(torch.uint8).clone(), shard.view(torch.uint8).clone()))
        (s1, d1), (s2, d2) = outs
        return torch.equal(s1, s2) and torch.equal(d1, d2) and bool((d1 != 0xAB).any())

    return dict(
        tokens=tokens,
        cp=n,
        mib_in=tokens * LATENT * 2 / MIB,
        moved_bytes=tokens * (LATENT * 2 + ROW_BYTES) + owned * ROW_BYTES,
        fused=run_fused,
        sglang=run_sglang,
        same_bytes=same_bytes,
    )


class Timer:
    """Median CUDA-event time of one call after warm-up, L2 flushed before each timed run."""

    def __init__(self, iters: int, warmup: int, device: torch.device):
        self.iters, self.warmup = iters, warmup
        # Flushed by reading, not writing: dirty lines would be written back inside the timed region.
        self.flush = torch.ones(64 * MIB, dtype=torch.int64, device=device)

    def us(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)
        ]
        for start, end in events:
            self.flush.amax()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in events)

    def copy_us(self, nbytes: int, device: torch.device) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return self.us(lambda: dst.copy_(src))


def measure(case: dict, timer: Timer, device: torch.device) -> dict:
    fused_us, sglang_us = timer.us(case["fused"]), timer.us(case["sglang"])
    copy_us = timer.copy_us(case["moved_bytes"] // 2, device)  # the same traffic as the fused store
    return dict(fused_us=fused_us, sglang_us=sglang_us, copy_us=copy_us, of_copy=copy_us / fused_us,
                speedup=sglang_us / fused_us)  # fmt: skip


def summarize(tokens: int, n: int, shape: tuple[int, int], case: dict, repeats: list[dict]) -> dict:
    row = dict(tokens=tokens, cp=n, launch_shape=list(shape), mib_in=case["mib_in"], moved_bytes=case["moved_bytes"],
               ok=case["ok"][shape])  # fmt: skip
    for key in ("fused_us", "sglang_us", "copy_us", "of_copy", "speedup"):
        values = [r[key] for r in repeats]
        row[key] = statistics.median(values)
        row[key + "_range"] = [min(values), max(values)]
    row["gbps"] = case["moved_bytes"] / row["fused_us"] / 1e3
    row["repeats"] = repeats
    return row


def goal_misses(rows: list[dict]) -> tuple[int, list[str]]:
    """(rows the goal applies to, what each missed)."""
    checked, misses = 0, []
    for r in rows:
        label = f"{r['tokens']} tokens, CP {r['cp']}, launch {r['launch_shape'][0]}:{r['launch_shape'][1]}"
        if not r["ok"]:
            misses.append(f"{label}: the fused store's bytes differ from SGLang's pool write")
        if r["speedup"] <= 1.0:
            misses.append(f"{label}: {r['speedup']:.2f}x SGLang's pool write")
        if r["mib_in"] >= GOAL_MIN_MIB:
            checked += 1
            if r["of_copy"] < GOAL_OF_COPY:
                lo, hi = r["of_copy_range"]
                misses.append(f"{label}: {r['of_copy']:.3f} of copy (repeats {lo:.3f}-{hi:.3f}) < {GOAL_OF_COPY}")
    return checked, misses


def print_table(rows: list[dict]) -> None:
    head = ["tokens", "CP", "launch", "MiB in", "fused us", "GB/s", "of copy", "(min-max)", "sglang us", "speedup", "(min-max)",
            "ok"]  # fmt: skip
    body = [[r["tokens"], r["cp"], "{}:{}".format(*r["launch_shape"]), f"{r['mib_in']:.0f}", f"{r['fused_us']:.1f}", f"{r['gbps']:.0f}",
             f"{r['of_copy']:.3f}", "{:.3f}-{:.3f}".format(*r["of_copy_range"]), f"{r['sglang_us']:.1f}",
             f"{r['speedup']:.1f}x", "{:.1f}-{:.1f}".format(*r["speedup_range"]), "ok" if r["ok"] else "BAD"]
            for r in rows]  # fmt: skip
    print(format_table([head, *body], align="r" * 11 + "l", header_rule=True))
    for shape in sorted({tuple(r["launch_shape"]) for r in rows}):
        geo = math.exp(statistics.fmean(math.log(r["of_copy"]) for r in rows if tuple(r["launch_shape"]) == shape))
        print(f"geometric mean, launch {shape[0]}:{shape[1]}: {geo:.3f} of copy")


def sglang_row_store() -> str:
    """Which row store SGLang's pool write runs here: its JIT TMA bulk store (what it runs on SM90,
    built by its JIT on first use) or, where that does not build, its Triton fallback."""
    from sglang.kernels.ops.kvcache.set_mla_kv_buffer import can_use_set_mla_kv_buffer
    from sglang.kernels.jit.utils import is_arch_support_pdl

    nope_bytes, rope_bytes = ROW_BYTES - 64 * 2, 64 * 2  # the fp8 pool's quantized parts, as SGLang splits them
    if is_arch_support_pdl() and can_use_set_mla_kv_buffer(nope_bytes, rope_bytes):
        return "jit"
    return "triton fallback (SGLang's JIT row store did not build here; its warning is in the log)"


def machine() -> dict:
    """The results file's provenance (commit, dirty flag, machine, command), the kernel's launch
    shape and which row store SGLang's write runs."""
    from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as fused

    model = {"rows": "FlashMLA fp8 rows (656 B) and index K + scale (132 B) per token; no model layers"}
    stand_ins = ["sgl_kernel's op library (cannot load on the GPU machine): test/helpers/gpu_stand_ins.py"]
    return {**provenance(model, stand_ins), "default_launch_shape": [fused.FP8_ROWS_PER_PROGRAM, fused.FP8_NUM_WARPS],
            "sglang_row_store": sglang_row_store()}  # fmt: skip


def dry_run(tokens: list[int], cp_sizes: list[int], shapes: list[tuple[int, int]] | None) -> None:
    """Both writes on CPU (Triton's interpreter, SGLang's interpreted quantizer): same bytes?"""
    bad = []
    for shape in shapes or [None]:
        if shape:
            use_shape(shape)
        for t in tokens:
            for n in cp_sizes:
                ok = chunk_case(t, n, torch.device("cpu"))["same_bytes"]()
                label = f"{t} tokens, CP {n}" + (f", launch {shape[0]}:{shape[1]}" if shape else "")
                print(f"dry run: {label}: {'same bytes' if ok else 'BYTES DIFFER'}", flush=True)
                bad += [] if ok else [label]
    sys.exit(f"{len(bad)} cases differ: {bad}" if bad else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=comma_list(low=1), default=[8192, 65536, 262144], help="chunk sizes")
    parser.add_argument("--cp", type=comma_list(low=2), default=[2, 4, 8], help="CP sizes N (rank 0 of N writes)")
    parser.add_argument("--iters", type=int, default=100, help="timed runs per measurement (median)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before each measurement")
    parser.add_argument("--repeats", type=int, default=5, help="times the whole table is measured")
    parser.add_argument("--launch-shapes", type=parse_shapes, help="ROWS:WARPS,... of the fused kernel, each timed "
                        "(default: the kernel's own)")  # fmt: skip
    parser.add_argument("--out", default=os.path.join(REPO, "benchmark", "results"))
    parser.add_argument("--dry-run", action="store_true", help="check both writes' bytes on CPU, time nothing")
    args = parser.parse_args()
    if args.dry_run:
        import triton

        if not triton.knobs.runtime.interpret:
            sys.exit("--dry-run runs Triton's interpreter on CPU: set TRITON_INTERPRET=1 before starting")
        dry_run(args.tokens, args.cp, args.launch_shapes)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py times CUDA kernels: run it on a GPU (or --dry-run on CPU)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the benchmark times compiled kernels")
    install_gpu_stand_ins()
    device = torch.device("cuda")
    info = machine()
    print(json.dumps(info), flush=True)
    shapes = args.launch_shapes or [tuple(info["default_launch_shape"])]
    timer = Timer(args.iters, args.warmup, device)
    cases = {}
    for t in args.tokens:
        for n in args.cp:
            case = chunk_case(t, n, device)
            case["ok"] = {}
            for shape in shapes:  # every launch shape writes SGLang's bytes
                use_shape(shape)
                case["ok"][shape] = case["same_bytes"]()
            cases[t, n] = case
    repeats = {(t, n, shape): [] for t, n in cases for shape in shapes}
    for r in range(args.repeats):  # whole-table repeats: a slow first pass shows as spread, not as the result
        for t, n, shape in repeats:
            use_shape(shape)
            repeats[t, n, shape].append(measure(cases[t, n], timer, device))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    rows = [summarize(t, n, shape, cases[t, n], reps) for (t, n, shape), reps in repeats.items()]
    print_table(rows)
    checked, misses = goal_misses(rows)
    print(f"goal: >= {GOAL_OF_COPY} of copy from {GOAL_MIN_MIB} MiB in ({checked} rows checked); same bytes as "
          f"SGLang's pool write and faster, every row: {'all met' if not misses else f'{len(misses)} missed'}")  # fmt: skip
    for m in misses:
        print("  MISSED", m)
    if checked == 0:
        print(f"  (no row reaches {GOAL_MIN_MIB} MiB: pass --tokens 65536 or more to check the goal)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_kernels.json")
    with open(path, "w") as f:
        json.dump({"provenance": info, "goal_of_copy": GOAL_OF_COPY,
                   "goal_min_mib": GOAL_MIN_MIB, "goal_rows_checked": checked, "missed": misses, "results": rows},
                  f, indent=1)  # fmt: skip
    print(f"wrote {path}")
    sys.exit(1 if any(not r["ok"] for r in rows) else 0)  # a timing miss is reported, a byte difference fails


if __name__ == "__main__":
    main()
