"""A tiny GLM-5 checkpoint (`GlmMoeDsaForCausalLM` + its NextN layer) whose draft is accepted often,
for SGLang's real speculative servers on CPU (test_sglang_server_speculative.py).

The target is the forward harness's tiny GLM-5 (2 dense layers, hidden 64, vocabulary 128, 16
index heads as the CPU servers' model) with each layer's attention and MLP output projections
(`o_proj`, `down_proj`) scaled by DAMP, so the residual stream stays close to the current token's
embedding and the next token depends mostly, not only, on the current one. The NextN layer is
built from the target's weights: its decoder layer is a copy of target layer 0 (attention,
indexer, MLP, norms), `eh_proj` = [I | 0] (it passes the next token's normed embedding and drops
the target's hidden state), `enorm` = 1, `shared_head.norm` = the target's final norm. The draft
at position t then computes what target layer 0 computes at position t+1, with its own KV
history, and proposes about what the target will predict there; the tests assert the mean accept
length SGLang reports is above 1.
"""

from __future__ import annotations

import torch

from helpers import sglang_draft_harness as D
from helpers import sglang_model_harness as H
from helpers import sglang_servers as S

DAMP = 0.25
CONFIG = dict(D.TINY_GLM5_MTP, index_n_heads=16)


def checkpoint(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    sd = H.random_checkpoint(cfg, seed)
    for i in range(L):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            sd[key] = (sd[key].float() * DAMP).to(torch.bfloat16)
    p = f"model.layers.{L}."
    sd.update({p + k[len("model.layers.0.") :]: v.clone() for k, v in sd.items() if k.startswith("model.layers.0.")})
    sd[p + "enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[p + "hnorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[p + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
    sd[p + "eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1).to(torch.bfloat16)
    return sd


def write_model(path: str, cp: int, config: dict = CONFIG) -> str:
    """The checkpoint at `cp` attention heads (`sglang_servers.model_for_tp`'s reason) and a tokenizer."""
    cfg = dict(config, num_attention_heads=cp, num_key_value_heads=cp)
    H.write_checkpoint(path, cfg, 0, tensors=checkpoint)
    S.write_tokenizer(path, cfg["vocab_size"])
    return path
