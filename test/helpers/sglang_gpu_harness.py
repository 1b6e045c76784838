"""Drive SGLang 0.5.23's own DSA model forward on CUDA GPUs, with and without the plugin.

The GPU sibling of `sglang_model_harness.py` (which runs the same model code on CPU): the model
class, `forward_mla`, the DSA backend, the indexer, the KV pools, the interleave CP strategy and
`EagerRunner._execute_extend_cp` are SGLang's own; attention is FlashMLA's real sparse prefill
kernel. It runs on the GPU machine, where SGLang cannot be installed, from the bundle of
docs/gpu_bundle.md (`source scripts/gpu_unpack.sh`). What replaces the kernels that cannot load
there is listed, with the reason for each, in docs/sglang_gpu_forward.md; `install()`
applies the process-wide part before SGLang is imported, `build_model` the per-module part.

Used by test/sglang_ext/layers/test_sglang_gpu_forward.py (correctness) and benchmark/bench_sglang_prefill.py.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from helpers.sglang_model_harness import PAGE  # the DSA page: 64 tokens

# SGLang's own switches for its torch / Triton paths (audit rows 15-19, 21), set before import.
ENV = {
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",  # decode's paged MQA logits; prefill's are ours, below
    "SGLANG_DSA_FUSE_TOPK": "0",  # with --dsa-topk-backend torch: SGLang's unfused torch top-k
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",  # every prefill takes sparse MLA (as CP does)
    "SGLANG_DISABLE_DSA_INDEXER_FUSION": "1",  # the fused indexer is JIT kernels
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "TORCHDYNAMO_DISABLE": "1",  # SGLang's @torch.compile helpers run eagerly
}

# GLM-5's attention and dense-MLP dimensions (zai-org/GLM-5: hidden 6144, 64 heads, q_lora 2048,
# kv_lora 512 + rope 64, nope 192, v 256, indexer 32 x 128 with top-k 2048, vocab 154880, dense
# intermediate 12288). Every layer has a dense MLP: `first_k_dense_replace` = `num_hidden_layers`
# (`glm5_config`), so no MoE kernel runs and the MoE fields below are never read. RoPE:
# deepseek_yarn with factor 1, the rotary class SGLang's V3.2 path builds.
GLM5_ATTN = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 4,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 4, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "vocab_size": 154880, "max_position_embeddings": 262144, "rope_theta": 1000000, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "hidden_act": "silu", "attention_bias": False,
    "rope_scaling": {"rope_type": "deepseek_yarn", "type": "yarn", "factor": 1.0,
                     "original_max_position_embeddings": 262144, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


def glm5_config(layers: int) -> dict:
    """`GLM5_ATTN` with `layers` layers, every one dense (first_k_dense_replace = layers)."""
    return GLM5_ATTN | {"num_hidden_layers": layers, "first_k_dense_replace": layers}


def model_as_run(cfg: dict, sa, stand_ins: list[str]) -> dict:
    """What a results file says about the model that ran: from the config written and the
    ServerArgs used, not from GLM-5's card (its layers 3+ are MoE; these are not)."""
    layers, dense = cfg["num_hidden_layers"], min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    return {
        "class": cfg["architectures"][0], "layers": layers, "dense_mlp_layers": dense, "moe_layers": layers - dense,
        "hidden_size": cfg["hidden_size"], "dense_intermediate_size": cfg["intermediate_size"],
        "weights": "random bf16, loaded through SGLang's load_weights",
        "attention_backend": sa.attention_backend, "dsa_prefill_backend": sa.dsa_prefill_backend,
        "dsa_decode_backend": sa.dsa_decode_backend, "dsa_topk_backend": sa.dsa_topk_backend,
        "prefill_attention_kernel": "FlashMLA flash_mla_sparse_fwd (sgl-flash-mla 1.0.0, legacy SM90 kernel)",
        "kv_cache_dtype": sa.kv_cache_dtype, "page_size": PAGE, "tp_size": sa.tp_size, "attn_cp_size": sa.attn_cp_size,
        "stand_ins": stand_ins,
    }  # fmt: skip


# Kernels and collectives replaced in every run (docs/sglang_gpu_forward.md has the rows).
STAND_INS = [
    "prefill fp8 MQA logits: test/helpers/mqa_logits_triton.py (DeepGEMM cannot load)",
    "top-k: SGLang's unfused torch top-k (--dsa-topk-backend torch, SGLANG_DSA_FUSE_TOPK=0)",
    "RMSNorm, SiluAndMul, RoPE: SGLang's forward_native",
    "Hadamard rotation: a 128 x 128 matmul",
    "index-K store, latent store, q concat, fused-A GEMM: SGLang's Triton / torch fallbacks",
    "decode paged MQA logits: SGLang's torch fallback",
    "custom all-reduce, multicast logits gather: NCCL",
]
SHARED_GPU_NOTE = (
    "ranks share GPU 0: NCCL over its socket transport on loopback, one NCCL_HOSTID per rank "
    "(helpers/distributed.py nccl_device); exact, so the checks hold, but no timing means anything"
)


def write_config(path: str, cfg: dict) -> str:
    """config.json only: the weights are made on the GPU (a checkpoint would not fit in a run)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def install() -> None:
    """Process-wide stand-ins; call before the first `import sglang...`."""
    from helpers import gpu_stand_ins

    for k, v in ENV.items():
        os.environ[k] = v
    gpu_stand_ins.install()


def shares_gpu(world: int) -> bool:
    """Whether `world` ranks share GPU 0 (fewer GPUs than ranks)."""
    return torch.cuda.device_count() < world


def setup_process(
    rank: int, world: int, model_path: str, cp_size: int, kv_cache_dtype: str = "bfloat16",
    prefill_backend: str = "flashmla_sparse",
):  # fmt: skip
    """Publish ServerArgs and build SGLang's process groups on NCCL, GPU `rank`. `kv_cache_dtype`
    fp8_e4m3: SGLang's fp8 pool (656-byte FlashMLA rows); prefill stays on `prefill_backend`
    (flashmla_sparse dequantizes a prefix batch's KV to bf16, flashmla_sparse_q8 casts it to fp8),
    decode takes flashmla_kv, SGLang's fp8 decode on SM90."""
    from helpers.distributed import nccl_device

    install()
    device = nccl_device(rank)
    torch.cuda.set_device(device)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    decode_backend = "flashmla_kv" if kv_cache_dtype == "fp8_e4m3" else "flashmla_sparse"
    kw = dict(model_path=model_path, device="cuda", attention_backend="dsa", kv_cache_dtype=kv_cache_dtype,
              dsa_prefill_backend=prefill_backend, dsa_decode_backend=decode_backend, dsa_topk_backend="torch",
              bf16_gemm_backend="torch", skip_tokenizer_init=True, tp_size=world, moe_dense_tp_size=1,
              disable_custom_all_reduce=True)  # fmt: skip
    if cp_size > 1:
        kw.update(enable_prefill_cp=True, cp_strategy="interleave", attn_cp_size=cp_size)
    sa = ServerArgs(**kw)
    reset_context()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=rank))
    parallel_state.set_custom_all_reduce(False)  # audit row 26: a JIT / sgl_kernel all-reduce
    # SGLang's zero-SM symmetric gather scratch is an NCCL window (SGLang turns it off itself below
    # NCCL 2.31.2; the machine has 2.28): off, so the pool gathers with its PyNccl all-gather.
    os.environ["SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER"] = "0"
    # torch.distributed is already up (from run_ranks, on NCCL): SGLang builds its groups on it.
    init_distributed_environment(world_size=world, rank=rank, local_rank=device, backend="nccl")
    initialize_model_parallel(backend="nccl")
    _replace_kernels()
    return sa


def _replace_kernels() -> None:
    """Audit rows 7, 8, 11, 13, 15, 17: module-level switches to SGLang's own paths, or ours."""
    from helpers import mqa_logits_triton
    import sglang.kernels.ops.attention.dsv4 as dsv4
    import sglang.kernels.ops.kvcache.set_mla_kv_buffer as set_mla
    import sglang.kernels.ops.quantization.hadamard as hadamard
    from sglang.srt.layers.attention import dsa_backend
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.layers.attention.dsa import utils as dsa_utils

    from helpers.sglang_cpu_stand_ins import hadamard_reference, pad_ragged_topk_offsets

    hadamard.hadamard_transform = hadamard_reference  # JIT fast-hadamard-transform
    pad_ragged_topk_offsets()  # fp8 KV: the RAGGED transform with the unfused top-k under CP (audit)
    dsv4.get_paged_mqa_logits_metadata = lambda *a, **k: None  # the torch paged logits ignore it
    set_mla.can_use_set_mla_kv_buffer = lambda *a: False  # SGLang's Triton latent store
    dsa_indexer.can_use_dsa_fused_store = lambda *a: False  # act_quant + SetKAndS (Triton)
    dsa_backend.concat_mla_absorb_q_general = lambda a, b: torch.cat([a, b], dim=-1)
    # Prefill MQA logits: DeepGEMM's kernel cannot load and SGLang's torch fallback materializes a
    # [queries, keys] fp32 product per head (60 ms per layer at 128k); our Triton kernel instead.
    resolve = lambda: mqa_logits_triton.fp8_mqa_logits  # noqa: E731
    dsa_utils.resolve_fp8_mqa_logits_fn = resolve
    dsa_indexer.resolve_fp8_mqa_logits_fn = resolve
    # MoE routing (GLM-5's sigmoid noaux_tc): on CUDA SGLang takes flashinfer's or a JIT router;
    # its own torch version instead (eager: TORCHDYNAMO_DISABLE). Dense-only models never call it.
    from sglang.srt.layers.moe import topk as moe_topk

    moe_topk.biased_grouped_topk = _routing_torch(moe_topk.biased_grouped_topk_impl)


def _routing_torch(impl):
    from helpers import gpu_stand_ins

    def biased_grouped_topk(*args, **kwargs):
        gpu_stand_ins.record_call("moe routing: SGLang's biased_grouped_topk_impl (torch)")
        return impl(*args, **kwargs)

    return biased_grouped_topk


def moe_experts_torch(method, layer, dispatch_output):
    """`UnquantizedFusedMoEMethod.forward_cuda` in torch: SGLang's Triton MoE runner aligns tokens
    with sgl_kernel's moe_align_block_size, which cannot load here. out[t] = rsf x sum_k
    w[t, k] x down_e(silu(gate_e(x_t)) x up_e(x_t)) for e = ids[t, k] over this rank's TP shard
    of each expert, summed per token in slot order (no atomics: the same input gives the same
    bits); rsf = the runner's routed_scaling_factor, which SGLang's CUDA runner applies itself."""
    import torch.nn.functional as F
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    from helpers import gpu_stand_ins

    gpu_stand_ins.record_call("moe experts: sglang_gpu_harness.moe_experts_torch")
    x = dispatch_output.hidden_states
    weights, ids, _ = dispatch_output.topk_output
    per_slot = torch.zeros(*ids.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    w13, w2 = layer.w13_weight, layer.w2_weight
    for e in range(w13.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w13[e].t()
        gate, up = (h[:, 0::2], h[:, 1::2]) if getattr(method, "w13_swiglu_interleaved", False) else h.chunk(2, -1)
        y = (F.silu(gate) * up) @ w2[e].t()
        per_slot[rows, slots] = y.float() * weights[rows, slots, None].float()
    rsf = method.moe_runner_config.routed_scaling_factor
    out = per_slot.sum(dim=1) * (1.0 if rsf is None else rsf)
    return StandardCombineInput(hidden_states=out.to(x.dtype))


def build_model(sa, seed: int = 0):
    """SGLang's model class from config.json with seeded random weights made on this GPU, loaded
    through SGLang's `load_weights`; then the per-module pins of the audit (rows 1-4, 24)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM

    from helpers.sglang_model_harness import random_checkpoint

    mc = ModelConfig.from_server_args(sa)
    cfg = json.load(open(os.path.join(sa.model_path, "config.json")))
    with set_default_torch_dtype(torch.bfloat16), torch.device("cuda"):
        arch = mc.hf_config.architectures[0]
        model = {c.__name__: c for c in (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM)}[arch](mc.hf_config)
    model.load_weights(iter(random_checkpoint(cfg, seed, device="cuda").items()))
    return mc, pin_native_modules(model)


def pin_native_modules(model):
    """Audit rows 1-4 and 24 on a built model: SGLang's own native paths where its compiled kernels
    cannot load (the harness and the GPU servers' stand-in plugin both call this)."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA, MoEGate

    from helpers.sglang_cpu_stand_ins import _rope_native_any_rank

    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul)):
            m._forward_method = m.forward_native  # sgl_kernel / JIT kernels
        if isinstance(m, DeepseekScalingRotaryEmbedding):
            m._forward_method = _rope_native_any_rank(m)  # JIT rope kernel
        if isinstance(m, DeepseekV2AttentionMLA):
            m._use_min_latency_fused_a_gemm = False  # JIT fused-A GEMM -> cuBLAS
        if isinstance(m, MoEGate):
            m.tiny_router_gemm_max_tokens = -1  # JIT tiny GEMM (<= 16 tokens) -> cuBLAS
        if isinstance(m, UnquantizedFusedMoEMethod):
            m._forward_method = functools.partial(moe_experts_torch, m)  # sgl_kernel's MoE align
    gatherer = getattr(model.logits_processor, "_logits_gatherer", None)
    if gatherer is not None:
        gatherer._state = None  # NVLink multicast all-gather -> NCCL (multicast stays off here)
    return model


# ---- the pools -------------------------------------------------------------------------------------

# What builds each pool, by name (results files and test ids use these names):
POOLS = {
    "replicated": "SGLang's DSATokenToKVPool: every rank stores every logical page",
    "shared": "SGLang's page-interleaved pool, the plugin's subclass (--enable-nsa-prefill-cp-shared-kv): "
    "scratch of SGLANG_NSA_CP_SCRATCH_CONTEXTS contexts (default 1) + one chunk",
    "sglang_pool": "SGLang's own PageInterleaveDSATokenToKVPool, built directly (its Blackwell-only validator "
    "bypassed), its default scratch of 8 contexts + one chunk",
}


class GpuEngine:
    """Factory for `sglang_model_harness.RotatedEngine` on this GPU with one of `POOLS`: requests
    take pages from SGLang's owner-rotating allocator in every case, so the three pools see the
    same page ids and the same batches."""

    def __new__(cls, sa, mc, model, pool: str, pages_per_rank: int, shard_size: int, max_len: int, chunk_tokens: int):
        from unittest import mock

        from sglang.srt.mem_cache import page_interleave, page_interleave_pool

        from helpers.sglang_model_harness import RotatedEngine
        from sglang_nsa_cp.envs import envs
        from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool as Plugin

        if pool not in POOLS:
            raise ValueError(f"pool must be one of {sorted(POOLS)}, got {pool!r}")
        contexts = {"shared": envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.get(),
                    "sglang_pool": page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS}.get(pool, 1)  # fmt: skip
        # SGLang's own class is the subclass's base (the plugin replaces no class: its hook on SGLang's
        # pool builder adopts a built pool, with the flag)
        sglang_class = Plugin.__bases__[0]
        assert sglang_class.__module__ == "sglang.srt.mem_cache.page_interleave_pool", sglang_class
        pool_class = sglang_class if pool == "sglang_pool" else page_interleave_pool.PageInterleaveDSATokenToKVPool
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        from sglang_nsa_cp.sglang_ext.mem_cache import kv_cache_configurator as pool_hook

        with (
            mock.patch.object(page_interleave_pool, "PageInterleaveDSATokenToKVPool", pool_class),
            mock.patch.object(pool_hook, "is_enabled", lambda: pool != "sglang_pool"),  # SGLang's class stays its own
        ):
            engine = RotatedEngine(sa, mc, model, pages_per_rank, shard_size, sharded=pool != "replicated",
                                   max_len=max_len, chunk_tokens=chunk_tokens, scratch_contexts=contexts)  # fmt: skip
        torch.cuda.synchronize()
        engine.pool_alloc_bytes = torch.cuda.memory_allocated() - before
        engine.scratch_bytes = scratch_bytes(engine.pool)
        engine.init_requests()
        return engine


def scratch_bytes(pool) -> int:
    """Bytes of a sharded pool's double-buffered gather scratch (0 for SGLang's replicated pool)."""
    slots = getattr(pool, "_slots", [])
    return sum(t.numel() * t.element_size() for slot in slots for t in slot.tensors.values())


def pool_info(pool) -> dict:
    """Which pool class ran and how it gathers history."""
    info = {"pool": type(pool).__name__, "pool_module": type(pool).__module__, "pool_dtype": str(pool.dtype)}
    if hasattr(pool, "kv_gather_comm"):
        spec = pool.shard_spec
        info.update(gather_comm=type(pool.kv_gather_comm).__name__, symmetric_scratch=pool._use_symmetric_scratch,
                    scratch_prefix_tokens=spec.max_prefix_tokens, scratch_chunk_tokens=spec.chunk_tokens)  # fmt: skip
    return info


def time_history_waits(pool) -> list:
    """CUDA events on the compute stream around each read of a layer's gathered history (SGLang's
    `_acquire_slot_for_read`: the wait for the layer-ahead gather, then the next layer's launch):
    (layer_id, start, end) per read in batches with history; the elapsed time is what the layer
    waited for its history. Clear the list between batches."""
    waits = []
    inner = pool._acquire_slot_for_read

    def timed(layer_id):
        if not pool._block_pages:
            return inner(layer_id)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        slot = inner(layer_id)
        end.record()
        waits.append((layer_id, start, end))
        return slot

    pool._acquire_slot_for_read = timed
    return waits


def pages_held(engine) -> tuple[int, int]:
    """(pages this rank stores, logical pages) of the engine's requests, from its page table."""
    pages = set()
    for idx, n in engine.requests.lens.items():
        pages.update((engine.req_to_token[idx, :n:PAGE].long() // PAGE).tolist())
    if not hasattr(engine.pool, "shard_rank"):
        return len(pages), len(pages)
    return sum(1 for p in pages if p % engine.pool.shard_size == engine.pool.shard_rank), len(pages)


# ---- the correctness scenario ---------------------------------------------------------------------

# Contexts past index_topk (2048), so the indexer's top-k really selects; extends start on a page,
# as SGLang's scheduler makes them under KV sharding (radix matches are whole pages, chunks end on
# pages). (request, new tokens).
CHECK_BATCHES = [
    [(0, 3072), (1, 1000)],  # cold prompts (request 1's last page partly filled)
    [(0, 2560), (2, 700)],  # request 0's second chunk (48 cached pages); a new request
    # request 3 hits request 0's first 2048 cached tokens; request 0's third chunk; a new request
    [(3, 900), (0, 1800), (4, 500)],
]
CHECK_FORK = (2, 3, 0, 2048)  # before batch 2: request 3 starts with request 0's first 32 pages
CHECK_DECODE = [(i, 1) for i in range(5)]
CHECK_MAX_LEN = 8192
CHECK_PAGES_PER_RANK = 128


def check_token_ids(vocab: int, seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = {i: torch.randint(2, vocab, (CHECK_MAX_LEN,), generator=g) for i in range(5)}
    _, idx, source, length = CHECK_FORK
    ids[idx][:length] = ids[source][:length]
    return ids


CUTLASS_ENV = "NSA_CP_CUTLASS_INCLUDE"  # colon-separated CUTLASS include dirs (cute/, cutlass/) for q8's JIT kernel


def use_cutlass_from_env() -> None:
    """Point SGLang's JIT `cutlass` dependency (which it looks for in flashinfer or DeepGEMM, neither
    of which loads here) at `NSA_CP_CUTLASS_INCLUDE` when that is set."""
    from sglang.kernels.jit.utils.deps import REGISTERED_DEPENDENCIES

    if os.environ.get(CUTLASS_ENV):
        REGISTERED_DEPENDENCIES["cutlass"] = lambda: os.environ[CUTLASS_ENV].split(":")


def use_q8_reference_kernel() -> None:
    """flashmla_sparse_q8's attention kernel -> `sglang_cpu_stand_ins.sparse_mla_q8kv8_reference`
    (for a machine where SGLang's JIT kernel does not build), each call logged as a stand-in."""
    import sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90 as q8kv8

    from helpers import gpu_stand_ins
    from helpers.sglang_cpu_stand_ins import sparse_mla_q8kv8_reference

    def reference(*args, **kwargs):
        gpu_stand_ins.record_call("q8 attention: sglang_cpu_stand_ins.sparse_mla_q8kv8_reference (no JIT kernel)")
        return sparse_mla_q8kv8_reference(*args, **kwargs)

    q8kv8.sparse_mla_q8kv8_prefill_fwd = reference


def run_check(
    rank, world, group, model_path, mode, kv_cache_dtype="bfloat16", prefill_backend="flashmla_sparse",
    q8_kernel="jit",
):  # fmt: skip
    """One rank of the correctness scenario. mode: 'off' (1 GPU, no CP), 'replicated' (SGLang's
    CP, every rank keeps all KV) or 'shared' (the plugin loaded and enabled: SGLang's sharded
    pool as the plugin's subclass, its gather scratch NaN as each batch begins); `kv_cache_dtype`
    bfloat16 or fp8_e4m3. Returns each batch's next-token logits (CPU), then the decode step's,
    which runs on a non-CP pool assembled from the page owners in the shared mode (what the
    owned-page PD transfer delivers to a decode instance), with the pool's class, how it
    gathered history and a digest per layer of the decode pool. `prefill_backend`: SGLang's
    `--dsa-prefill-backend`; with flashmla_sparse_q8, `q8_kernel` "jit" (SGLang's SM90 kernel) or
    "reference" (`use_q8_reference_kernel`)."""
    import hashlib

    from helpers import gpu_stand_ins
    from helpers import sglang_model_harness as H

    cp = 1 if mode == "off" else world
    sa = setup_process(rank, world, model_path, cp, kv_cache_dtype, prefill_backend)
    if prefill_backend == "flashmla_sparse_q8":
        use_q8_reference_kernel() if q8_kernel == "reference" else use_cutlass_from_env()
    if mode == "shared":
        from sglang.srt.plugins import load_plugins

        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()  # the plugin's entry point, as every SGLang process does
        setattr(sa, ATTR, True)  # the decision its start-up validation writes
    mc, model = build_model(sa)
    engine = GpuEngine(sa, mc, model, "shared" if mode == "shared" else "replicated", CHECK_PAGES_PER_RANK, world,
                       max_len=CHECK_MAX_LEN, chunk_tokens=CHECK_MAX_LEN)  # fmt: skip
    info = pool_info(engine.pool)
    if mode == "shared":
        H.poison_gather_scratch(engine.pool)  # as the CPU forward test does
        gathers = H.count_history_gathers(engine.pool)
    quantizations = H.count_fp8_quantizations()
    toks = check_token_ids(mc.hf_config.vocab_size)
    logits, history = [], []
    for b, batch in enumerate(CHECK_BATCHES):
        if b == CHECK_FORK[0]:
            engine.requests.fork(*CHECK_FORK[1:])
        logits.append(engine.run(engine.forward_batch(batch, toks)))
        if mode == "shared":
            history.append(engine.pool._block_pages > 0)
    info.update(
        history=history, fp8_quantizations=quantizations["calls"], cp_active=[t["cp_active"] for t in engine.trace]
    )
    if mode == "shared":
        info["gathered"] = dict(gathers)
        engine.pool.end_shard_extend()
        engine.rebind_pool(H._decode_pool_from_page_owners(engine))
    # what a decode instance holds after the prefill batches (PD: the pages it receives): a digest per layer
    info["decode_pool_digests"] = [
        hashlib.sha256(buf.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for buf in engine.pool.kv_buffer
    ]
    logits.append(engine.run(engine.forward_batch(CHECK_DECODE, toks, decode=True)))
    info["stand_ins"] = gpu_stand_ins.report()
    info["shares_gpu"] = shares_gpu(world)
    return dict(logits=logits, **info)
