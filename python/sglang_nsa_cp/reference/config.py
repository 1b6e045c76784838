"""Configurations of the reference DSA model (MLA attention + NSA indexer + top-k sparse attention).

Field names follow DeepSeek-V3.2's Hugging Face config where one exists (``num_layers`` is
written as ``num_hidden_layers``, ``num_heads`` as ``num_attention_heads``), so a saved model
reads like a real DSA checkpoint to anyone who knows those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sglang_nsa_cp.kernels.formats import INDEX_HEAD_DIM

# HF architecture string -> HF model_type, for the two DSA families we serve.
MODEL_TYPES = {"GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}

# Our field name -> the HF config key it is saved under.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}


@dataclass(frozen=True)
class DSAConfig:
    """Shapes of a DSA model. One MLA latent row per token is ``kv_lora_rank + qk_rope_head_dim``
    values wide; one index key is ``index_head_dim`` (= 128) fp8 bytes plus an fp32 scale."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    architecture: str

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"DSAConfig.{f.name} must be a positive int, got {value!r}")
            if f.type == "float" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"DSAConfig.{f.name} must be a positive number, got {value!r}")
        if self.index_head_dim != INDEX_HEAD_DIM:
            raise ValueError(
                f"DSAConfig.index_head_dim must be {INDEX_HEAD_DIM} (index keys are stored as "
                f"{INDEX_HEAD_DIM} fp8 bytes per token), got {self.index_head_dim}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DSAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"DSAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be <= index_head_dim="
                f"{self.index_head_dim}: the indexer applies RoPE to its first qk_rope_head_dim dims"
            )
        if self.architecture not in MODEL_TYPES:
            raise ValueError(f"DSAConfig.architecture={self.architecture!r}; expected one of {sorted(MODEL_TYPES)}")

    @property
    def latent_dim(self) -> int:
        """Width of one MLA KV-cache row: ``cat(c_kv, k_rope)``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def to_hf_dict(self) -> dict[str, Any]:
        """HF-style ``config.json`` contents (DeepSeek-V3.2 key names)."""
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": MODEL_TYPES[self.architecture]}
        for f in dataclasses.fields(self):
            if f.name != "architecture":
                out[_HF_NAMES.get(f.name, f.name)] = getattr(self, f.name)
        return out

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DSAConfig:
        """Inverse of :meth:`to_hf_dict`; extra HF keys are ignored."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got architectures={archs!r}")
        kwargs: dict[str, Any] = {"architecture": archs[0]}
        for f in dataclasses.fields(cls):
            if f.name == "architecture":
                continue
            key = _HF_NAMES.get(f.name, f.name)
            if key not in hf:
                raise ValueError(f"config.json lacks {key!r}, needed for DSAConfig.{f.name}")
            kwargs[f.name] = hf[key]
        return cls(**kwargs)


CONFIGS: dict[str, DSAConfig] = {
    # Fast on 2 CPU cores; index_topk=16 makes prompts of 20-300 tokens genuinely sparse.
    "tiny": DSAConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=INDEX_HEAD_DIM,
        index_topk=16,
        intermediate_size=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        architecture="GlmMoeDsaForCausalLM",
    ),
    # GLM-5's attention and indexer dims exactly (zai-org/GLM-5 config.json). Three layers give a
    # first, a middle and a last layer (one-layer-ahead prefetch has all three cases); the MLP is
    # one dense SwiGLU of GLM-5's MoE expert width (moe_intermediate_size 2048) instead of the MoE;
    # the vocabulary is cut from 154880 so the LM head stays small.
    "glm5-attn": DSAConfig(
        vocab_size=4096,
        hidden_size=6144,
        num_layers=3,
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=INDEX_HEAD_DIM,
        index_topk=2048,
        intermediate_size=2048,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        architecture="GlmMoeDsaForCausalLM",
    ),
}


def get_config(name: str) -> DSAConfig:
    """The named configuration; ``ValueError`` listing the known names otherwise."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"Unknown reference model config {name!r}; expected one of {sorted(CONFIGS)}") from None
