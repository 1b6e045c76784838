"""The owned-page PD transfer of one long request over Mooncake (TCP on loopback, CPU memory):
Mooncake batch entries, bytes and time per prefill rank, with the decode's pages in request order
or grouped by owner, next to replicated CP's single sender (a few minutes on 2 busy cores).

    PYTHONPATH=python .venv/bin/python benchmark/bench_pd_transfer.py [--tokens 131072] [--layers 4]
        [--latent-bytes 656] [--cp 2,4,8] [--repeats 3] [--out benchmark/results]

What each prefill rank sends is what SGLang 0.5.23's Mooncake path sends with the plugin: its
owned pages and their request positions (`filter_kv_indices_for_shard_rank`: logical page p on
rank p % N at local page p // N), destinations `dst[positions]`, runs coalesced by SGLang's
`group_concurrent_contiguous`, one entry per run, layer and kind (MLA latent, index-K), written
with `batch_transfer_sync_write` in batches of at most 1024 entries (Mooncake's TCP transport
refuses more than about 2048 in flight per peer). Rows: GLM-5's (`--latent-bytes` 656 for FlashMLA
fp8, 1152 for bf16; index-K 132 B per token), 64-token pages, a reduced layer count (entries and
bytes scale linearly with layers; GLM-5 has 78).

Senders:
- `replicated`: today's default for a replicated-CP prefill, CP rank 0 sends every page (to a
  decode's pages in request order);
- `shared, in order`: each shared-KV rank sends its pages to a stock decode (request order);
- `shared, grouped`: the same to a decode with the plugin (`owner_grouped_pages`, the page
  order its `_alloc_for_decode_prealloc` hook writes into req_to_token);
- `..., fragmented`: the same on a decode whose free list is a random half of a pool twice the
  request's size (about n/2 gaps; runs break at them); `x single sender` compares with
  `replicated, fragmented`, the single sender on that same free list.

The request's prefill pages are consecutive logical pages from page 1 (a fresh paged allocator);
the decode's are pages 1..n (fresh) unless fragmented. Ranks run one after another, each timed
alone (median of --repeats): on one host their sends would share the same cores and loopback,
so a concurrent wall time would measure this machine, not the transfer. After every transfer the
decode pool is checked: each position's page (every layer, both kinds) equals the prefill's, and
no other page was written. Raw results go to OUT/bench_pd_transfer_<latent bytes>B.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

PAGE = 64
INDEX_BYTES = 132
MAX_BATCH = 1024


def _machine() -> dict:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return dict(
        host=platform.node(), cpu=cpu, cores=os.cpu_count(), load_avg=os.getloadavg(), python=platform.python_version(),
        torch=torch.__version__, sglang=ver("sglang"),
        mooncake=ver("mooncake-transfer-engine-non-cuda") or ver("mooncake-transfer-engine"),
        transport="Mooncake TCP, 127.0.0.1, CPU memory",
    )  # fmt: skip


class Pool:
    """One side's registered buffers: per kind a [layers, pages, page bytes] uint8 tensor."""

    def __init__(self, engine, layers, pages, latent_page, index_page):
        self.kinds = [torch.zeros(layers, pages, latent_page, dtype=torch.uint8),
                      torch.zeros(layers, pages, index_page, dtype=torch.uint8)]  # fmt: skip
        engine.register([(t.data_ptr(), t.numel()) for t in self.kinds])

    def ptr(self, kind, layer, page):
        t = self.kinds[kind]
        return t.data_ptr() + (layer * t.shape[1] + page) * t.shape[2]


def _fill(full: Pool, logical_pages: np.ndarray) -> None:
    """A byte pattern per (logical page, layer, kind), so any misplaced page shows."""
    for kind, t in enumerate(full.kinds):
        layers, _, nbytes = t.shape
        base = torch.arange(nbytes, dtype=torch.int64)
        for layer in range(layers):
            seed = torch.from_numpy(logical_pages * 131 + layer * 17 + kind * 7)[:, None]
            t[layer, : len(logical_pages)] = ((base[None, :] * (2 * kind + 3) + seed) % 251).to(torch.uint8)


def _entries(src_pool, dst_pool, src_pages, dst_pages):
    """(src, dst, length) of SGLang's `_send_kvcache_generic`: per kind and layer, one per run."""
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    src_runs, dst_runs = group_concurrent_contiguous(np.asarray(src_pages, np.int32), np.asarray(dst_pages, np.int32))
    srcs, dsts, lens = [], [], []
    for kind, t in enumerate(src_pool.kinds):
        layers, _, nbytes = t.shape
        for layer in range(layers):
            for s, d in zip(src_runs, dst_runs):
                srcs.append(src_pool.ptr(kind, layer, s[0]))
                dsts.append(dst_pool.ptr(kind, layer, d[0]))
                lens.append(len(s) * nbytes)
    return srcs, dsts, lens, len(src_runs)


def _write(engine, session, srcs, dsts, lens) -> tuple[float, int]:
    t0 = time.perf_counter()
    batches = 0
    for i in range(0, len(lens), MAX_BATCH):
        part = slice(i, i + MAX_BATCH)
        rc = engine._engine.batch_transfer_sync_write(session, srcs[part], dsts[part], lens[part])
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        batches += 1
    return time.perf_counter() - t0, batches


def _verify(decode: Pool, full: Pool, dst_pages: np.ndarray, what: str) -> None:
    dst = torch.from_numpy(dst_pages)
    for kind, (d, f) in enumerate(zip(decode.kinds, full.kinds)):
        n = len(dst_pages)
        if not torch.equal(d[:, dst], f[:, :n]):
            raise AssertionError(f"{what}: a page of kind {kind} is not at its position")
        others = torch.ones(d.shape[1], dtype=torch.bool)
        others[dst] = False
        if d[:, others].any():
            raise AssertionError(f"{what}: a page outside the request's destinations was written")


def run(args) -> dict:
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_shard_rank

    from sglang_nsa_cp.pd.engine import EngineConfig, MooncakeEngine
    from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import owner_grouped_pages

    n = -(-args.tokens // PAGE)
    latent_page, index_page = PAGE * args.latent_bytes, PAGE * INDEX_BYTES
    logical = np.arange(1, n + 1, dtype=np.int64)  # prefill: a fresh allocator's first pages
    rx, tx = MooncakeEngine(EngineConfig()), MooncakeEngine(EngineConfig())
    decode = Pool(rx, args.layers, 2 * n + 1, latent_page, index_page)
    full = Pool(tx, args.layers, n + 1, latent_page, index_page)  # replicated rank 0: logical page p at p - 1
    _fill(full, logical)
    rng = np.random.default_rng(0)
    fragmented = np.sort(rng.choice(np.arange(1, 2 * n + 1), size=n, replace=False))
    rows = []

    def measure(sender, cp, rank, src_pool, src_pages, positions, dst_all):
        dst = dst_all[positions]
        srcs, dsts, lens, runs = _entries(src_pool, decode, src_pages, dst)
        times = []
        for _ in range(args.repeats):
            elapsed, batches = _write(tx, rx.session_id, srcs, dsts, lens)
            times.append(elapsed)
        page_bytes = args.layers * (latent_page + index_page)
        if sum(lens) != len(positions) * page_bytes:  # exactly the owned pages, every layer and kind
            raise AssertionError(f"{sender} rank {rank}: {sum(lens)} bytes for {len(positions)} pages")
        row = dict(sender=sender, cp=cp, rank=rank, pages=len(positions), runs=runs, entries=len(lens),
                   batches=batches, bytes=int(sum(lens)), seconds=statistics.median(times), all_seconds=times)  # fmt: skip
        rows.append(row)
        print(f"  {sender:<28} cp {cp} rank {rank}: {row['pages']:>5} pages {row['entries']:>6} entries "
              f"{row['bytes'] / 1e6:9.1f} MB {row['seconds'] * 1e3:8.1f} ms", flush=True)  # fmt: skip
        return srcs, dsts, lens

    in_order = np.arange(1, n + 1)
    for sender, dst_all in (("replicated", in_order), ("replicated, fragmented", fragmented)):
        for t in decode.kinds:
            t.zero_()
        measure(sender, 1, 0, full, logical - 1, np.arange(n), dst_all)
        _verify(decode, full, dst_all, sender)
    for cp in args.cp:
        local_pages = (n + cp) // cp + 1
        shards = []
        for rank in range(cp):
            shard = Pool(tx, args.layers, local_pages, latent_page, index_page)
            owned = logical % cp == rank
            for t, f in zip(shard.kinds, full.kinds):
                t[:, logical[owned] // cp] = f[:, np.nonzero(owned)[0]]
            shards.append(shard)
        for sender, dst_all in (("shared, in order", in_order), ("shared, grouped", owner_grouped_pages(in_order, cp)),
                                ("shared, grouped, fragmented", owner_grouped_pages(fragmented, cp))):  # fmt: skip
            written = []
            for rank in range(cp):  # every rank writes once into one pool, then the whole request is checked
                local, positions = filter_kv_indices_for_shard_rank(
                    kv_indices=logical, index_slice=slice(0, n), shard_rank=rank, shard_size=cp
                )
                srcs, dsts, lens = measure(sender, cp, rank, shards[rank], local, positions, dst_all)
                written.append((srcs, dsts, lens))
            for t in decode.kinds:
                t.zero_()
            for srcs, dsts, lens in written:
                _write(tx, rx.session_id, srcs, dsts, lens)
            _verify(decode, full, dst_all, f"{sender} cp {cp}")
        for shard in shards:
            tx.unregister([t.data_ptr() for t in shard.kinds])
    return dict(
        machine=_machine(),
        config=dict(
            tokens=args.tokens,
            pages=n,
            layers=args.layers,
            latent_bytes_per_token=args.latent_bytes,
            index_bytes_per_token=INDEX_BYTES,
            page_size=PAGE,
            max_batch_entries=MAX_BATCH,
            repeats=args.repeats,
            fragmented_pool_pages=2 * n,
        ),  # fmt: skip
        rows=rows,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    )


def table(result) -> str:
    rows = result["rows"]
    single = {frag: next(r for r in rows if r["sender"] == "replicated" + frag) for frag in ("", ", fragmented")}
    out = ["| sender | CP | pages per rank | runs per rank | entries per rank | x single sender | MB per rank "
           "| ms per rank | GB/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    groups = {}
    for r in rows:
        groups.setdefault((r["sender"], r["cp"]), []).append(r)
    for (sender, cp), rs in groups.items():

        def span(key, fmt="{:,}"):
            lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
            return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

        for r in rs:
            r["ms"], r["mb"], r["gbs"] = r["seconds"] * 1e3, r["bytes"] / 1e6, r["bytes"] / r["seconds"] / 1e9
        ratio = max(r["entries"] for r in rs) / single[", fragmented" if "fragmented" in sender else ""]["entries"]
        out.append(
            f"| {sender} | {cp} | {span('pages')} | {span('runs')} | {span('entries')} | {ratio:.1f} | "
            f"{span('mb', '{:,.1f}')} | {span('ms', '{:,.0f}')} | {span('gbs', '{:.2f}')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--latent-bytes", type=int, default=656, help="656 (FlashMLA fp8) or 1152 (bf16)")
    p.add_argument("--cp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    for var in ("MC_FORCE_TCP", "MOONCAKE_PROTOCOL"):
        os.environ.setdefault(var, "1" if var == "MC_FORCE_TCP" else "tcp")
    torch.set_num_threads(1)
    machine = _machine()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load average {machine['load_avg'][0]:.1f}; "
          f"{machine['transport']}; mooncake {machine['mooncake']}, sglang {machine['sglang']}", flush=True)  # fmt: skip
    result = run(args)
    text = table(result)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_pd_transfer_{args.latent_bytes}B.json")
    with open(path, "w") as f:
        json.dump(dict(result, table=text), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
