"""Drive SGLang 0.5.23's own DSA model forward on CUDA GPUs, with and without the plugin.

The GPU sibling of `sglang_model_harness.py` (which runs the same model code on CPU): the model
class, `forward_mla`, the DSA backend, the indexer, the KV pools, the interleave CP strategy and
`EagerRunner._execute_extend_cp` are SGLang's own; attention is FlashMLA's real sparse prefill
kernel. It runs on the GPU machine, where SGLang cannot be installed, from the bundle of
docs/gpu_bundle.md (`source scripts/gpu_unpack.sh`). What replaces the kernels that cannot load
there is listed, with the reason for each, in docs/sglang_gpu_forward_audit.md; `install()`
applies the process-wide part before SGLang is imported, `build_model` the per-module part.

Used by test/sglang_ext/layers/test_sglang_gpu_forward.py (correctness) and benchmark/bench_sglang_prefill.py.
"""

from __future__ import annotations

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
# intermediate 12288), with `num_hidden_layers` layers that all have a dense MLP (no MoE kernels
# here). RoPE: deepseek_yarn with factor 1, the rotary class SGLang's V3.2 path builds.
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


def comm_setup(rank: int, world: int) -> tuple[str, int]:
    """(backend, GPU) of `rank`: NCCL with a GPU per rank where there are enough GPUs; otherwise
    every rank on GPU 0 over gloo (NCCL refuses two ranks on one GPU). The kernels and the data are
    the same either way, so the bit-for-bit checks hold; only the collectives' speed differs, which
    is why the benchmark insists on a GPU per rank."""
    gpus = torch.cuda.device_count()
    return ("nccl", rank) if gpus >= world else ("gloo", 0)


def setup_process(rank: int, world: int, model_path: str, cp_size: int, kv_cache_dtype: str = "bfloat16"):
    """Publish ServerArgs and build SGLang's process groups on NCCL, GPU `rank`. `kv_cache_dtype`
    fp8_e4m3: SGLang's fp8 pool (656-byte FlashMLA rows); prefill stays on flashmla_sparse (which
    dequantizes a prefix batch's KV to bf16), decode takes flashmla_kv, SGLang's fp8 decode on SM90."""
    install()
    backend, device = comm_setup(rank, world)
    torch.cuda.set_device(device)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    decode_backend = "flashmla_kv" if kv_cache_dtype == "fp8_e4m3" else "flashmla_sparse"
    kw = dict(model_path=model_path, device="cuda", attention_backend="dsa", kv_cache_dtype=kv_cache_dtype,
              dsa_prefill_backend="flashmla_sparse", dsa_decode_backend=decode_backend, dsa_topk_backend="torch",
              bf16_gemm_backend="torch", skip_tokenizer_init=True, tp_size=world, moe_dense_tp_size=1,
              disable_custom_all_reduce=True)  # fmt: skip
    if cp_size > 1:
        kw.update(enable_prefill_cp=True, cp_strategy="interleave", attn_cp_size=cp_size)
    sa = ServerArgs(**kw)
    reset_context()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=rank))
    parallel_state.set_custom_all_reduce(False)  # audit row 26: a JIT / sgl_kernel all-reduce
    if backend == "gloo":  # SGLang would still open its own NCCL communicator per group (pynccl)
        make_group = parallel_state.init_model_parallel_group
        parallel_state.init_model_parallel_group = lambda *a, **k: make_group(*a, **{**k, "use_pynccl": False})
    # torch.distributed is already up (from run_ranks, on the same backend): SGLang builds its groups on it.
    init_distributed_environment(world_size=world, rank=rank, local_rank=device, backend=backend)
    initialize_model_parallel(backend=backend)
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


def build_model(sa, seed: int = 0):
    """SGLang's model class from config.json with seeded random weights made on this GPU, loaded
    through SGLang's `load_weights`; then the per-module pins of the audit (rows 1-4, 24)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA, DeepseekV32ForCausalLM
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM

    from helpers.sglang_cpu_stand_ins import _rope_native_any_rank
    from helpers.sglang_model_harness import random_checkpoint

    mc = ModelConfig.from_server_args(sa)
    cfg = json.load(open(os.path.join(sa.model_path, "config.json")))
    with set_default_torch_dtype(torch.bfloat16), torch.device("cuda"):
        arch = mc.hf_config.architectures[0]
        model = {c.__name__: c for c in (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM)}[arch](mc.hf_config)
    model.load_weights(iter(random_checkpoint(cfg, seed, device="cuda").items()))
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul)):
            m._forward_method = m.forward_native  # sgl_kernel / JIT kernels
        if isinstance(m, DeepseekScalingRotaryEmbedding):
            m._forward_method = _rope_native_any_rank(m)  # JIT rope kernel
        if isinstance(m, DeepseekV2AttentionMLA):
            m._use_min_latency_fused_a_gemm = False  # JIT fused-A GEMM -> cuBLAS
    gatherer = getattr(model.logits_processor, "_logits_gatherer", None)
    if gatherer is not None:
        gatherer._state = None  # NVLink multicast all-gather -> NCCL (multicast stays off here)
    return mc, model


def scratch_pages(context_len: int, chunk: int, cp_size: int) -> int:
    """What the plugin's configurator hook reserves at start-up for this context and chunk size."""
    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import dense_scratch_pages

    return dense_scratch_pages(context_len, chunk, PAGE, cp_size)


# ---- the correctness scenario ---------------------------------------------------------------------

# Contexts past index_topk (2048), so the indexer's top-k really selects. (request, new tokens).
CHECK_BATCHES = [
    [(0, 3000), (1, 1000)],  # cold prompts
    [(0, 2500), (1, 700)],  # continuations: prefixes ending mid-page
    # request 2 hits request 0's first 2048 cached tokens; request 0's third chunk; a new request
    [(2, 900), (0, 1800), (3, 500)],
]
CHECK_FORKS = {2: (2, 0, 2048)}  # before batch 2: request 2 starts with request 0's first 32 pages
CHECK_DECODE = [(0, 1), (1, 1), (2, 1), (3, 1)]
CHECK_MAX_LEN = 8192


def check_token_ids(vocab: int, seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(2, vocab, (CHECK_MAX_LEN,), generator=g) for i in range(4)}


def run_check(rank, world, group, model_path, mode, prefetch=True, kv_cache_dtype="bfloat16"):
    """One rank of the correctness scenario. mode: 'off' (1 GPU, no CP), 'replicated' (SGLang's
    CP, every rank keeps all KV) or 'shared' (the plugin, its dense scratch NaN as each batch
    begins); `kv_cache_dtype` bfloat16 or fp8_e4m3.
    Returns each batch's next-token logits
    (CPU), then the decode step's, which runs on a non-CP pool assembled from the owners' pages
    in the shared mode (what the owned-page PD transfer delivers to a decode instance)."""
    from helpers import sglang_model_harness as H

    cp = 1 if mode == "off" else world
    sa = setup_process(rank, world, model_path, cp, kv_cache_dtype)
    cp_group = None
    if mode == "shared":
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import get_parallel

        from sglang_nsa_cp.envs import envs
        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()
        setattr(sa, ATTR, True)
        os.environ[envs.SGLANG_NSA_CP_PREFETCH.name] = "1" if prefetch else "0"
        cp_group = get_parallel().attn_cp_group.device_group
    mc, model = build_model(sa)
    engine = H.Engine(
        sa,
        mc,
        model,
        pool_pages=256,
        cp_group=cp_group,
        max_len=CHECK_MAX_LEN,
        scratch_pages=scratch_pages(CHECK_MAX_LEN, CHECK_MAX_LEN, world),
    )
    if mode == "shared":
        H.poison_scratch_each_batch(engine.pool.prefetcher)  # as the CPU forward test does
    engine.init_requests(seed=3)
    toks = check_token_ids(mc.hf_config.vocab_size)
    logits = []
    for b, batch in enumerate(CHECK_BATCHES):
        if b in CHECK_FORKS:
            idx, source, length = CHECK_FORKS[b]
            engine.requests.fork(idx, source=source, length=length)
        logits.append(engine.run(engine.forward_batch(batch, toks)))
    info = {"pool": type(engine.pool).__name__, "pool_dtype": str(engine.pool.dtype)}
    if mode == "shared":
        info["early"] = engine.pool.prefetcher.early
        engine.pool.end_shard_extend()
        engine.rebind_pool(H._replicated_pool_from_owners(engine))
    # what a decode instance holds after the prefill batches (PD: the pages it receives): a digest per layer
    import hashlib

    info["decode_pool_digests"] = [
        hashlib.sha256(buf.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for buf in engine.pool.kv_buffer
    ]
    logits.append(engine.run(engine.forward_batch(CHECK_DECODE, toks, decode=True)))
    from helpers import gpu_stand_ins

    info["stand_ins"] = gpu_stand_ins.report()
    return dict(logits=logits, **info)
