"""End-to-end prefill of the reference model: one GPU, replicated CP, shared-KV CP with and
without one-layer-ahead prefetch, all in one run on the same machine.

    PYTHONPATH=python python benchmark/bench_prefill.py --cp 2 [--out DIR] [--plot]
    PYTHONPATH=python python benchmark/bench_prefill.py --device cpu --config tiny --cp 4 \\
        --cold 300,500 --hit 256:64 --repeats 1 --sweep-mib 1      # CPU smoke run over gloo

Cases: cold prompts (`--cold`, new requests, no cached history: current reuse) and prefix hits
(`--hit PREFIX:NEW`, a cached prefix forked from a warm request plus a new chunk). For each case
and path it reports the median time per prefill, per-layer times (CUDA events at each layer's KV
step), the exposed materialize time (the main stream's wait for history, CUDA events), persistent
KV and scratch bytes per rank, and last-token logits against the one-GPU path. Then, for the
materialize step alone: its bandwidth next to a raw all-gather of the same bytes in the same run,
for the prefix-hit cases and a sweep of sizes (`--sweep-mib`). Raw numbers: DIR/bench_prefill.json;
`--plot`: DIR/bench_prefill_timeline.png (per-layer times of the prefix-hit case).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from sglang_nsa_cp.cli import comma_list, format_table, int_pair, save_plot
from sglang_nsa_cp.comm import TrafficCounter, all_gather_rows, run_ranks
from sglang_nsa_cp.layout import OwnerClassedAllocator, RequestPageTable
from sglang_nsa_cp.oracle import rel_err
from sglang_nsa_cp.reference import DSAModel, get_config
from sglang_nsa_cp.reference.cp import ReplicatedCPKV, SharedCPKV, prefill_cp
from sglang_nsa_cp.shared_kv import HistoryPrefetcher, KVStore, build_dense_plan

PATHS = ("one_gpu", "replicated", "shared", "shared_prefetch")
MIB = 1 << 20


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _LayerClock:
    """Wraps a KV context: an event as each layer hands over its KV gives per-layer times."""

    def __init__(self, inner, device):
        self.inner, self.device, self.marks = inner, device, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_layer(self, layer_id, *fresh):
        self.marks.append(self._mark())
        self.inner.begin_layer(layer_id, *fresh)

    def finish_layer(self, layer_id):
        return self.inner.finish_layer(layer_id)

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def layer_ms(self, end) -> list[float]:
        marks = self.marks + [end]
        if self.device.type != "cuda":
            return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _run_path(model, path, case, args, rank, world, group, device):
    """Time one path on one case; returns its numbers (identical structure on every rank)."""
    cfg, page = model.config, args.page_size
    prefix, new = case["prefix"], case["new"]
    # The same logical pool for every path (sized by --cp), so KV bytes compare like for like.
    num_pages = 2 * (-(-(prefix + new) // page)) + 4 * args.cp
    num_pages = -(-num_pages // args.cp) * args.cp
    table = RequestPageTable(OwnerClassedAllocator(num_pages, world), page)
    kw = dict(
        num_layers=cfg.num_layers,
        num_pages=num_pages,
        page_size=page,
        latent_dim=cfg.latent_dim,
        latent_dtype=model.embed_tokens.weight.dtype,
        device=device,
    )
    shared = path.startswith("shared")
    store = KVStore(cp_size=world, rank=rank, **kw) if shared else KVStore.replicated(**kw)
    split = ("page_zigzag" if shared else "zigzag") if args.split == "zigzag" else "interleave"
    g = torch.Generator().manual_seed(7)
    if prefix:  # the cached prefix: prefilled once, untimed
        ids = torch.randint(0, cfg.vocab_size, (prefix,), generator=g).to(device)
        plan, batch = table.schedule(["base"], [prefix], split)
        ctx = SharedCPKV(store, plan, batch, rank, group) if shared else ReplicatedCPKV(store, plan, batch, rank, group)
        prefill_cp(model, ids, ctx, narrow_tail=shared)
    new_ids = torch.randint(0, cfg.vocab_size, (new,), generator=g).to(device)

    times, layer_ms, exposed, logits = [], [], [], None
    for rep in range(args.repeats + 1):  # the first run warms up
        key = f"req{rep}"
        if prefix:
            table.fork(key, "base", prefix)
        plan, batch = table.schedule([key], [new], split)
        counter, timings = TrafficCounter(), []
        if shared:
            ctx = SharedCPKV(
                store, plan, batch, rank, group, counter, prefetch=path == "shared_prefetch", timings=timings
            )
        else:
            ctx = ReplicatedCPKV(store, plan, batch, rank, group, counter)
        clock = _LayerClock(ctx, device)
        _sync(device)
        dist.barrier(group)
        start = time.perf_counter()
        out = prefill_cp(model, new_ids, clock, narrow_tail=shared)
        end = clock._mark()
        _sync(device)
        elapsed = time.perf_counter() - start
        table.release(key)
        if rep == 0:
            continue
        times.append(elapsed * 1e3)
        layer_ms.append(clock.layer_ms(end))
        exposed.append(sum(a.elapsed_time(b) for _, a, b in timings) if timings else 0.0)
        logits = out.float().cpu()
        traffic = counter.as_dict()
        scratch = ctx.prefetcher.scratch_bytes() if shared and ctx.prefetcher is not None else 0
    return {
        "ms": statistics.median(times),
        "ms_all": times,
        "layer_ms": [statistics.median(col) for col in zip(*layer_ms)],
        "exposed_materialize_ms": statistics.median(exposed),
        "kv_bytes": store.nbytes(),
        "scratch_bytes": scratch,
        "bytes_moved": traffic,
        "logits": logits,
    }


def _time_ms(fn, device, repeats):
    """Mean time of `fn`, launched back to back between two events so the host runs ahead and
    the figure is the device's, not the Python launch path's (on CPU: wall time)."""
    fn()
    _sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeats
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / repeats


def materialize_vs_allgather(history_tokens, args, rank, world, group, device, dtype, latent_dim, fp8_latent=False):
    """Materialize of one layer's history (latent + index) against raw all-gathers of its bytes;
    `fp8_latent`: the store holds FlashMLA's 656-byte fp8 rows."""
    page = args.page_size
    num_pages = -(-(-(-history_tokens // page) + 1) // world) * world
    table = RequestPageTable(OwnerClassedAllocator(num_pages, world), page)
    store = KVStore(
        num_layers=1,
        num_pages=num_pages,
        page_size=page,
        cp_size=world,
        rank=rank,
        latent_dim=latent_dim,
        latent_dtype=dtype,
        fp8_latent=fp8_latent,
        device=device,
    )
    table.schedule(["h"], [history_tokens], "interleave")
    _, batch = table.schedule(["h"], [1], "interleave")
    plan = build_dense_plan(
        batch.page_table().to(device), batch.prefix_lens, batch.seq_lens,
        page_size=page, cp_size=world, rank=rank, num_logical_pages=num_pages,
    )  # fmt: skip
    counter = TrafficCounter()
    pre = HistoryPrefetcher(store, group, enabled=False, counter=counter)

    def materialize():  # one layer's history, as the pool materializes it with prefetch off
        pre.begin(plan)
        pre.acquire(0)

    materialize()
    gathered = sum(v["bytes"] for v in counter.as_dict().values())
    latent_send = store.page_rows(0)[: plan.pages_per_rank].contiguous()
    index_send = store.index[0][: plan.pages_per_rank].contiguous()

    def raw():
        all_gather_rows(latent_send, plan.pages_per_rank, group)
        all_gather_rows(index_send, plan.pages_per_rank, group)

    dist.barrier(group)
    mat_ms = _time_ms(materialize, device, args.bw_repeats)
    dist.barrier(group)
    raw_ms = _time_ms(raw, device, args.bw_repeats)
    return {
        "history_tokens": history_tokens,
        "gathered_bytes": gathered,
        "materialize_ms": mat_ms,
        "allgather_ms": raw_ms,
        "materialize_GBps": gathered / mat_ms / 1e6,
        "allgather_GBps": gathered / raw_ms / 1e6,
        "fraction_of_allgather": raw_ms / mat_ms,
    }


def rank_main(rank, world, group, args):
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = DSAModel(get_config(args.config), seed=0, dtype=dtype, device=device)
    solo = dist.new_group([0])  # the one-GPU path: rank 0 alone, a group of one
    cases = [{"name": f"cold {n}", "prefix": 0, "new": n} for n in args.cold]
    cases += [{"name": f"hit {p}+{n}", "prefix": p, "new": n} for p, n in args.hit]
    results = []
    for case in cases:
        row = {"case": case}
        for path in PATHS:
            if path == "one_gpu":
                if rank == 0:
                    row[path] = _run_path(model, path, case, args, 0, 1, solo, device)
                dist.barrier(group)
            else:
                row[path] = _run_path(model, path, case, args, rank, world, group, device)
        results.append(row)
    bandwidth = [
        materialize_vs_allgather(c["prefix"], args, rank, world, group, device, dtype, model.config.latent_dim)
        for c in cases
        if c["prefix"]
    ]
    row_bytes = model.config.latent_dim * dtype.itemsize + 132
    for mib in args.sweep_mib:
        tokens = int(mib * MIB / row_bytes)
        bandwidth.append(
            materialize_vs_allgather(tokens, args, rank, world, group, device, dtype, model.config.latent_dim)
        )
    return {"results": results, "bandwidth": bandwidth} if rank == 0 else None


def _machine(args) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
    }
    if args.device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def report(out, args) -> dict:
    rows = [
        ["case", "path", "ms", "x replicated", "exposed mat ms", "KV MiB/rank", "scratch MiB", "logit rel err vs 1 GPU"]
    ]
    summary = []
    for row in out["results"]:
        base = row["one_gpu"]["logits"]
        for path in PATHS:
            r = row[path]
            ratio = r["ms"] / row["replicated"]["ms"]
            err = rel_err(r["logits"], base)
            rows.append(
                [
                    row["case"]["name"],
                    path,
                    f"{r['ms']:.1f}",
                    f"{ratio:.3f}",
                    f"{r['exposed_materialize_ms']:.2f}",
                    f"{r['kv_bytes'] / MIB:.1f}",
                    f"{r['scratch_bytes'] / MIB:.1f}",
                    f"{err:.1e}",
                ]
            )
            summary.append(
                {
                    "case": row["case"],
                    "path": path,
                    **{k: v for k, v in r.items() if k != "logits"},
                    "x_replicated": ratio,
                    "logit_rel_err_vs_one_gpu": err,
                }
            )
    print(format_table(rows, align="r"))
    print()
    rows = [
        [
            "history tokens",
            "gathered MiB",
            "materialize ms",
            "all-gather ms",
            "materialize GB/s",
            "all-gather GB/s",
            "of all-gather",
        ]
    ]
    for b in out["bandwidth"]:
        rows.append(
            [
                b["history_tokens"],
                f"{b['gathered_bytes'] / MIB:.1f}",
                f"{b['materialize_ms']:.3f}",
                f"{b['allgather_ms']:.3f}",
                f"{b['materialize_GBps']:.1f}",
                f"{b['allgather_GBps']:.1f}",
                f"{b['fraction_of_allgather']:.2f}",
            ]
        )
    print(format_table(rows, align="r"))
    return {
        "machine": _machine(args),
        "args": {k: v for k, v in vars(args).items()},
        "paths": summary,
        "materialize_bandwidth": out["bandwidth"],
    }


def save_results(raw: dict, out_dir: str, name: str, plot=None) -> None:
    """DIR/NAME.json with the raw numbers (and the machine line printed); DIR/NAME_timeline.png
    from `plot(raw, path)` when given."""
    print(json.dumps(raw["machine"]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if plot is not None:
        plot(raw, os.path.join(out_dir, f"{name}_timeline.png"))


def _plot(raw, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    hits = [p for p in raw["paths"] if p["case"]["prefix"]]
    if not hits:
        return
    name = hits[-1]["case"]["name"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, p in enumerate(q for q in hits if q["case"]["name"] == name):
        layers = p["layer_ms"]
        left = 0.0
        for layer, ms in enumerate(layers):
            ax.barh(i, ms, left=left, color=f"C{layer}", edgecolor="black")
            left += ms
        ax.barh(i, p["exposed_materialize_ms"], left=0, height=0.25, color="red")
    ax.set_yticks(range(len(PATHS)), PATHS)
    ax.set_xlabel("ms (one bar segment per layer; red: exposed materialize)")
    ax.set_title(f"prefill timeline, {name}, {raw['machine'].get('gpus', ['cpu'])[0]}")
    save_plot(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--config", default="glm5-attn")
    p.add_argument("--split", choices=["zigzag", "interleave"], default="zigzag")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--cold", type=comma_list(low=1), default=[16384, 32768, 65536])
    p.add_argument(
        "--hit",
        type=comma_list(int_pair, noun="PREFIX:NEW pair"),
        default=[(61440, 4096)],
        help="PREFIX:NEW,... (PREFIX a multiple of the page size)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bw-repeats", type=int, default=20)
    p.add_argument("--sweep-mib", type=comma_list(float, low=0, noun="number"), default=[16, 64, 256])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.cp:
        sys.exit(f"--cp {args.cp} needs {args.cp} GPUs, this machine has {torch.cuda.device_count()}")
    if any(pref % args.page_size for pref, _ in args.hit):
        sys.exit(f"--hit prefixes must be multiples of --page-size {args.page_size}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    out = run_ranks(rank_main, args.cp, args=(args,), backend=backend, timeout_s=3000)[0]
    raw = report(out, args)
    save_results(raw, args.out, "bench_prefill", _plot if args.plot else None)
    return raw


if __name__ == "__main__":
    main()
