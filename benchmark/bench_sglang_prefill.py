"""SGLang 0.5.23's own DSA prefill on GPUs: replicated CP (today) against the flag's shared KV
(SGLang's page-interleaved pool, the plugin's subclass), side by side in one run; optionally
SGLang's own sharded pool class too.

    source scripts/gpu_unpack.sh            # the bundle of docs/gpu_bundle.md (the GPU machine)
    PYTHONPATH=$PYTHONPATH:test python benchmark/bench_sglang_prefill.py --cp 2 --out DIR [--plot]
    ... the same with --kv-cache-dtype fp8_e4m3     # fp8 KV (656-byte FlashMLA rows) on every path

Paths (`--paths`, names as in `sglang_gpu_harness.POOLS`): `replicated` (SGLang's
DSATokenToKVPool, every rank stores every page), `shared` (what --enable-nsa-prefill-cp-shared-kv
runs: SGLang's `PageInterleaveDSATokenToKVPool` replaced by the plugin's subclass, scratch of one
context plus one chunk) and `sglang_pool` (a benchmark-only comparison: SGLang's own class built
directly, its Blackwell-only backend validator bypassed, its default scratch of eight contexts plus
one chunk, the plugin's runtime hooks off). Request pages come from SGLang's owner-rotating
allocator on every path. The sharded pools gather history one layer ahead with SGLang's real
PyNccl communicator; `--share-gpu` puts every rank on GPU 0, each its own NCCL host (NCCL's socket
transport on loopback): a check that the paths run and agree, its times mean nothing.

The model is SGLang's `GlmMoeDsaForCausalLM` with GLM-5's attention and dense-MLP dimensions,
`--layers` layers, every one dense, and random weights (test/helpers/sglang_gpu_harness.py);
attention is FlashMLA's sparse prefill kernel; the other stand-ins are in
docs/sglang_gpu_forward.md. Cases, as SGLang's scheduler runs them: cold prompts (`--cold`)
prefilled in chunks of `--chunk` tokens (every chunk after the first has history), and prefix hits
(`--hit PREFIX:NEW`: a request that shares a cached PREFIX with an earlier one, prefilled untimed,
and adds NEW tokens). For every case and path it reports the time per chunk, per-layer times (CUDA
events at each decoder layer), the exposed history wait (CUDA events around the compute stream's
wait for the layer-ahead gather), KV and scratch bytes per rank, and whether the last-token
logits equal the replicated path's bit for bit. Raw numbers, with the model as it ran:
DIR/bench_sglang_prefill.json (bench_sglang_prefill_fp8.json with fp8 KV; `_share_gpu` added
with --share-gpu); `--plot`: the timeline png of the same name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))

from helpers import sglang_gpu_harness as G  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402
from tables import comma_list, format_table, int_pair, save_plot, save_results  # noqa: E402

PATHS = tuple(G.POOLS)  # replicated, shared, sglang_pool
MIB = 1 << 20


class _LayerClock:
    """CUDA events as each decoder layer starts and as the final norm starts."""

    def __init__(self, model):
        self.marks: list[torch.cuda.Event] = []
        modules = list(model.model.layers) + [model.model.norm]
        for m in modules:
            m.register_forward_pre_hook(lambda *_: self.marks.append(self._event()))

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> list[float]:
        marks, self.marks = self.marks, []
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _engine(sa, mc, model, path, world, pages_per_rank, max_len, chunk):
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    setattr(sa, ATTR, path == "shared")  # the plugin's runtime hooks (tail gather) read this decision
    engine = G.GpuEngine(sa, mc, model, path, pages_per_rank, world, max_len=max_len, chunk_tokens=chunk)
    engine.waits = G.time_history_waits(engine.pool) if path != "replicated" else None
    return engine


def _chunks(case, chunk):
    """[(request index, new tokens)] batches of one case; the timed ones are flagged."""
    prefix, new = case["prefix"], case["new"]
    batches = [([(0, min(chunk, prefix - s))], False) for s in range(0, prefix, chunk)]  # the cached prefix
    batches += [([(1 if prefix else 0, min(chunk, new - s))], True) for s in range(0, new, chunk)]
    return batches


def _exposed_per_layer(waits, layers: int) -> list[float]:
    per_layer = [0.0] * layers
    for layer_id, start, end in waits:
        per_layer[layer_id] += start.elapsed_time(end)
    return per_layer


def _run_case(engine, clock, case, args, tokens):
    times, layers, exposed, logits = [], [], [], []
    for batch, timed in _chunks(case, args.chunk):
        if case["prefix"] and batch[0][0] == 1 and not engine.requests.lens.get(1):
            engine.requests.fork(1, source=0, length=case["prefix"])
        fb = engine.forward_batch(batch, tokens)
        if engine.waits is not None:
            engine.waits.clear()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        out = engine.run(fb)  # returns CPU logits: synchronises
        elapsed = (time.perf_counter() - start) * 1e3
        layer_ms = clock.take()
        if not timed:
            continue
        times.append(elapsed)
        layers.append(layer_ms)
        exposed.append(
            _exposed_per_layer(engine.waits, len(layer_ms)) if engine.waits is not None else [0.0] * len(layer_ms)
        )
        logits.append(out)
    return times, layers, exposed, logits


def rank_main(rank, world, group, args, model_path):
    from sglang.srt.plugins import load_plugins

    sa = G.setup_process(rank, world, model_path, world, args.kv_cache_dtype)
    load_plugins()  # the plugin's entry point, as every SGLang process does
    mc, model = G.build_model(sa)
    clock = _LayerClock(model)
    cases = [{"name": f"cold {n // 1024}k", "prefix": 0, "new": n} for n in args.cold]
    cases += [{"name": f"hit {p // 1024}k+{n // 1024}k", "prefix": p, "new": n} for p, n in args.hit]
    g = torch.Generator().manual_seed(11)
    max_len = max(c["prefix"] + c["new"] for c in cases) + G.PAGE
    tokens = {i: torch.randint(2, mc.hf_config.vocab_size, (max_len,), generator=g) for i in range(2)}
    pages_per_rank = -(-max_len // G.PAGE) // world + 16  # a case's pages, owners rotating, with room
    warm_up = {"name": "warm-up", "prefix": args.chunk // 2, "new": args.chunk // 2}  # compiles every kernel, untimed
    gather = {}
    for path in args.paths:
        engine = _engine(sa, mc, model, path, world, pages_per_rank, max_len, args.chunk)
        _run_case(engine, clock, warm_up, args, tokens)
        gather[path] = G.pool_info(engine.pool)
        del engine
    results = []
    for case in cases:
        row = {"case": case}
        for rep in range(args.repeats):
            for path in args.paths if rep % 2 == 0 else reversed(args.paths):  # alternate the order: drift cancels
                engine = _engine(sa, mc, model, path, world, pages_per_rank, max_len, args.chunk)
                times, layers, exposed, logits = _run_case(engine, clock, case, args, tokens)
                held, used = G.pages_held(engine)
                r = row.setdefault(path, {"ms": [], "layer_ms": [], "exposed_ms": []})
                r["ms"].append(times)
                r["layer_ms"].append(layers)
                r["exposed_ms"].append(exposed)
                r.update(logits=logits, pages_held=held, pages_used=used, pool_alloc_bytes=engine.pool_alloc_bytes,
                         scratch_bytes=engine.scratch_bytes)  # fmt: skip
                del engine
                torch.cuda.empty_cache()
        results.append(row)
    profiles = (
        _profile(sa, mc, model, world, pages_per_rank, max_len, clock, cases[-1], args, tokens) if args.profile else {}
    )
    from helpers import gpu_stand_ins

    with open(os.path.join(model_path, "config.json")) as f:
        written = json.load(f)
    stand_ins = G.STAND_INS + ([G.SHARED_GPU_NOTE] if G.shares_gpu(world) else [])
    model_cfg = G.model_as_run(written, sa, stand_ins)
    return (
        {
            "results": results,
            "profiles": profiles,
            "gather": gather,
            "model": model_cfg,
            "stand_ins": gpu_stand_ins.report(),
        }  # fmt: skip
        if rank == 0
        else None
    )


def _profile(sa, mc, model, world, pages_per_rank, max_len, clock, case, args, tokens):
    """torch.profiler over the timed chunks of `case`, per path: where host time goes."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for path in [p for p in ("replicated", "shared") if p in args.paths]:
        engine = _engine(sa, mc, model, path, world, pages_per_rank, max_len, args.chunk)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            _run_case(engine, clock, case, args, tokens)
        tables[path] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        # where the host blocks: every copy and synchronisation, by the Python lines that issued it
        syncs = [
            e
            for e in prof.key_averages(group_by_stack_n=6)
            if e.key in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")
        ]
        tables[path + " host waits"] = "\n".join(
            f"{e.key} x{e.count} {e.self_cpu_time_total / 1e3:.1f} ms\n    " + "\n    ".join(e.stack[:6])
            for e in sorted(syncs, key=lambda e: -e.count)[:25]
        )
        del engine
        torch.cuda.empty_cache()
    return tables


# ---- report --------------------------------------------------------------------------------------


def _median_chunks(runs):
    """Per chunk, the median over repeats; runs: [repeat][chunk] of ms."""
    return [statistics.median(col) for col in zip(*runs)]


def _summarize(out, args):
    rows = []
    for row in out["results"]:
        base = row["replicated"]
        for path in args.paths:
            r = row[path]
            chunk_ms = _median_chunks(r["ms"])
            layer_ms = [statistics.median(v) for v in zip(*[ms for rep in r["layer_ms"] for ms in rep])]
            exposed = [statistics.median(v) for v in zip(*[e for rep in r["exposed_ms"] for e in rep])]
            identical = all(torch.equal(a, b) for a, b in zip(r["logits"], base["logits"]))
            max_diff = max(float((a - b).abs().max()) for a, b in zip(r["logits"], base["logits"]))
            outside = [t - sum(ms) for rep_t, rep_l in zip(r["ms"], r["layer_ms"]) for t, ms in zip(rep_t, rep_l)]
            rows.append({
                "case": row["case"]["name"], "path": path, "chunks": len(chunk_ms),
                "ms": sum(chunk_ms), "chunk_ms": chunk_ms, "outside_layers_ms_per_chunk": statistics.median(outside),
                "x_replicated": sum(chunk_ms) / sum(_median_chunks(base["ms"])),
                "layer_ms": layer_ms, "exposed_ms_per_layer": exposed,
                "exposed_share": sum(exposed) / max(sum(layer_ms), 1e-9),
                "pages_held": r["pages_held"], "pages_used": r["pages_used"],
                "held_share": r["pages_held"] / r["pages_used"],
                "pool_alloc_bytes": r["pool_alloc_bytes"], "scratch_bytes": r["scratch_bytes"],
                "kv_bytes": r["pool_alloc_bytes"] - r["scratch_bytes"],
                "logits_identical_to_replicated": identical, "max_logit_diff_vs_replicated": max_diff,
            })  # fmt: skip
    return rows


def report(out, args, machine, config) -> dict:
    summary = _summarize(out, args)
    head = ["case", "path", "chunks", "ms", "x repl.", "ms/layer", "outside layers ms/chunk", "exposed ms/layer",
            "exposed %", "KV pages held", "KV MiB/rank", "scratch MiB", "logits = repl."]  # fmt: skip
    table = [head] + [
        [s["case"], s["path"], s["chunks"], f"{s['ms']:.1f}", f"{s['x_replicated']:.3f}",
         f"{statistics.mean(s['layer_ms']):.2f}", f"{s['outside_layers_ms_per_chunk']:.2f}", f"{statistics.mean(s['exposed_ms_per_layer']):.3f}",
         f"{100 * s['exposed_share']:.1f}", f"{s['pages_held']}/{s['pages_used']}", f"{s['kv_bytes'] / MIB:.0f}",
         f"{s['scratch_bytes'] / MIB:.0f}",
         "yes" if s["logits_identical_to_replicated"] else f"no ({s['max_logit_diff_vs_replicated']:.2e})"]
        for s in summary
    ]  # fmt: skip
    print(format_table(table, align="r"))
    geomean = {
        path: math.exp(statistics.mean(math.log(s["x_replicated"]) for s in summary if s["path"] == path))
        for path in args.paths
    }
    print("geomean x replicated: " + ", ".join(f"{p} {x:.3f}" for p, x in geomean.items()))
    for path, info in out["gather"].items():
        print(f"{path}: {info}")
    print()
    print(out["stand_ins"])
    for path, table in out["profiles"].items():
        print(
            f"\nprofile of {path} ({out['results'][-1]['case']['name']}, every chunk incl. the untimed prefix)\n{table}"
        )
    return {"machine": machine, "args": vars(args), "config": config, "model": out["model"],
            "pools": {p: G.POOLS[p] for p in args.paths}, "gather": out["gather"],
            "timings_meaningful": not args.share_gpu, "paths": summary, "geomean_x_replicated": geomean,
            "stand_ins": out["stand_ins"]}  # fmt: skip


def _commit() -> str:
    import subprocess

    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout here)"


def _machine() -> dict:
    import triton

    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__, "triton": triton.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "python": platform.python_version(),
    }  # fmt: skip


def _plot(raw, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hits = [p for p in raw["paths"] if p["case"].startswith("hit")] or raw["paths"]
    name = hits[-1]["case"]
    rows = [p for p in hits if p["case"] == name]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for i, p in enumerate(rows):
        left = 0.0
        for layer, ms in enumerate(p["layer_ms"]):
            ax.barh(i, ms, left=left, color=f"C{layer % 10}", edgecolor="black")
            ax.barh(i, p["exposed_ms_per_layer"][layer], left=left, height=0.25, color="red")
            left += ms
    ax.set_yticks(range(len(rows)), [p["path"] for p in rows])
    ax.set_xlabel("ms (one segment per layer; red: the stream waiting for that layer's history)")
    ax.set_title(
        f"SGLang DSA prefill, {name}, median layer times, {raw['machine']['gpus'][0]} x{len(raw['machine']['gpus'])}"
    )
    save_plot(fig, path)


def _path_list(text: str) -> list[str]:
    paths = [p for p in text.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or "replicated" not in paths:
        raise argparse.ArgumentTypeError(
            f"--paths takes names from {', '.join(PATHS)}, replicated among them (the baseline); got {text!r}"
        )
    return [p for p in PATHS if p in paths]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size (a multiple of 64)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=("bfloat16", "fp8_e4m3"),
        default="bfloat16",
        help="fp8_e4m3: SGLang's fp8 pool (656-byte FlashMLA rows) on every path",
    )
    p.add_argument("--paths", type=_path_list, default=list(PATHS), help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--cold", type=comma_list(low=1), default=[32768, 65536, 131072])
    p.add_argument(
        "--hit",
        type=comma_list(int_pair, noun="PREFIX:NEW pair"),
        default=[(61440, 4096), (126976, 4096)],
        help="PREFIX:NEW,... (PREFIX a multiple of 64)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--plot", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="torch.profiler tables of the last case, replicated and shared"
    )
    p.add_argument(
        "--share-gpu",
        action="store_true",
        help="every rank on GPU 0, NCCL over sockets (one NCCL_HOSTID per rank): checks only, times mean nothing",
    )
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.cp and not args.share_gpu:
        sys.exit(
            f"--cp {args.cp} needs {args.cp} GPUs for timings; this machine has {torch.cuda.device_count()} "
            "(--share-gpu runs the paths on one GPU, NCCL over sockets, for checks only)"
        )
    if args.share_gpu and torch.cuda.device_count() >= args.cp:
        sys.exit(f"--share-gpu is for machines with fewer than --cp {args.cp} GPUs; drop it here")
    if args.chunk % G.PAGE or any(pref % G.PAGE for pref, _ in args.hit):
        sys.exit(f"--chunk and the --hit prefixes must be multiples of the page size {G.PAGE} (KV sharding)")
    machine = _machine()
    print(json.dumps(machine))  # STYLE 10: the machine first
    config = G.glm5_config(args.layers)
    model_path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), config)
    out = run_ranks(rank_main, args.cp, args=(args, model_path), backend="nccl", timeout_s=3000)[0]
    raw = report(out, args, machine, config)
    name = "bench_sglang_prefill" + ("_fp8" if args.kv_cache_dtype == "fp8_e4m3" else "")
    name += "_share_gpu" if args.share_gpu else ""
    save_results(raw, args.out, name, _plot if args.plot else None)
    return raw


if __name__ == "__main__":
    main()
