"""One batch of fp8 chunk writes into SGLang's page-interleaved DSA pool, per pool class, on CPU:
what test_pool_writes.py compares byte for byte. Runs inside one rank process of
`helpers.distributed.run_ranks` (SGLang's CP group over gloo, the history gather's PyNccl
communicator stood in by `sglang_model_harness.setup_process`).

Each variant builds a fresh pool of the same shape, poisons its gather scratch as the batch
begins (0xFF: NaN in every dtype), runs SGLang's batch start (`begin_shard_extend`) and one
`set_mla_kv_buffer` per layer with the same random latent, and returns the pool's and the
scratch's bytes, SGLang's quantizer calls and the fused kernel's calls.

SGLang's own Triton quantizer runs here, under the interpreter, not the torch twin the forward
harness installs: the interpreter's fp32 -> e4m3 cast does not round to nearest (the GPU's and
torch's do), so the interpreted fused kernel is bit-equal to SGLang's interpreted quantizer, not
to the twin (docs/sglang_cpu_forward.md). That costs ~20 ms per (token, 128 values), hence a
batch of a few tokens.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from helpers import sglang_model_harness as H
from helpers.dsa_pool import KV_DIM, PAGE, pool_kwargs
from helpers.paged_requests import RotatedPagedRequests

PAGES_PER_RANK = 8
MAX_LEN = 256
BATCH = [(0, 5), (1, 3)]  # two new requests (no cached history), pages of both owners; few tokens,
# because SGLang's quantizer runs 5 interpreted Triton programs per token here
# variant -> the flag's decision; each pool is SGLang's class as built, handed out through the
# plugin's hook on SGLang's pool builder (the plugin's subclass only with the flag)
VARIANTS = {"sglang": False, "plugin": True}


def _count_calls(module, name: str) -> dict:
    counts = {"calls": 0}
    inner = getattr(module, name)

    def counted(*args, **kwargs):
        counts["calls"] += 1
        return inner(*args, **kwargs)

    setattr(module, name, counted)
    return counts


def run_fp8_pool_writes(rank, world, group, model_path) -> dict:
    """{variant: {"pool": [per-layer bytes], "scratch": {name: bytes per slot}, "quantizations",
    "fused_stores", "pool_class"}} for this rank."""
    os.environ["SGLANG_NSA_CP_KERNELS"] = "triton"  # the fused store's Triton kernel, interpreted
    sa = H.setup_process(rank, world, model_path, world, "fp8_e4m3")
    from sglang.srt.mem_cache import page_interleave_pool
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as fused
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    load_plugins()
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate
    from sglang.srt.mem_cache import memory_pool

    memory_pool.quantize_k_cache_separate = quantize_k_cache_separate  # SGLang's kernel, not the twin
    cp_group = get_parallel().attn_cp_group
    quantizations = H.count_fp8_quantizations()
    fused_stores = _count_calls(fused, "store_mla_fp8_owned_and_scratch_triton")
    out = {}
    for variant, flag in VARIANTS.items():
        setattr(sa, ATTR, flag)  # the decision the flag's start-up validation writes
        quantizations["calls"] = fused_stores["calls"] = 0
        spec = H.shard_spec(cp_group.rank_in_group, cp_group.world_size, MAX_LEN, chunk_tokens=2 * PAGE, contexts=1)
        pool = H.as_sglang_builds(page_interleave_pool.PageInterleaveDSATokenToKVPool(
            **pool_kwargs(PAGES_PER_RANK * PAGE, "fp8"), shard_spec=spec, shard_group=cp_group
        ))  # fmt: skip
        H.poison_gather_scratch(pool)
        req_to_token = torch.zeros((4, MAX_LEN), dtype=torch.int32)
        requests = RotatedPagedRequests(req_to_token, PAGES_PER_RANK, PAGE, world, kvcache=pool, shard_spec=spec)
        prefix, seq, loc = requests.extend(BATCH)
        pool.begin_shard_extend(req_to_token, torch.tensor([i for i, _ in BATCH]), prefix, seq)
        g = torch.Generator().manual_seed(7)
        for layer in range(pool.layer_num):
            latent = (torch.randn(len(loc), 1, KV_DIM, generator=g) * 3).to(torch.bfloat16)
            pool.set_mla_kv_buffer(SimpleNamespace(layer_id=layer), loc, latent[..., :512], latent[..., 512:])
        out[variant] = dict(
            pool_class=f"{type(pool).__module__}.{type(pool).__name__}",
            pool=[buf.view(torch.uint8).clone() for buf in pool.kv_buffer],
            scratch={
                name: [slot.tensors[name].view(torch.uint8).clone() for slot in pool._slots]
                for name in pool._slots[0].tensors
            },  # fmt: skip
            quantizations=quantizations["calls"],
            fused_stores=fused_stores["calls"],
            owned_tokens=int((loc // PAGE % world == rank).sum()),
        )
        pool.end_shard_extend()
    return out
