"""Gather-scratch bytes per rank of SGLang's page-interleaved DSA pool, SGLang's default versus ours (CPU, ~1 min).

    TRITON_INTERPRET=1 PYTHONPATH=python python benchmark/bench_scratch_bytes.py [--out DIR]

Builds `PageInterleaveDSATokenToKVPool` on CPU (GLM-5 attention sizes, 1 layer, tiny pool) with SGLang's default
scratch spec (8 contexts + one chunk) and the plugin's (1 context + one chunk), bf16 (576-element rows) and fp8_e4m3
(FlashMLA's 656-byte rows) KV; sums its two scratch slots' tensor bytes and converts the difference to tokens of
persistent KV per rank of a model of --layers layers (latent + index bytes per token of the pool's own
buffers, times the layers). Raw: DIR/bench_scratch_bytes.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import sglang
import sglang.srt.mem_cache.page_interleave_pool as pip
import torch
from sglang.srt.mem_cache.page_interleave import (
    _KV_SHARD_SCRATCH_PREFIX_CONTEXTS,
    PageShardSpec,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.common import ceil_align

from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave import scratch_spec

PAGE, CHUNK = 64, 8192
KV = {"bf16": (torch.bfloat16, 576), "fp8_e4m3": (torch.float8_e4m3fn, 656)}
CPS, CONTEXTS = (2, 4, 8), (32768, 131072, 163840)
MIB = 1 << 20


class _NoComm:  # stands in for the pool's dedicated PyNcclCommunicator, which is only constructed
    def __init__(self, group, device, cta_policy=None):
        pass


def measure(kv: str, n: int, context: int, contexts: int) -> dict:
    dtype, dim = KV[kv]
    spec = scratch_spec(PageShardSpec(0, n, PAGE, 0, 0), context_len=context, chunk_tokens=CHUNK, contexts=contexts)
    if contexts == _KV_SHARD_SCRATCH_PREFIX_CONTEXTS:  # SGLang's make_page_shard_spec formula
        assert spec.max_prefix_tokens == contexts * ceil_align(context, n * PAGE), spec
        assert spec.chunk_tokens == ceil_align(CHUNK, PAGE), spec
    fake = SimpleNamespace(world_size=n, rank_in_group=0, cpu_group=None, device=torch.device("cpu"))
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):  # no DCP
        pool = pip.PageInterleaveDSATokenToKVPool(
            size=PAGE * 4, page_size=PAGE, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
            layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=dim, shard_spec=spec, shard_group=fake,
        )  # fmt: skip
    scratch = sum(t.numel() * t.element_size() for s in pool._slots for t in s.tensors.values())
    kv_per_token = pool.get_kv_size_bytes() / (pool.size + pool.page_size)
    out = dict(
        scratch_bytes=scratch,
        scratch_rows=spec.scratch_rows,
        max_prefix_tokens=spec.max_prefix_tokens,
        chunk_tokens=spec.chunk_tokens,
        kv_bytes_per_token=kv_per_token,
    )
    del pool
    gc.collect()
    return out


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results"))
    ap.add_argument("--layers", type=int, default=78, help="the model's layers (GLM-5: 78), for tokens of KV")
    args = ap.parse_args()
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: must be at least 1")
    pip.PyNcclCommunicator = _NoComm
    machine = dict(torch=torch.__version__, sglang=sglang.__version__, cpu=cpu_name())
    print(f"# torch {machine['torch']}, sglang {machine['sglang']}, CPU {machine['cpu']}")
    upstream_k = _KV_SHARD_SCRATCH_PREFIX_CONTEXTS
    rows = []
    for kv in KV:
        for n in CPS:
            for ctx in CONTEXTS:
                up, ours = measure(kv, n, ctx, upstream_k), measure(kv, n, ctx, 1)
                saved = up["scratch_bytes"] - ours["scratch_bytes"]
                assert ours["kv_bytes_per_token"] == up["kv_bytes_per_token"]
                rows.append(
                    dict(kv_dtype=kv, cp=n, context=ctx, chunk=CHUNK, page=PAGE, sglang_default=up,
                         plugin_default=ours, saved_bytes=saved,
                         saved_tokens=saved / (ours["kv_bytes_per_token"] * args.layers), layers=args.layers)
                )  # fmt: skip
    print(
        f"\n| kv dtype | CP | context | SGLang default ({upstream_k} ctx) MiB | plugin (1 ctx) MiB "
        "| saved MiB | saved tokens of KV per rank |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['kv_dtype']} | {r['cp']} | {r['context']} "
            f"| {r['sglang_default']['scratch_bytes'] / MIB:.1f} "
            f"| {r['plugin_default']['scratch_bytes'] / MIB:.1f} | {r['saved_bytes'] / MIB:.1f} "
            f"| {r['saved_tokens']:,.0f} |"
        )
    bpt = {kv: next(r["plugin_default"]["kv_bytes_per_token"] for r in rows if r["kv_dtype"] == kv) for kv in KV}
    print(
        f"\nSaved tokens = saved bytes / (persistent KV bytes per token per layer x {args.layers} layers) per rank "
        "(latent + index per layer: " + ", ".join(f"{kv} {b:.0f} B" for kv, b in bpt.items()) + "); the scratch "
        "holds one layer per slot whatever the model's depth, the pool every layer."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_scratch_bytes.json"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import provenance

    model = f"SGLang's DSA pool on CPU (no weights): KV bytes per token per layer {bpt}, {args.layers} layers"
    path.write_text(json.dumps(dict(provenance=provenance(model), machine=machine, results=rows), indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
