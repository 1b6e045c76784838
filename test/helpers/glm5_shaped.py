"""A GLM-5-shaped checkpoint for SGLang's real servers (`scripts/sglang_server_check.py --model
glm5-shaped`): GLM-5's attention, indexer, vocabulary and MoE widths at a few layers, random
seeded bf16 weights, and what it costs on one GPU.

    layer 0        dense MLP (intermediate 12,288)                 GLM-5: layers 0-2 dense
    layers 1, 2    MoE: 8 routed experts (top-2) + 1 shared,       GLM-5: 256 routed (top-8) + 1
                   moe_intermediate 2,048, sigmoid noaux_tc routing with a correction bias
    layer 3        the NextN (MTP) layer, in the checkpoint only:  GLM-5: layer 78
                   SGLang's loader skips layers >= num_hidden_layers without speculative decoding

Every layer's attention is GLM-5's: hidden 6144, 64 heads, q_lora 2048, kv_lora 512 + rope 64
(FlashMLA's 576-wide rows), nope 192, v 256, indexer 32 heads x 128 with top-k 2048; vocabulary
154,880 (benchmark/data/models/glm5_fp8.json). RoPE is `deepseek_yarn` with factor 1 (the rotary
class the GPU stand-ins pin, numerically GLM-5's plain RoPE at theta 1e6). `tiny()` is the same
structure at CPU sizes, for the CPU servers.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from helpers import sglang_gpu_harness as G
from helpers import sglang_model_harness as H
from helpers import sglang_servers as S

# GLM-5's own values (glm5_fp8.json, transformers' GlmMoeDsaConfig) where the layer count and
# expert count are not reduced.
GLM5_SHAPED = G.GLM5_ATTN | {
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 2048, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 202752,
    "rope_scaling": dict(G.GLM5_ATTN["rope_scaling"], original_max_position_embeddings=202752),
}  # fmt: skip


def tiny() -> dict:
    """`GLM5_SHAPED`'s structure (dense + MoE layers, NextN in the checkpoint, GLM-5's class)
    at the CPU servers' sizes: hidden 64, 2 heads, 4 experts, vocabulary 256, context 1,024."""
    small = {k: H.TINY_V32[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")}  # fmt: skip
    return GLM5_SHAPED | small | {
        "moe_intermediate_size": 32, "n_routed_experts": 4, "index_n_heads": 16, "index_topk": 128,
        "vocab_size": 256, "max_position_embeddings": 1024,
        "rope_scaling": dict(GLM5_SHAPED["rope_scaling"], original_max_position_embeddings=1024),
    }  # fmt: skip


def moe_layers(cfg: dict) -> range:
    return range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])


def random_checkpoint(cfg: dict, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """HF-format weights (names as in GLM-5's safetensors): the dense harness's tensors for every
    layer and the NextN layer, their MLP replaced by MoE tensors where the config says MoE."""
    n_layers, nextn = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    # the dense tensors of every layer (the NextN layer included), one generator
    sd = H.random_checkpoint(dict(cfg, num_hidden_layers=n_layers + nextn), seed, device)
    g = torch.Generator(device).manual_seed(seed + 1)
    h, e, inter = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]

    def w(*shape, scale=None, dtype=torch.bfloat16):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    def mlp(prefix: str, n: int) -> dict:
        return {prefix + "gate_proj.weight": w(n, h), prefix + "up_proj.weight": w(n, h),
                prefix + "down_proj.weight": w(h, n)}  # fmt: skip

    for i in [*moe_layers(cfg), *range(n_layers, n_layers + nextn)]:
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del sd[f"{p}{name}.weight"]
        sd[p + "gate.weight"] = w(e, h)
        sd[p + "gate.e_score_correction_bias"] = w(e, scale=0.01, dtype=torch.float32)
        sd.update(mlp(p + "shared_experts.", inter * cfg["n_shared_experts"]))
        for x in range(e):
            sd.update(mlp(f"{p}experts.{x}.", inter))
    for i in range(n_layers, n_layers + nextn):  # the MTP head's own tensors (embed / head: the target's)
        p = f"model.layers.{i}."
        sd.update({p + "eh_proj.weight": w(h, 2 * h), p + "enorm.weight": w(h, scale=0.0).add_(1),
                   p + "hnorm.weight": w(h, scale=0.0).add_(1), p + "shared_head.norm.weight": w(h, scale=0.0).add_(1)})  # fmt: skip
    return sd


def write_checkpoint(path: str, cfg: dict, seed: int = 0, device: str = "cpu") -> str:
    """config.json, model.safetensors (tensors made on `device`, saved from host memory) and a
    tokenizer in `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {k: v.cpu() for k, v in random_checkpoint(cfg, seed, device).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    del tensors
    write_tokenizer(path, cfg["vocab_size"])
    return path


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids: <s> = 0, </s> = 1, then "t2", "t3", ...
    (requests send token ids; only the detokenizer reads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(path)


class TinyCluster(S.Cluster):
    """The CPU servers (`sglang_servers.Cluster`) serving `tiny()` at their CP size."""

    def write_model(self, path: str) -> str:
        return write_checkpoint(path, dict(tiny(), num_attention_heads=self.cp, num_key_value_heads=self.cp))


# ---- what it costs on one GPU ---------------------------------------------------------------------

GIB = 1 << 30


def kv_bytes_per_token(cfg: dict, kv_cache_dtype: str) -> int:
    """One token's KV in every layer: the MLA row (bf16 576 values = 1,152 bytes, or FlashMLA's
    656-byte fp8 row) plus the index K (128 fp8 bytes + an fp32 scale)."""
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2 if kv_cache_dtype == "bfloat16" else 656
    return cfg["num_hidden_layers"] * (row + cfg["index_head_dim"] + 4)


def weight_bytes(cfg: dict, tp: int, attn_tp: int) -> int:
    """Bytes of weights one rank loads: embedding and lm_head split over TP (VocabParallel), the
    attention over attention TP (tp / attn_cp), the dense MLP whole (--moe-dense-tp-size 1),
    routed and shared experts over TP; the NextN layer is not loaded."""
    total = 0
    for name, n in tensor_bytes(json.dumps(cfg, sort_keys=True)).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and layer >= cfg["num_hidden_layers"]:
            continue
        if "embed_tokens" in name or name.startswith("lm_head"):
            total += n // tp
        elif ".self_attn." in name:
            total += n // attn_tp
        elif ".experts." in name or ".shared_experts." in name:
            total += n // tp
        else:
            total += n
    return total


@functools.lru_cache(maxsize=4)
def tensor_bytes(cfg_json: str) -> dict[str, int]:
    """Bytes of each checkpoint tensor, from shapes alone (fake tensors: nothing is allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        sd = random_checkpoint(json.loads(cfg_json), 0)
        return {k: v.numel() * v.element_size() for k, v in sd.items()}


def process_roles(cp: int) -> dict[str, tuple[int, int, int]]:
    """Role -> (processes, TP, attention TP) of one server-check cluster at CP `cp`."""
    return {"shared": (cp, cp, 1), "replicated": (cp, cp, 1), "decode": (1, 1, 1), "single": (1, 1, 1)}


def memory_estimate(cfg: dict, kv_cache_dtype: str, cp: int, pools: dict, context_overhead_gib: float = 1.5) -> dict:
    """GiB one cluster holds on the GPU: per role, weights + KV pool (+ the shared prefill's gather
    scratch: 2 slots of one context plus one chunk) + `context_overhead_gib` per process (CUDA
    context, NCCL, allocator slack); and the long prompt's peak (the indexer's fp32 logits for
    one chunk's queries against the whole context, counted 3 x for the torch top-k's
    temporaries, on the oracle and each shared rank) that one cluster at a time adds.
    `pools`: per_rank, big (decode / oracle), chunk, context, long_prompt tokens."""
    per_token = kv_bytes_per_token(cfg, kv_cache_dtype)
    row = per_token // cfg["num_hidden_layers"]
    span = cp * H.PAGE
    scratch = 2 * (-(-pools["context"] // span) * span + pools["chunk"]) * row
    roles = {}
    for role, (procs, tp, attn_tp) in process_roles(cp).items():
        pool = pools["per_rank"] if role in ("shared", "replicated") else pools["big"]
        each = weight_bytes(cfg, tp, attn_tp) + pool * per_token + (scratch if role == "shared" else 0)
        roles[role] = {"processes": procs, "gib_each": round(each / GIB + context_overhead_gib, 2)}
    steady = sum(r["processes"] * r["gib_each"] for r in roles.values())
    logits = 3 * 4 * pools["long_prompt"]
    peak = (pools["chunk"] * logits + cp * (pools["chunk"] // cp) * logits) / GIB
    return {"roles": roles, "steady_gib": round(steady, 1), "long_prompt_peak_gib": round(peak, 1),
            "kv_bytes_per_token": per_token, "assumed_overhead_gib_per_process": context_overhead_gib}  # fmt: skip


def fits(estimates: list[dict], at_once: int, gpu_gib: float) -> tuple[bool, float]:
    """Whether `at_once` clusters side by side (the largest ones) plus one long prompt's peak fit."""
    steady = sorted((e["steady_gib"] for e in estimates), reverse=True)[:at_once]
    need = sum(steady) + max(e["long_prompt_peak_gib"] for e in estimates)
    return need <= gpu_gib, round(need, 1)
