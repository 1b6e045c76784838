"""CPU stand-ins for the CUDA-only pieces of SGLang 0.5.23's DSA model path, and the test-only
SGLang plugin that installs them in every process of a real server.

Two users, one set of stand-ins:
- `sglang_model_harness.py` drives SGLang's model forward directly in spawned ranks: it calls
  `install_process_stand_ins()` before building the model and `patch_model(model)` after.
- `register()` is the entry point of a test-only SGLang plugin (`sglang.srt.plugins` group, name
  `cpu_stand_ins`), which `sglang_servers.py` exposes to server processes through a dist-info it
  writes into a temporary folder on PYTHONPATH; it is never installed into the venv, so the
  product plugin and every other test run without it.

Every stand-in is listed, with its reason, in docs/sglang_cpu_forward.md (model path) and
docs/sglang_cpu_server.md (server path). None of them touches `sglang_nsa_cp`, except that the
server plugin relaxes the product plugin's `--device cuda` start-up requirement.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import inspect
import os
import sys
import textwrap
import types

import torch

# SGLang's own CPU fallbacks: torch fp8 (paged) MQA logits, unfused torch top-k. Must be in the
# environment before sglang (which imports triton) is imported.
ENV = {
    "TRITON_INTERPRET": "1",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_DSA_FUSE_TOPK": "0",
    "TORCHDYNAMO_DISABLE": "1",  # SGLang's @torch.compile helpers run eagerly (no C++ inductor build on 2 cores)
}
SM90 = (9, 0)


# ---- kernels SGLang has no CPU path for -----------------------------------------------------------


def sparse_mla_reference(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """Stands in for FlashMLA's `flash_mla_sparse_fwd` (CUDA only; SGLang has no torch path):
    q [s_q, h, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk] (-1 = unused) -> o [s_q, h, d_v].
    Unused entries (-1, or past topk_length) read nothing, as in the kernel.
    kv may also be an fp8 pool's 656-byte FlashMLA rows (SGLang hands the pool to the decode kernel
    as it is; on CUDA an fp8 pool decodes with flashmla_kv, whose kernel dequantizes each row the
    same way): they are dequantized to bf16 first."""
    assert attn_sink is None
    if kv.dtype == torch.float8_e4m3fn:
        kv = _dequantize_flashmla_rows(kv)
    idx = indices[:, 0].long()
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1])[None, :] < topk_length.long()[:, None]
    keys = kv[:, 0].float()[idx.clamp(min=0)]  # [s_q, topk, d_qk]
    # FlashMLA's kernel skips invalid entries: what row they would gather (NaN too) contributes nothing.
    keys = keys.masked_fill(~valid[..., None], 0.0)
    logits = torch.einsum("qhd,qkd->qhk", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("qhk,qkd->qhd", p, keys[..., :d_v])
    return o.to(q.dtype), logits.amax(-1), lse


Q8KV8_MODULE = "sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90"


def sparse_mla_q8kv8_reference(q, kv, indices, sm_scale, q_scale, kv_scale, d_v=512, attn_sink=None,
                               topk_length=None, *, out=None, max_logits=None, lse=None):  # fmt: skip
    """Stands in for SGLang's `sparse_mla_q8kv8_prefill_fwd` (`flashmla_sparse_q8`'s SM90 JIT kernel,
    CUDA only): q [s_q, h, 576] e4m3 (h a multiple of 64), kv [s_kv, 1, 576] e4m3 whose last `topk`
    rows are the zero landing pad, indices [s_q, 1, topk] int32 (-1 = unused, topk % 128 == 0) ->
    (o [s_q, h, d_v] bf16, max_logits, lse [s_q, h] fp32). The kernel's math in fp32: logits =
    (q . k) x q_scale x kv_scale x sm_scale over valid entries (-1 and past `topk_length` masked,
    as its is_kv_valid mask does), p = exp(logit - max) cast to e4m3 for the PV product (its fp8
    P), divided by the fp32 sum of p. Not bit-equal to the kernel (its online softmax rescales per
    64-entry block); q and kv come from SGLang's prep kernels (on CPU their torch twins, below).
    Queries go in blocks of 256 (bounded memory at GLM-5's shapes on the GPU)."""
    assert attn_sink is None
    for name, t in (("q", q), ("kv", kv)):
        assert t.dtype == torch.float8_e4m3fn and t.is_contiguous(), f"{name}: {t.dtype}, {t.is_contiguous()=}"
    assert q.shape[1] % 64 == 0 and indices.shape[-1] % 128 == 0, f"q {tuple(q.shape)}, indices {tuple(indices.shape)}"
    assert indices.dtype == torch.int32, indices.dtype
    blocks = [
        _q8kv8_block(q[i : i + 256], kv, indices[i : i + 256], sm_scale, q_scale, kv_scale, d_v,
                     None if topk_length is None else topk_length[i : i + 256])
        for i in range(0, q.shape[0], 256)
    ]  # fmt: skip
    assert blocks, "no queries"
    results = [torch.cat(parts) for parts in zip(*blocks)]
    if out is None:
        return tuple(results)
    for buf, value in zip((out, max_logits, lse), results):
        buf.copy_(value)
    return out, max_logits, lse


def _q8kv8_block(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, topk_length):
    idx = indices[:, 0].long()
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < topk_length.long()[:, None]
    keys = kv[:, 0].float()[idx.clamp(min=0)] * kv_scale.float()  # [s_q, topk, d_qk]
    logits = torch.einsum("qhd,qkd->qhk", q.float() * q_scale.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    row_max = logits.amax(-1)
    p = torch.exp(logits - row_max[..., None]).nan_to_num(0.0)
    total = p.sum(-1)
    o = torch.einsum("qhk,qkd->qhd", p.to(torch.float8_e4m3fn).float(), keys[..., :d_v]) / total[..., None]
    return o.nan_to_num(0.0).to(torch.bfloat16), row_max, torch.log(total) + row_max


def _store_cast_e4m3(x):
    """Triton's store-cast to e4m3 on CUDA (cvt.rn.satfinite): round to nearest even, saturating at
    +-448 where torch's cast would give NaN."""
    fp8 = torch.finfo(torch.float8_e4m3fn)
    return x.float().clamp(fp8.min, fp8.max).to(torch.float8_e4m3fn)


def concat_and_cast_q_fp8_pad_torch(q_fp8_pad, q_nope, q_rope, num_heads):
    """SGLang's `concat_and_cast_q_fp8_pad` (Triton, one program per token) in torch: q_nope
    [T, H, nope] and q_rope [T, H, rope] bf16 store-cast into q_fp8_pad[:, :H] [T, pad_heads,
    nope + rope] e4m3; the pad heads are left as they are."""
    nope = q_nope.shape[-1]
    q_fp8_pad[:, :num_heads, :nope] = _store_cast_e4m3(q_nope)
    q_fp8_pad[:, :num_heads, nope:] = _store_cast_e4m3(q_rope)


def gather_cast_kv_fp8_pad_paged_torch(out, kv_cache, page_table_1_flattened, nope_dim):
    """SGLang's `gather_cast_kv_fp8_pad_paged` (a bf16 pool's prefix for flashmla_sparse_q8;
    Triton `get_mla_kv_buffer_kernel`, one program per token) in torch: out[:n] = e4m3(bf16 rows
    of kv_cache [slots, 1, 576] at page_table_1_flattened [n]), out[n:] = 0 (the landing pad)."""
    n = page_table_1_flattened.shape[0]
    out[:n] = _store_cast_e4m3(kv_cache.view(-1, kv_cache.shape[-1])[page_table_1_flattened.long()])
    out[n:].view(torch.uint8).zero_()
    return out


def gather_dequant_requant_fp8_paged_dsa_torch(quant_k_cache, page_table_1_flattened, group_size=128,
                                               extra_rows=0, out=None):  # fmt: skip
    """SGLang's `gather_dequant_requant_fp8_paged_dsa` (an fp8 pool's prefix for
    flashmla_sparse_q8; Triton) in torch, same math: the 656-byte FlashMLA rows at
    page_table_1_flattened, codes x fp32 group scale -> e4m3, rope bf16 -> e4m3; then
    `extra_rows` zero rows. Returns [n + extra_rows, 1, 576] e4m3 (in `out` when given)."""
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import _infer_dsa_dims

    dim_quant = quant_k_cache.shape[-1]
    nope, rope = _infer_dsa_dims(dim_quant, group_size)
    tiles = nope // group_size
    rows = quant_k_cache.view(torch.uint8).reshape(-1, dim_quant)[page_table_1_flattened.long()]
    codes = rows[:, :nope].view(torch.float8_e4m3fn).float().view(-1, tiles, group_size)
    scale = rows[:, nope : nope + 4 * tiles].contiguous().view(torch.float32)
    rope_bf16 = rows[:, nope + 4 * tiles :].contiguous().view(torch.bfloat16)
    n, total = rows.shape[0], rows.shape[0] + extra_rows
    output = out.view(total, 1, nope + rope) if out is not None else quant_k_cache.new_empty((total, 1, nope + rope))
    output[:n, 0, :nope] = _store_cast_e4m3((codes * scale[..., None]).view(n, nope))
    output[:n, 0, nope:] = _store_cast_e4m3(rope_bf16)
    output[n:].view(torch.uint8).zero_()
    return output


def install_q8_stand_ins():
    """`flashmla_sparse_q8`'s q and KV prep kernels (Triton; the interpreter runs them at ~30 ms
    per token program, minutes per forward, and its fp8 cast rounds wrongly) -> their torch twins,
    where SGLang's DSA backend looks them up; its attention kernel (JIT, CUDA only) ->
    `sparse_mla_q8kv8_reference`."""
    from sglang.srt.layers.attention import dsa_backend

    q8kv8 = types.ModuleType(Q8KV8_MODULE)
    q8kv8.sparse_mla_q8kv8_prefill_fwd = sparse_mla_q8kv8_reference
    sys.modules[q8kv8.__name__] = q8kv8  # the real module reads torch's CUDA stream API at import
    dsa_backend.concat_and_cast_q_fp8_pad = concat_and_cast_q_fp8_pad_torch
    dsa_backend.gather_cast_kv_fp8_pad_paged = gather_cast_kv_fp8_pad_paged_torch
    dsa_backend.gather_dequant_requant_fp8_paged_dsa = gather_dequant_requant_fp8_paged_dsa_torch


def _dequantize_flashmla_rows(kv):
    """[s_kv, 1, 656] fp8 FlashMLA rows (512 e4m3 values, 4 fp32 scales, 64 bf16 rope) -> bf16 [s_kv, 1, 576]."""
    rows = kv.view(torch.uint8).reshape(kv.shape[0], -1)
    nope = rows[:, :512].view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16)
    return torch.cat([(nope * scale[..., None]).view(-1, 512).to(torch.bfloat16), rope], dim=1).unsqueeze(1)


def quantize_k_cache_separate_torch(k_nope, k_rope, tile_size: int = 128):
    """SGLang's `quantize_k_cache_separate` (its Triton kernel `_quantize_k_cache_fast_kernel`)
    with the same fp32 math in torch: scale = amax / 448 per 128 values, codes = clamp(x * (1 /
    scale)) as e4m3, rope bf16 bytes. Returns (nope_part [T, 1, 528], rope_part [T, 1, 128]) uint8.
    Bit-equal to the kernel (`test_sglang_ext_pool.py` checks it); the Triton interpreter runs the
    kernel at ~20 ms per (token, 128 values) program, too slow for the forward tests."""
    nope = (k_nope.squeeze(1) if k_nope.ndim == 3 else k_nope).float()
    rope = k_rope.squeeze(1) if k_rope.ndim == 3 else k_rope
    t, d = nope.shape
    blocks = nope.view(t, d // tile_size, tile_size)
    scale = blocks.abs().amax(dim=-1) / torch.finfo(torch.float8_e4m3fn).max
    fp8 = torch.finfo(torch.float8_e4m3fn)
    codes = (blocks * (1.0 / scale)[..., None]).clamp(fp8.min, fp8.max).to(torch.float8_e4m3fn)
    nope_part = torch.cat([codes.view(torch.uint8).view(t, d), scale.contiguous().view(torch.uint8)], dim=1)
    rope_part = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


def dequantize_k_cache_paged_torch(quant_k_cache, page_table_1_flattened, group_size: int = 128):
    """SGLang's `dequantize_k_cache_paged_dsa` (Triton) in torch, same math: the FlashMLA rows at
    `page_table_1_flattened`, codes x fp32 scale -> bf16, rope copied; [n, 1, 576] bf16."""
    rows = quant_k_cache.view(torch.uint8).reshape(-1, quant_k_cache.shape[-1])[page_table_1_flattened.long()]
    return _dequantize_flashmla_rows(rows.view(torch.float8_e4m3fn).unsqueeze(1))


def pad_ragged_topk_offsets():
    """`DeepseekSparseAttnBackend.forward_extend`, RAGGED top-k transform (an fp8 KV cache with
    flashmla_sparse) with SGLang's unfused top-k: under interleave CP a rank's queries are padded
    to the physical length (79 tokens at CP=2: 40 rows on both ranks), `_pad_topk_indices` pads the
    top-k rows to that, but `topk_indices_offset` (one row per real query, from the local
    extend lengths) is not, so the add fails ("size of tensor a (40) must match ... (39)") on the
    replicated path and ours alike. The fused top-k of CUDA deployments (sgl-kernel) never takes
    this line. Stand-in: pad the offsets with zeros to the top-k rows (the padded rows are -1, so
    the offsets they get are masked out)."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    if getattr(DeepseekSparseAttnBackend.forward_extend, "_ragged_offsets_padded", False):
        return
    _patch_source(
        DeepseekSparseAttnBackend, "forward_extend",
        "mask, topk_indices + topk_indices_offset, topk_indices",
        "mask, topk_indices + torch.nn.functional.pad(topk_indices_offset, (0, 0, 0, topk_indices.shape[0] - topk_indices_offset.shape[0])), topk_indices",
    )  # fmt: skip
    DeepseekSparseAttnBackend.forward_extend._ragged_offsets_padded = True


def install_fp8_kv_stand_ins():
    """SGLang's fp8 KV quantizer and prefix dequantizer (Triton) -> their torch twins, where
    SGLang's pool, the plugin's pool (through `memory_pool`) and the DSA backend look them up."""
    from sglang.srt.layers.attention import dsa_backend
    from sglang.srt.mem_cache import memory_pool, page_interleave_pool

    memory_pool.quantize_k_cache_separate = quantize_k_cache_separate_torch
    dsa_backend.dequantize_k_cache_paged_dsa = dequantize_k_cache_paged_torch
    page_interleave_pool.dequantize_k_cache_paged_dsa = dequantize_k_cache_paged_torch
    pad_ragged_topk_offsets()


def hadamard_reference(x, scale=1.0):
    """Stands in for the `sglang::hadamard_transform` custom op (CUDA only): x @ H_n * scale with
    the Sylvester-ordered Hadamard matrix over the last dim (the fast Walsh-Hadamard transform)."""
    n = x.shape[-1]
    h = torch.ones(1, 1, device=x.device)  # on x's device: the GPU harness uses this too
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x.float() @ h * scale).to(x.dtype)


def _rope_native_any_rank(rope):
    """SGLang's own `DeepseekScalingRotaryEmbedding.forward_native`, called with [T, heads, dim]
    operands: its neox branch (`cos.repeat(1, 1, 2)`) adds a leading dim and only broadcasts
    right for 3-D inputs, while the indexer passes a 2-D key. (CUDA runs SGLang's rope kernel.)"""

    def forward(positions, query, key, offsets=None):
        t, d = positions.shape[0], rope.head_size
        q, k = rope.forward_native(positions, query.reshape(t, -1, d), key.reshape(t, -1, d), offsets)
        return q.reshape(query.shape), k.reshape(key.shape)

    return forward


def _patch_source(cls, name, old, new):
    """Recompile SGLang's own `cls.name` with one CUDA-only line swapped (textual, checked)."""
    fn = getattr(cls, name)
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"{cls.__name__}.{name}: {old!r} not found once"
    namespace = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), fn.__globals__, namespace)
    setattr(cls, name, namespace[name])


class _SerialStream:
    """CPU stand-in for a CUDA stream: CPU work is already in program order, so waits and events
    are no-ops (SGLang's CP code overlaps its all-gathers on side streams)."""

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _SerialEvent()

    def synchronize(self):
        pass


class _SerialEvent:
    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass


class GlooAllGather:
    """CPU stand-in for the `PyNcclCommunicator` SGLang's sharded pool gathers history with
    (`page_interleave_pool`): the same in-place all-gather, over the shard group's gloo group,
    as bytes (gloo has no float8)."""

    def __init__(self, group, device=None, cta_policy=None):
        self.group = group

    @contextlib.contextmanager
    def change_state(self, enable=None, stream=None):
        yield

    def all_gather(self, output_tensor, input_tensor, stream=None, sizes=None):
        import torch.distributed as dist

        send = input_tensor.contiguous().view(torch.uint8).clone()  # the input is a block of the output
        dist.all_gather_into_tensor(output_tensor.view(torch.uint8), send, group=self.group)


# ---- installation ---------------------------------------------------------------------------------


def install_process_stand_ins():
    """Module-level stand-ins, before the model is built (idempotent)."""
    torch.cuda.current_stream = lambda *a, **k: _SerialStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    flash_mla = types.ModuleType("sglang.kernels.ops.attention.flash_mla_interface")
    flash_mla.flash_mla_sparse_fwd = sparse_mla_reference
    sys.modules[flash_mla.__name__] = flash_mla

    from sglang.srt.distributed import parallel_state

    parallel_state._is_cpu = True  # GroupCoordinator's CPU branch: torch.distributed collectives (gloo)
    from sglang.srt.mem_cache import page_interleave_pool

    page_interleave_pool.PyNcclCommunicator = GlooAllGather  # the sharded pool's history gather
    import sglang.kernels.ops.quantization.hadamard as hadamard

    hadamard.hadamard_transform = hadamard_reference  # imported lazily by dsa_indexer.rotate_activation
    install_fp8_kv_stand_ins()
    install_q8_stand_ins()
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.rotary_embedding import base as rope_base

    # RotaryEmbedding.__init__ imports vllm's rope kernel on a platform that is neither CUDA nor
    # SGLang's CPU engine; forward dispatch uses forward_native there anyway.
    rope_base._is_cpu = True
    dsa_indexer.can_use_dsa_fused_store = lambda *a: False  # SGLang's answer when its JIT store kernel cannot build
    # DeepGEMM's paged-logits schedule (a CUDA JIT kernel here); the torch paged logits ignore it.
    dsa_indexer.resolve_paged_mqa_logits_metadata_fn = lambda: (lambda *a, **k: None)
    # The ragged prefill top-k sizes its logits chunks from the CUDA device's free memory.
    if not getattr(Indexer._get_topk_ragged, "_cpu_stand_in", False):
        _patch_source(
            Indexer,
            "_get_topk_ragged",
            'assert device_index is not None, "q_fp8 must be on an indexed CUDA device"',
            "device_index = 0",
        )
        Indexer._get_topk_ragged._cpu_stand_in = True
    Indexer._get_mqa_logits_budget_bytes = lambda self, device_index: 1 << 30


def patch_model(model):
    """Per-module stand-ins on a built model (SGLang's `DeepseekV2ForCausalLM` or a subclass)."""
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    # forward_cuda's store + top-k branch is gated on the platform (set after __init__, which
    # queries the CUDA SM count).
    dsa_indexer._is_cuda = True
    for m in model.modules():
        if isinstance(m, Indexer):  # the platform dispatch CUDA makes (its native path raises)
            m._forward_method = m.forward_cuda
            m.sm_count = 1  # resolve_num_sms() asks the CUDA device; only sizes the paged-logits schedule
            # its non-CUDA branch: torch.mm(..., out_dtype=float32) exists on CUDA/XPU only
            m._weights_proj_bf16_in_fp32_out = lambda x, m=m: m.weights_proj(x)[0].float()
        if isinstance(m, DeepseekScalingRotaryEmbedding):
            m._forward_method = _rope_native_any_rank(m)
    return model


# ---- the test-only server plugin ------------------------------------------------------------------


def install_server_stand_ins():
    """What only the server path (scheduler, model runner) needs beyond the model's stand-ins."""
    # The overlap scheduler's early send of a chunked request's cached prefix records a
    # torch.cuda.Event on the forward stream (`maybe_send_cached_prefix_chunk`); on CPU the forward
    # has finished when the scheduler gets there, so the event is a no-op.
    torch.cuda.Event = _SerialEvent
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    # prepare_mlp_sync_batch (CP and DP attention) pins a host tensor unless on SGLang's CPU
    # engine: "pin_memory=True requires a CUDA or other accelerator backend".
    if not getattr(ForwardBatch.prepare_mlp_sync_batch, "_cpu_stand_in", False):
        _patch_source(
            ForwardBatch, "prepare_mlp_sync_batch", "self.use_pin_memory = not _is_cpu", "self.use_pin_memory = False"
        )
        ForwardBatch.prepare_mlp_sync_batch._cpu_stand_in = True
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    # _send_kv_chunk's fast path (one CP sender: replicated CP, CP off) copies the page ids into a
    # pinned host tensor and records a torch.cuda.Event; False selects its other branch, the
    # plain `kv_to_page_indices` that every sharded / all-CP-ranks transfer takes.
    MooncakeKVSender.supports_host_tensor_indices = False
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

    # Layer split's owner broadcast takes the attention-CP group's PyNccl communicator whenever it is
    # not None; on CPU SGLang builds one that is unavailable (no NCCL: no `device`, "has no attribute
    # 'device'"), where GroupCoordinator.broadcast checks `disabled`. Its own torch.distributed
    # fallback (gloo over the group's CPU group) then runs instead.
    if not getattr(LayerSplitDSATokenToKVPool._broadcast_tensor_from_owner, "_cpu_stand_in", False):
        _patch_source(LayerSplitDSATokenToKVPool, "_broadcast_tensor_from_owner", "if comm is not None:",
                      "if comm is not None and comm.available:")  # fmt: skip
        LayerSplitDSATokenToKVPool._broadcast_tensor_from_owner._cpu_stand_in = True


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` bytes of CPU memory at `address`, as a uint8 tensor (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def transfer_kv_all_layer_mla_by_pointer(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    """Stands in for `sgl_kernel.kvcacheio.transfer_kv_all_layer_mla` (HiCache's all-layer
    write-back) in a server: its operands are tables of layer buffer addresses; on CPU an address
    is the buffer, read here up to the last item the copy touches."""
    from helpers.sglang_hicache_harness import transfer_kv_per_layer_mla

    if src_indices.numel() == 0:
        return
    src_end, dst_end = ((int(i.max()) + 1) * item_size for i in (src_indices, dst_indices))
    for layer in range(num_layers):
        src, dst = _bytes_at(int(src_layers[layer]), src_end), _bytes_at(int(dst_layers[layer]), dst_end)
        transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size)


def _install_hicache_stand_ins(*args, **kwargs):
    """BEFORE SGLang builds its HiCache tier (so only in a server run with
    --enable-hierarchical-cache): the host-tier transfers of `sglang_hicache_harness`, with the
    all-layer copy by address, `cudaHostRegister` a no-op."""
    from helpers import sglang_hicache_harness

    sglang_hicache_harness._install_transfer_stand_ins(all_layer=transfer_kv_all_layer_mla_by_pointer)


def _patch_loaded_model(result, runner, *args, **kwargs):
    """AFTER `ModelRunner.load_model`: the per-module stand-ins on the model SGLang just built."""
    patch_model(runner.model)


CUDA_ONLY_PROBLEM = "runs on CUDA only, got --device cpu"


def _allow_cpu_device(original, server_args):
    """AROUND the product plugin's `find_problems`: drop only its `--device cuda` requirement."""
    return [p for p in original(server_args) if not p.startswith(CUDA_ONLY_PROBLEM)]


CLASSES_LINE = "cpu_stand_ins: classes built: "


def _qualified(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def report_classes(manager, queue, *args, **kwargs):
    """AFTER a PD queue's `_init_kv_manager`: one line naming the classes SGLang built there (its
    KV manager, and the KV pool the queue serves), which test_sglang_server_pd.py reads from the
    server's log (`classes_built`). Reports only."""
    print(f"{CLASSES_LINE}manager={_qualified(manager)} pool={_qualified(queue.token_to_kv_pool)}", flush=True)
    return manager


def register():
    """Entry point of the test-only `cpu_stand_ins` plugin; runs in every SGLang process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # Argument resolution (launcher) and the DSA backend (schedulers) read the SM: take SM90's choices.
    torch.cuda.get_device_capability = lambda *a, **k: SM90
    # The HTTP server imports soundfile for audio transcription only (not installed here).
    soundfile = types.ModuleType("soundfile")
    soundfile.__spec__ = importlib.machinery.ModuleSpec("soundfile", None)
    sys.modules.setdefault("soundfile", soundfile)
    install_process_stand_ins()
    install_server_stand_ins()
    if os.environ.get("NSA_CP_TEST_COUNT_COLLECTIVES"):  # a test counting every forward's collectives
        from helpers import collective_counter

        collective_counter.install_in_server(os.environ[collective_counter.ENV])
    if os.environ.get("NSA_CP_TEST_SPECULATIVE"):  # a speculative (EAGLE / MTP) server test
        from helpers import sglang_spec_stand_ins

        sglang_spec_stand_ins.install()
        if os.environ.get(sglang_spec_stand_ins.DUMP_ENV):
            sglang_spec_stand_ins.install_dump()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model", _patch_loaded_model, HookType.AFTER
    )
    HookRegistry.register(
        "sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook.find_problems", _allow_cpu_device, HookType.AROUND
    )
    for queue in ("prefill.PrefillBootstrapQueue", "decode.DecodePreallocQueue"):
        HookRegistry.register(f"sglang.srt.disaggregation.{queue}._init_kv_manager", report_classes, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_hicache",
        _install_hicache_stand_ins,
        HookType.BEFORE,
    )
