"""What the start-up tests resolve server arguments against: a tiny DSA config.json (DeepSeek-V3.2's
or GLM-5's shapes where the plugin's checks read them, tiny elsewhere; no weights are loaded by
argument resolution) and a config writer."""

import json
from pathlib import Path

TINY_DSA = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 128, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "vocab_size": 1024, "max_position_embeddings": 4096, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
V32 = ("DeepseekV32ForCausalLM", "deepseek_v32")
GLM5 = ("GlmMoeDsaForCausalLM", "glm_moe_dsa")


def write_config(path: Path, arch: tuple[str, str], **changes) -> str:
    """`path`/config.json of TINY_DSA as architecture `arch` (name, model_type), with `changes`."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_DSA, architectures=[arch[0]], model_type=arch[1], **changes)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
