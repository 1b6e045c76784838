"""Drive SGLang 0.5.23's own DSA model forward (`DeepseekV32ForCausalLM`) on CPU.

Used by test_sglang_model_forward.py; see docs/sglang_cpu_forward.md for what is SGLang's own
code and what is replaced (and why). The CPU stand-ins themselves live in sglang_cpu_stand_ins.py
(shared with the real-server test's plugin). Every function here runs inside one rank process
(spawned by `helpers.distributed.run_ranks`), after TRITON_INTERPRET=1 and SGLang's torch-fallback
switches are set (`ENV`).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from unittest import mock

from helpers import sglang_cpu_stand_ins as stand_ins
import torch
from helpers.paged_requests import PagedRequests, RotatedPagedRequests, logical_pool_pages

PAGE = 64
ENV = stand_ins.ENV

# Tiny DeepSeek-V3.2: real DSA shapes where kernels fix them (kv_lora_rank 512 + rope 64 = the
# 576-value latent row, index_head_dim 128, page 64), tiny elsewhere. first_k_dense_replace =
# num_hidden_layers: every layer has a dense MLP (no fused MoE kernel on CPU). index_topk 32 is
# shorter than the contexts used, so the indexer's top-k really selects.
TINY_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64, "v_head_dim": 32, "index_topk": 32, "index_head_dim": 128, "index_n_heads": 2,
    "vocab_size": 128, "max_position_embeddings": 1024, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "hidden_act": "silu", "attention_bias": False,
    "rope_scaling": {"rope_type": "deepseek_yarn", "type": "yarn", "factor": 1.0,
                     "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


def random_checkpoint(cfg: dict, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """HF-format weights of the model (names as in DeepSeek-V3.2's safetensors), made on `device`."""
    g = torch.Generator(device).manual_seed(seed)
    h, heads, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kvl, rope, ql = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"]
    ih, inh, inter = cfg["index_head_dim"], cfg["index_n_heads"], cfg["intermediate_size"]

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(cfg["vocab_size"], h, scale=1.0), "model.norm.weight": norm(h),
          "lm_head.weight": w(cfg["vocab_size"], h)}  # fmt: skip
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_a_proj.weight": w(ql, h), p + "self_attn.q_a_layernorm.weight": norm(ql),
            p + "self_attn.q_b_proj.weight": w(heads * qk, ql),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(kvl + rope, h),
            p + "self_attn.kv_a_layernorm.weight": norm(kvl),
            p + "self_attn.kv_b_proj.weight": w(heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvl),
            p + "self_attn.o_proj.weight": w(h, heads * cfg["v_head_dim"]),
            p + "self_attn.indexer.wq_b.weight": w(inh * ih, ql), p + "self_attn.indexer.wk.weight": w(ih, h),
            p + "self_attn.indexer.k_norm.weight": norm(ih), p + "self_attn.indexer.k_norm.bias": w(ih, scale=0.1),
            p + "self_attn.indexer.weights_proj.weight": w(inh, h),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })  # fmt: skip
    return sd


# The same model as GLM-5 (`GlmMoeDsaForCausalLM` subclasses SGLang's DeepseekV2ForCausalLM).
TINY_GLM5 = dict(TINY_V32, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa")


def write_checkpoint(path: str, cfg: dict = TINY_V32, seed: int = 0, tensors=random_checkpoint) -> str:
    """config.json and model.safetensors of `tensors(cfg, seed)` in `path`; returns `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors(cfg, seed), os.path.join(path, "model.safetensors"))
    return path


# ---- process setup ---------------------------------------------------------------------------------


def setup_process(
    rank: int, world: int, model_path: str, cp_size: int, kv_cache_dtype: str = "bfloat16", **server_args
):
    """Publish ServerArgs, build SGLang's process groups (gloo) and the model with random weights.
    `kv_cache_dtype` "fp8_e4m3": SGLang's fp8 DSA pool (656-byte FlashMLA rows); `server_args`:
    more ServerArgs fields (HiCache's, for instance), or other values of the defaults
    (`dsa_prefill_backend="flashmla_sparse_q8"`)."""
    for k, v in ENV.items():
        os.environ[k] = v
    stand_ins.install_process_stand_ins()
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path=model_path, device="cpu", attention_backend="dsa", kv_cache_dtype=kv_cache_dtype,
              dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_sparse", dsa_topk_backend="torch",
              skip_tokenizer_init=True, tp_size=world, moe_dense_tp_size=1)  # fmt: skip
    if cp_size > 1:
        kw.update(enable_prefill_cp=True, cp_strategy="interleave", attn_cp_size=cp_size)
    sa = ServerArgs(**kw | server_args)  # server_args may also replace a default above
    reset_context()
    with mock.patch("torch.cuda.get_device_capability", lambda *a, **k: stand_ins.SM90):  # resolution reads the SM
        publish(sa, role="test", ranks=SpawnRanks(world_rank=rank))
    # torch.distributed is already up (gloo, from run_ranks): SGLang builds its groups on it.
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(backend="gloo")
    return sa


def build_model(sa, seed: int = 0):
    """SGLang's `DeepseekV32ForCausalLM` from the checkpoint, with the CPU stand-ins of
    docs/sglang_cpu_forward.md applied to its indexer and rope modules."""
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM

    mc = ModelConfig.from_server_args(sa)
    torch.manual_seed(seed)
    with set_default_torch_dtype(torch.bfloat16):  # as SGLang's model loader builds it
        arch = mc.hf_config.architectures[0]
        model = {c.__name__: c for c in (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM)}[arch](mc.hf_config)
    weights = load_file(os.path.join(sa.model_path, "model.safetensors"))
    model.load_weights(iter(weights.items()))  # SGLang's loader (fuses q_a/kv_a, gate/up; post_load_weights)
    stand_ins.patch_model(model)
    return mc, model


# ---- the pools, the backend, the batch -------------------------------------------------------------


def kv_pool_format(sa, mc) -> tuple[torch.dtype, int]:
    """The pool's dtype and row width, the row width from SGLang's KV configurator: bf16 rows of
    kv_lora_rank + rope values, or fp8_e4m3's 656-byte FlashMLA rows."""
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    dtype = torch.float8_e4m3fn if sa.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    return dtype, calculate_mla_kv_cache_dim(model_config=mc, kv_cache_dtype=dtype)


class Engine:
    """One rank's model, KV pool, DSA backend and request table: what SGLang's ModelRunner holds."""

    def __init__(self, sa, mc, model, pool_pages: int, max_len: int = 1024, layer_num=None):
        cfg = mc.hf_config
        self.sa, self.mc, self.model = sa, mc, model
        self.device = torch.device("cuda", torch.cuda.current_device()) if sa.device == "cuda" else torch.device("cpu")
        self.kv_dtype, kv_cache_dim = kv_pool_format(sa, mc)
        kw = dict(page_size=PAGE, kv_lora_rank=cfg.kv_lora_rank, dtype=self.kv_dtype,
                  qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=layer_num or cfg.num_hidden_layers, device=self.device,
                  index_head_dim=cfg.index_head_dim, enable_memory_saver=False, kv_cache_dim=kv_cache_dim)  # fmt: skip
        self.pool = self.make_pool(kw, pool_pages)
        self.pool_bytes = self.pool.get_kv_size_bytes()
        self.trace = []  # per forward: whether SGLang's CP path ran, rows handed to the logits
        self.req_to_token = torch.zeros((8, max_len), dtype=torch.int32, device=self.device)
        self.req_to_token_pool = SimpleNamespace(req_to_token=self.req_to_token, size=8)
        self.rebind_pool(self.pool)

    def make_pool(self, kw, pool_pages):
        """SGLang's unsharded `DSATokenToKVPool` of `pool_pages` pages (`RotatedEngine`: sharded)."""
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        return DSATokenToKVPool(size=pool_pages * PAGE, **kw)

    def rebind_pool(self, pool):
        """(Re)build SGLang's DSA backend over `pool`, as ModelRunner does at start-up."""
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

        self.pool = pool
        runner = SimpleNamespace(
            device=self.device.type, page_size=PAGE, model_config=self.mc, token_to_kv_pool=pool,
            req_to_token_pool=self.req_to_token_pool, is_draft_worker=False, hisparse_coordinator=None,
            kv_cache_dtype=self.kv_dtype, server_args=self.sa, model=self.model,
        )  # fmt: skip
        with mock.patch("torch.cuda.get_device_capability", lambda *a, **k: stand_ins.SM90):
            self.backend = DeepseekSparseAttnBackend(runner)
        runner.attn_backend = self.backend
        self.runner = runner

    def init_requests(self, seed: int):
        self.requests = PagedRequests(self.req_to_token, self.pool.size // PAGE, PAGE, seed)

    def forward_batch(self, batch, token_ids, decode=False):
        """SGLang's ForwardBatch for `batch` = [(request index, new tokens)]; `token_ids[idx]` the
        request's whole token sequence."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        dev = self.device
        prefix, seq, loc = self.requests.extend(batch)
        extend = [s - p for s, p in zip(seq, prefix)]
        ids = torch.cat([token_ids[i][p:s] for (i, _), p, s in zip(batch, prefix, seq)]).to(dev)
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(dev)
        seq_t = torch.tensor(seq)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(batch),
            input_ids=ids,
            req_pool_indices=torch.tensor([i for i, _ in batch], device=dev),
            seq_lens=seq_t.to(dev),
            out_cache_loc=loc.to(dev),
            seq_lens_sum=int(seq_t.sum()),
            seq_lens_cpu=seq_t.clone(),
            positions=positions,
            return_logprob=False,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        if not decode:
            fb.extend_num_tokens = int(sum(extend))
            fb.extend_seq_lens = torch.tensor(extend, device=dev)
            fb.extend_prefix_lens = torch.tensor(prefix, device=dev)
            fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
            fb.extend_seq_lens_cpu = list(extend)
            fb.extend_prefix_lens_cpu = list(prefix)
            fb.extend_logprob_start_lens_cpu = list(extend)
        return fb

    def run(self, fb):
        """The batch's next-token logits (float32, on the CPU)."""
        return self.run_output(fb).next_token_logits.float().cpu()

    def run_output(self, fb):
        """SGLang's EagerRunner._execute_extend / _execute_decode, minus its load/timer plumbing:
        the logits processor's output."""
        from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.model_executor.runner.eager_runner import EagerRunner
        from sglang.srt.runtime_context import get_parallel

        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.backend), forward_batch=fb):
            cp_active = fb.forward_mode.is_extend() and is_cp_active(fb)
            self.trace.append({"cp_active": cp_active})
            if cp_active:
                prepare_cp_forward(fb)
            self.backend.init_forward_metadata(fb)
            if not cp_active:
                fb.attn_cp_metadata = None
            if cp_active and not get_parallel().enable_cp_tp_group_sharing:
                out = EagerRunner._execute_extend_cp(SimpleNamespace(model_runner=self.runner), fb, {})
            else:
                out = self.model.forward(fb.input_ids, fb.positions, fb)
        return out


# ---- one rank's scenario ---------------------------------------------------------------------------

MAX_TOKENS = 256


def token_ids(seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(2, TINY_V32["vocab_size"], (MAX_TOKENS,), generator=g) for i in range(4)}


def _record_tail_rows(engine):
    """Wrap the plugin's narrow tail gather (when loaded) to record how many last-token rows it
    gathered for the logits processor in each batch (SGLang's own gather moves every token's)."""
    from sglang_nsa_cp.sglang_ext.layers.cp import utils as tail

    inner = tail.gather_last_token_hidden

    def recorded(*args, **kwargs):
        out = inner(*args, **kwargs)
        engine.trace[-1]["tail_rows"] = int(out.shape[0])
        return out

    tail.gather_last_token_hidden = recorded


_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)


def record_collectives() -> list:
    """Wrap torch.distributed's collectives in this process: every call is appended, in issue
    order, as (name, shape, dtype, ranks of the group). SGLang's GroupCoordinator (its CPU
    branch) and our `comm` look them up per call."""
    import torch.distributed as dist

    log = []
    for name in _COLLECTIVES:
        inner = getattr(dist, name)

        def recorded(*args, _name=name, _inner=inner, **kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
            log.append(
                (_name, tuple(tensor.shape) if tensor is not None else None, str(getattr(tensor, "dtype", "")), ranks)
            )
            return _inner(*args, **kwargs)

        setattr(dist, name, recorded)
    return log


# ---- SGLang's page-interleaved pool (the rebased plugin) -----------------------------------------


def as_sglang_builds(pool):
    """`pool` as SGLang's KV configurator hands it out, through the plugin's AFTER hook on
    `_build_token_to_kv_pool` (the plugin's subclass with the flag's decision, else SGLang's class)."""
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import adopt_sharded_dsa_pool

    return adopt_sharded_dsa_pool(pool)


def shard_spec(rank: int, shard_size: int, context_len: int, chunk_tokens: int, contexts: int):
    """SGLang's `PageShardSpec` for a scratch of `contexts` contexts plus one chunk, sized by the
    plugin's `scratch_spec` (what its `make_page_shard_spec` hook gives a server)."""
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave import scratch_spec

    base = PageShardSpec(rank, shard_size, PAGE, max_prefix_tokens=0, chunk_tokens=0)
    return scratch_spec(base, context_len=context_len, chunk_tokens=chunk_tokens, contexts=contexts)


class RotatedEngine(Engine):
    """An `Engine` whose requests take pages from SGLang's owner-rotating allocator (N =
    `shard_size`), over `pages_per_rank` pages per rank. `sharded`: SGLang's page-interleaved DSA
    pool (the plugin's subclass once the plugin is loaded) bound to the CP group, with a scratch
    of `scratch_contexts` contexts of `max_len` tokens plus a chunk of `chunk_tokens`; otherwise
    SGLang's `DSATokenToKVPool` over every logical page the allocator can hand out."""

    def __init__(self, sa, mc, model, pages_per_rank: int, shard_size: int, sharded: bool, max_len: int = 1024,
                 chunk_tokens: int = 512, scratch_contexts: int = 1):  # fmt: skip
        self.pages_per_rank, self.shard_size = pages_per_rank, shard_size
        self._sharded = (max_len, chunk_tokens, scratch_contexts) if sharded else None
        super().__init__(sa, mc, model, pool_pages=logical_pool_pages(pages_per_rank, shard_size) - 1, max_len=max_len)

    def make_pool(self, kw, pool_pages):
        if self._sharded is None:
            return super().make_pool(kw, pool_pages)
        from sglang.srt.mem_cache import page_interleave_pool
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().attn_cp_group
        spec = shard_spec(group.rank_in_group, group.world_size, *self._sharded)
        pool_class = page_interleave_pool.PageInterleaveDSATokenToKVPool
        return as_sglang_builds(pool_class(size=self.pages_per_rank * PAGE, **kw, shard_spec=spec, shard_group=group))

    def init_requests(self, seed: int = 0):
        sharded = dict(kvcache=self.pool, shard_spec=self.pool.shard_spec) if self._sharded else {}
        self.requests = RotatedPagedRequests(self.req_to_token, self.pages_per_rank, PAGE, self.shard_size, **sharded)


# Prefill batches (request index, new tokens), then one decode step. Extends start page-aligned,
# as SGLang's scheduler makes them under KV sharding (radix matches are whole pages, chunks end on
# pages).
ROTATED_BATCHES = [
    [(0, 128), (1, 9)],  # new requests (no history)
    [(0, 64), (2, 70)],  # request 0's second chunk (two cached pages); a new request
    # request 3 shares request 0's first two pages (radix hit); request 0's third chunk; a new request
    [(3, 5), (0, 40), (4, 1)],
]
ROTATED_FORK = (2, 3, 0, 2 * PAGE)  # before batch 2: request 3 starts with request 0's first 128 tokens
ROTATED_DECODE = [(i, 1) for i in range(5)]
PAGES_PER_RANK = 16


def rotated_token_ids(seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = {i: torch.randint(2, TINY_V32["vocab_size"], (MAX_TOKENS,), generator=g) for i in range(5)}
    _, idx, source, length = ROTATED_FORK
    ids[idx][:length] = ids[source][:length]
    return ids


def poison_gather_scratch(pool) -> None:
    """Fill the sharded pool's gather scratch with 0xFF bytes (NaN as bf16, fp8 and fp32) as each
    batch begins: stale memory may hold NaN, so SGLang's forward must read no scratch row the pool
    did not write in this batch in a way that reaches the logits."""
    begin = pool.begin_shard_extend

    def poisoned_begin(*args, **kwargs):
        for slot in pool._slots:
            for t in slot.tensors.values():
                t.view(torch.uint8).fill_(0xFF)
        begin(*args, **kwargs)

    pool.begin_shard_extend = poisoned_begin


def count_history_gathers(pool) -> dict:
    """Calls and bytes of the pool's history all-gathers (through its PyNccl communicator)."""
    counts = {"calls": 0, "bytes": 0}
    inner = pool.kv_gather_comm.all_gather

    def counted(output_tensor, input_tensor, *args, **kwargs):
        counts["calls"] += 1
        counts["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return inner(output_tensor, input_tensor, *args, **kwargs)

    pool.kv_gather_comm.all_gather = counted
    return counts


def count_fp8_quantizations() -> dict:
    """Calls of SGLang's fp8 KV quantizer (`quantize_k_cache_separate`, where SGLang's pools and the
    plugin's fused store's torch reference look it up; CPU tensors take that reference)."""
    from sglang.srt.mem_cache import memory_pool

    counts = {"calls": 0}
    inner = memory_pool.quantize_k_cache_separate

    def counted(*args, **kwargs):
        counts["calls"] += 1
        return inner(*args, **kwargs)

    memory_pool.quantize_k_cache_separate = counted
    return counts


def _decode_pool_from_page_owners(engine):
    """What the owned-page PD transfer hands a non-CP decode instance from SGLang's sharded pool:
    every logical page p from rank p % N's local page p // N, in SGLang's unmodified pool."""
    import torch.distributed as dist
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    shared, n = engine.pool, engine.shard_size
    pages = logical_pool_pages(engine.pages_per_rank, n)
    full = DSATokenToKVPool(
        size=(pages - 1) * PAGE, page_size=PAGE, kv_lora_rank=shared.kv_lora_rank, dtype=shared.dtype,
        qk_rope_head_dim=shared.qk_rope_head_dim, layer_num=shared.layer_num, device=engine.device,
        index_head_dim=128, enable_memory_saver=False, kv_cache_dim=shared.kv_cache_dim,
    )  # fmt: skip
    local_pages = engine.pages_per_rank + 1  # SGLang's pool: size + one page
    for layer in range(shared.layer_num):
        for src, dst in ((shared.kv_buffer[layer].view(local_pages, -1), full.kv_buffer[layer].view(pages, -1)),
                         (shared.index_k_with_scale_buffer[layer], full.index_k_with_scale_buffer[layer])):  # fmt: skip
            mine = src[:local_pages].contiguous()
            gathered = mine.new_empty((n * local_pages, *mine.shape[1:]))
            dist.all_gather_into_tensor(
                gathered.view(torch.uint8), mine.view(torch.uint8), group=shared.shard_group.cpu_group
            )
            gathered = gathered.view(n, local_pages, -1)
            logical = torch.arange(n, pages, device=gathered.device)  # pages 0..N-1: SGLang's padding pages
            dst[n:pages] = gathered[logical % n, logical // n]
    return full


def count_prefill_kernel_calls() -> dict:
    """Calls of the sparse prefill kernels' stand-ins (FlashMLA's `flash_mla_sparse_fwd`, the
    `flashmla_sparse_q8` JIT kernel), by `--dsa-prefill-backend` name: which one SGLang ran."""
    import sys

    counts = {"flashmla_sparse": 0, "flashmla_sparse_q8": 0}
    for name, module, attr in (
        ("flashmla_sparse", "sglang.kernels.ops.attention.flash_mla_interface", "flash_mla_sparse_fwd"),
        ("flashmla_sparse_q8", stand_ins.Q8KV8_MODULE, "sparse_mla_q8kv8_prefill_fwd"),
    ):
        inner = getattr(sys.modules[module], attr)

        def counted(*args, _name=name, _inner=inner, **kwargs):
            counts[_name] += 1
            return _inner(*args, **kwargs)

        setattr(sys.modules[module], attr, counted)
    return counts


def run_rotated_scenario(
    rank, world, group, model_path, mode, kv_cache_dtype="bfloat16", plugin=True, prefill_backend="flashmla_sparse"
):
    """The rotated-page scenario. mode: 'off' (1 rank), 'replicated' (SGLang's CP) or 'sharded'
    (SGLang's page-interleaved pool, its scratch poisoned as each batch begins; `plugin`: with the
    plugin loaded and enabled, so the pool is the plugin's subclass and the narrow tail gather
    runs). Returns each batch's next-token logits, every collective the rank issued, the history
    gathers and the decode pool's latent bytes per layer (sharded: assembled from page owners).
    `prefill_backend`: SGLang's `--dsa-prefill-backend` (the decode step stays on flashmla_sparse)."""
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    sa = setup_process(
        rank, world, model_path, 1 if mode == "off" else world, kv_cache_dtype, dsa_prefill_backend=prefill_backend
    )
    if mode == "sharded" and plugin:
        from sglang.srt.plugins import load_plugins

        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()  # the plugin's entry point, as every SGLang process does
        setattr(sa, ATTR, True)  # the decision its start-up validation writes (see docs)
    mc, model = build_model(sa)
    engine = RotatedEngine(sa, mc, model, PAGES_PER_RANK, shard_size=world, sharded=mode == "sharded")
    info = dict(pool=type(engine.pool).__name__, pool_module=type(engine.pool).__module__)
    if mode == "sharded":
        poison_gather_scratch(engine.pool)
        gathers = count_history_gathers(engine.pool)
    quantizations = count_fp8_quantizations()
    kernel_calls = count_prefill_kernel_calls()
    collectives = record_collectives()
    _record_tail_rows(engine)
    engine.init_requests()
    toks = rotated_token_ids()
    logits = []
    for b, batch in enumerate(ROTATED_BATCHES):
        if b == ROTATED_FORK[0]:
            engine.requests.fork(*ROTATED_FORK[1:])
        logits.append(engine.run(engine.forward_batch(batch, toks)))
        if mode == "sharded":
            engine.trace[-1].update(history=engine.pool._block_pages > 0)
    info["collectives"] = list(collectives)
    info["fp8_quantizations"] = quantizations["calls"]  # in the prefill batches
    info["prefill_kernel_calls"] = dict(kernel_calls)
    if mode == "sharded":
        info["gathered"] = dict(gathers)
        engine.pool.end_shard_extend()
        engine.rebind_pool(_decode_pool_from_page_owners(engine))
    info["decode_pool_latent"] = [buf.view(torch.uint8).clone() for buf in engine.pool.kv_buffer]
    logits.append(engine.run(engine.forward_batch(ROTATED_DECODE, toks, decode=True)))
    out = dict(logits=logits, pool_bytes=int(engine.pool_bytes), trace=engine.trace, **info)
    destroy_model_parallel()
    destroy_distributed_environment()
    return out
