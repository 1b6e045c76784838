"""The KV budget of one 8-GPU prefill node, per layout, from SGLang 0.5.23's own rules.

A layout is how the node's `--tp 8` splits attention: replicated CP, shared CP (the flag) or
SGLang's layer split (`--enable-dsa-cache-layer-split`) at `--attn-cp-size W`, DP attention at
`--dp W --enable-dp-attention`, or plain `--tp 8` (no attention CP or DP: attention TP 8). SGLang's
attention-TP width is then
`runtime_context.derive_attn_tp_size` = tp / attn_dp / attn_cp, and every GPU holds:

- the attention weights its model code splits over attention TP (`q_b_proj`, `kv_b_proj`,
  `o_proj`: `parallel_group="attn_tp"` in `models/deepseek_v2.py`), the ones it replicates
  (`fused_qkv_a_proj_with_mqa` and the indexer's `wq_b`, `wk`, `weights_proj`), and the bf16
  `w_kc`/`w_vc` the loader dequantizes from `kv_b_proj` (`deepseek_weight_loader.py`, block-FP8
  on CUDA without DeepGEMM's BMM);
- the MoE over all 8 GPUs (routed experts by EP or TP: the same bytes per GPU), shared experts and
  the first dense layers' MLP over TP 8, the router replicated, the embedding over TP (over
  attention TP under DP attention: `get_embedding_tp_kwargs`), the LM head over TP 8;
- the KV pool: SGLang's `_profile_available_bytes` gives it the memory left after the weights
  less `(1 - mem_fraction_static)` of the memory before them, and `DefaultPoolConfigurator`
  subtracts the shared pool's scratch before dividing by the bytes per token. Under layer split
  the bytes per token are SGLang's `_compute_cell_size` with `get_glm_dsa_layer_split_effective_num_layers`:
  latent rows of ceil(layers / W) + 1 layers (the owned ones and the one-layer remote scratch the
  owner broadcasts into) and index K of the most layers a rank owns + 1.

`mem_fraction_static` is SGLang's `handle_gpu_memory_settings` for a PD prefill on an H200. Its
reserve holds 1.5 GiB more where the prefill CUDA graph stays on: on CUDA the prefill graph
defaults to `breakable` (`cuda_graph_config.default_prefill_backend`), which SGLang keeps under
DP attention and plain TP and turns off under attention CP (`disable_breakable_cudagraph_if_incompatible`:
CP's all-gather replay). Tests check both against SGLang's own resolution on CPU with the CUDA
default forced. Checkpoint sizes come from the configs in benchmark/data/models/.
"""

from __future__ import annotations

import dataclasses
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "glm5": os.path.join(ROOT, "benchmark", "data", "models", "glm5_fp8.json"),
    "deepseek_v32": os.path.join(ROOT, "benchmark", "data", "models", "deepseek_v32_fp8.json"),
}
GIB = 1 << 30
MIB = 1 << 20
PAGE = 64  # SGLang's page size for DSA (FlashMLA)
NODE_GPUS = 8  # one prefill node: --tp 8
H200_MIB = 143771  # what nvidia-smi reports for one H200
FP8_BLOCK_SCALE = 1 + 4 / (128 * 128)  # block FP8: one fp32 scale per 128 x 128 weights
CUDA_CONTEXT_GIB = 1.0  # CUDA context + NCCL communicators before the weights: assumed, not measured
HICACHE_RATIO = 2.0  # SGLang's default --hicache-ratio: host pool = 2 x device pool, per rank
PATHS = ("replicated", "shared", "layer_split", "dp_attention", "tp")
CP_PATHS = ("replicated", "shared", "layer_split")  # attention CP over W GPUs
LATENT_ROW_BYTES = {"bf16": 576 * 2, "fp8": 656}  # one token of one layer: calculate_mla_kv_cache_dim x dtype
INDEX_ROW_BYTES = 128 + 128 // 128 * 4  # FP8 index K + one fp32 scale per 128 (DSATokenToKVPool)
MLA_GRAPH_RESERVE_MIB = 1.5 * 1024  # reserve_for_graph_mb: a prefill graph with an MLA backend


def load_model(name: str) -> dict:
    with open(MODELS[name]) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One node's attention split: `path` replicated/shared/layer_split (attn CP = width),
    dp_attention (attn DP = width) or tp (width 8: attention TP 8), always `--tp 8`."""

    path: str
    width: int
    tp: int = NODE_GPUS

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path {self.path!r}: must be one of {', '.join(PATHS)}")
        if self.path == "tp" and self.width != self.tp:
            raise ValueError(f"tp: width must be the node's TP {self.tp} (no attention CP or DP), got {self.width}")

    @property
    def attn_cp(self) -> int:
        return self.width if self.path in CP_PATHS else 1

    @property
    def attn_dp(self) -> int:
        return self.width if self.path == "dp_attention" else 1

    @property
    def attn_tp(self) -> int:
        from sglang.srt.runtime_context import derive_attn_tp_size

        return derive_attn_tp_size(tp_size=self.tp, attn_cp_size=self.attn_cp, attn_dp_size=self.attn_dp)

    @property
    def pools(self) -> int:
        """Radix caches (schedulers) on the node: one per DP rank."""
        return self.attn_dp

    @property
    def prefill_cuda_graph(self) -> bool:
        """Whether SGLang keeps its (breakable) prefill CUDA graph on a GPU: not under attention CP."""
        return self.attn_cp == 1

    def sglang_flags(self) -> str:
        if self.path == "dp_attention":
            return f"--tp {self.tp} --dp {self.width} --enable-dp-attention"
        if self.path == "tp":
            return f"--tp {self.tp}"
        flag = {"shared": " --enable-nsa-prefill-cp-shared-kv", "replicated": "",
                "layer_split": " --enable-prefill-cp --cp-strategy interleave --enable-dsa-cache-layer-split"}[self.path]  # fmt: skip
        return f"--tp {self.tp} --attn-cp-size {self.width}{flag}"


def weight_terms(m: dict, layout: Layout) -> list[tuple[str, float, str]]:
    """(name, bytes per GPU, rule) for every weight SGLang places on one GPU of the node."""
    h, layers, dense = m["hidden_size"], m["num_hidden_layers"], m["first_k_dense_replace"]
    moe_layers = layers - dense
    heads, ql, kvl = m["num_attention_heads"], m["q_lora_rank"], m["kv_lora_rank"]
    nope, rope, v = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    ih, idim = m["index_n_heads"], m["index_head_dim"]
    attn_tp, tp = layout.attn_tp, layout.tp
    fp8 = FP8_BLOCK_SCALE
    split = ql * heads * (nope + rope) + kvl * heads * (nope + v) + heads * v * h
    replicated = h * (ql + kvl + rope) + ql * ih * idim + h * idim
    kv_b = kvl * heads * (nope + v)
    expert = 3 * h * m["moe_intermediate_size"]
    embed_tp = attn_tp if layout.attn_dp > 1 else tp
    norms = layers * (2 * h + ql + kvl + idim) + h
    return [
        ("attention q_b/kv_b/o_proj", layers * split * fp8 / attn_tp, f"fp8, / attention TP {attn_tp}"),
        ("attention q_a+kv_a, indexer", layers * (replicated * fp8 + h * ih * 2), "fp8 (weights_proj bf16), replicated"),
        ("w_kc + w_vc (from kv_b_proj)", layers * kv_b * 2 / attn_tp, f"bf16 copies the loader makes, / attention TP {attn_tp}"),
        ("routed experts", moe_layers * m["n_routed_experts"] * expert * fp8 / tp, f"fp8, {moe_layers} MoE layers / EP or TP {tp}"),
        ("shared experts", moe_layers * m["n_shared_experts"] * expert * fp8 / tp, f"fp8, / TP {tp}"),
        ("dense MLP", dense * 3 * h * m["intermediate_size"] * fp8 / tp, f"fp8, first {dense} layers / TP {tp}"),
        ("router", moe_layers * m["n_routed_experts"] * (h * 2 + 4), "bf16 + fp32 bias, replicated"),
        ("embedding", m["vocab_size"] * h * 2 / embed_tp, f"bf16, / {'attention ' if layout.attn_dp > 1 else ''}TP {embed_tp}"),
        ("lm_head", m["vocab_size"] * h * 2 / tp, f"bf16, / TP {tp}"),
        ("norms", norms * 2, "bf16, replicated"),
    ]  # fmt: skip


def attention_params_per_layer(m: dict) -> int:
    """Parameters of one layer's attention (MLA + indexer): what CP replicates at attention TP 1."""
    h, heads = m["hidden_size"], m["num_attention_heads"]
    ql, kvl, nope, rope, v = (m[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))  # fmt: skip
    ih, idim = m["index_n_heads"], m["index_head_dim"]
    return (h * (ql + kvl + rope) + ql * heads * (nope + rope) + kvl * heads * (nope + v) + heads * v * h
            + ql * ih * idim + h * idim + h * ih)  # fmt: skip


def mem_fraction_static(chunked_prefill_size: int = 8192, tp: int = NODE_GPUS, gpu_mib: int = H200_MIB,
                        prefill_cuda_graph: bool = False) -> float:  # fmt: skip
    """SGLang's `handle_gpu_memory_settings` for a PD prefill (decode graph off) on an H200:
    reserve 512 MiB + 1.5 MiB per activation token + tp/8 GiB, + `reserve_for_graph_mb`'s 1.5 GiB
    when the prefill graph is on with an MLA backend, at least 10 GiB on a GPU over 60 GiB."""
    reserved = 512 + max(chunked_prefill_size, 2048) * 1.5 + tp / 8 * 1024
    reserved += MLA_GRAPH_RESERVE_MIB if prefill_cuda_graph else 0
    reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def layer_split_layers(layers: int, width: int) -> tuple[int, int, int]:
    """(latent layers, index-K layers, fewest layers a rank owns) per rank under layer split:
    SGLang's `get_glm_dsa_layer_split_effective_num_layers` (ceil(L / W) + 1, the +1 its remote
    scratch) and `_compute_dsa_indexer_cell_size` (the most any rank owns of `get_layer_shard_range`
    + 1); every GLM-5 / V3.2 layer has its own top-k (no shared-top-k layer)."""
    from sglang.srt.layers.cp.utils import get_layer_shard_range

    owned = [end - start for start, end in (get_layer_shard_range(r, width, layers) for r in range(width))]
    return max(1, -(-layers // width) + 1), max(owned) + 1, min(owned)


def cell_bytes(model: dict, layout: Layout, kv_dtype: str) -> int:
    """KV bytes per token of one rank's pool (SGLang's cell size)."""
    layers = model["num_hidden_layers"]
    if layout.path == "layer_split":
        latent, index, _ = layer_split_layers(layers, layout.width)
        return latent * LATENT_ROW_BYTES[kv_dtype] + index * INDEX_ROW_BYTES
    return layers * (LATENT_ROW_BYTES[kv_dtype] + INDEX_ROW_BYTES)


def per_rank_chunk(chunked_prefill_size: int, layout: Layout) -> int:
    """SGLang divides --chunked-prefill-size among attention-DP ranks (seen in its resolution)."""
    return chunked_prefill_size // layout.attn_dp


@dataclasses.dataclass
class NodeBudget:
    layout: Layout
    kv_dtype: str
    weights_bytes: float
    kv_pool_bytes: int  # per GPU, before the scratch
    scratch_bytes: int
    cell_bytes: int  # KV bytes per token of one rank's pool
    mem_fraction_static: float
    tokens_per_rank: int  # rows of one rank's pool
    capacity_tokens: int  # distinct tokens the node caches: all pools together
    pool_tokens: int  # one radix cache's capacity (DP: one rank's)
    host_tokens_per_pool: int  # HiCache host tier of one radix cache
    host_bytes_per_node: int
    lines: list[str]


def node_budget(model: dict, layout: Layout, kv_dtype: str, kv_bytes_per_token: int, scratch: int,
                chunked_prefill_size: int = 8192, gpu_mib: int = H200_MIB) -> NodeBudget:  # fmt: skip
    """Every term of one GPU's memory and what the node caches, with the arithmetic printed.
    `kv_bytes_per_token`: measured on SGLang's DSATokenToKVPool (all layers); layer split's cell
    is `cell_bytes` from the same rows."""
    terms = weight_terms(model, layout)
    weights = sum(b for _, b, _ in terms)
    full = cell_bytes(model, Layout("replicated", 2), kv_dtype)
    if kv_bytes_per_token != full:
        raise ValueError(f"{kv_dtype}: SGLang's pool measured {kv_bytes_per_token} B per token, the rows here give "
                         f"{full} B: update LATENT_ROW_BYTES / INDEX_ROW_BYTES in trace_budget.py")  # fmt: skip
    cell = cell_bytes(model, layout, kv_dtype)
    mf = mem_fraction_static(chunked_prefill_size, layout.tp, gpu_mib, layout.prefill_cuda_graph)
    pre = gpu_mib * MIB - CUDA_CONTEXT_GIB * GIB
    pool = int(pre * mf - weights)
    scratch = scratch if layout.path == "shared" else 0
    rows = max(pool - scratch, 0) // cell // PAGE * PAGE
    pool_tokens = rows * (layout.width if layout.path == "shared" else 1)
    capacity = pool_tokens * layout.pools
    # HiCache: every rank keeps a host pool of ratio x its device rows (the sharded host pool of
    # pool_host/page_interleave.py holds that rank's shard, so the shared node's host tier is N x too)
    host_rows = int(rows * HICACHE_RATIO)
    host_pool_tokens = host_rows * (layout.width if layout.path == "shared" else 1)
    # layer split's host pool holds a rank's ceil(L / W) layers (pool_host/base.py _effective_host_layer_num)
    host_cell = (-(-model["num_hidden_layers"] // layout.width) * (LATENT_ROW_BYTES[kv_dtype] + INDEX_ROW_BYTES)
                 if layout.path == "layer_split" else kv_bytes_per_token)  # fmt: skip
    host_bytes = host_rows * host_cell * layout.tp
    graph = (
        "prefill CUDA graph on (breakable): +1.5 GiB reserved"
        if layout.prefill_cuda_graph
        else "prefill CUDA graph off under attention CP"
    )
    cell_rule = (f"{kv_bytes_per_token} B per token" if cell == kv_bytes_per_token else
                 f"{cell} B per token (layer split: {layer_split_layers(model['num_hidden_layers'], layout.width)[:2]} "
                 f"latent / index-K layers of {LATENT_ROW_BYTES[kv_dtype]} / {INDEX_ROW_BYTES} B)")  # fmt: skip
    lines = [
        f"{layout.path} W={layout.width} ({layout.sglang_flags()}): attention TP {layout.attn_tp} "
        f"(derive_attn_tp_size: tp {layout.tp} / attn_dp {layout.attn_dp} / attn_cp {layout.attn_cp}), {kv_dtype} KV"
    ]
    lines += [f"  {name:<30} {b / GIB:7.2f} GiB  ({rule})" for name, b, rule in terms]
    lines += [
        f"  {'weights per GPU':<30} {weights / GIB:7.2f} GiB",
        f"  KV pool = (H200 {gpu_mib} MiB - CUDA context {CUDA_CONTEXT_GIB} GiB, assumed) x mem_fraction_static {mf} "
        f"({graph}) - weights = {pool / GIB:.2f} GiB per GPU",
        f"  - scratch {scratch / GIB:.2f} GiB = {max(pool - scratch, 0) / GIB:.2f} GiB / {cell_rule} "
        f"= {rows:,} tokens per rank (whole pages)",
        f"  node caches {capacity:,} distinct tokens: {layout.pools} radix cache(s) of {pool_tokens:,}"
        + (f" (each the {layout.width} ranks' shards)" if layout.path == "shared" else ""),
        f"  HiCache host tier (ratio {HICACHE_RATIO}, per rank): {host_pool_tokens:,} tokens per radix cache, "
        f"{host_bytes / GIB:.0f} GiB of host memory per node ({layout.tp} ranks x {host_rows:,} rows)",
    ]  # fmt: skip
    return NodeBudget(layout, kv_dtype, weights, pool, scratch, cell, mf, rows, capacity, pool_tokens,
                      host_pool_tokens, host_bytes, lines)  # fmt: skip
