"""CPU: the glm5-shaped server check's set-up (test/helpers/glm5_shaped.py, helpers/
logprob_compare.py, `scripts/sglang_server_check.py --model glm5-shaped`), checked without a GPU
and without starting a server: GLM-5's shapes, a checkpoint SGLang's config and loader take, pools
that fit one H200, and a logprob comparison that catches a difference."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

GLM5_CARD = "benchmark/data/models/glm5_fp8.json"
H200_GIB = 139.0


def _card() -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[2] / GLM5_CARD).read_text())


def test_the_config_has_glm5s_attention_indexer_and_vocabulary():
    from helpers import glm5_shaped as M

    card, cfg = _card(), M.GLM5_SHAPED
    same = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_shared_experts", "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
            "tie_word_embeddings")  # fmt: skip
    assert {k: cfg[k] for k in same} == {k: card[k] for k in same}
    # reduced: 3 layers (1 dense, 2 MoE), 8 experts of which 2 per token; the NextN layer rides along
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (3, 1)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["num_nextn_predict_layers"]) == (8, 2, 1)
    assert (
        cfg["n_routed_experts"] < card["n_routed_experts"] and cfg["num_experts_per_tok"] < card["num_experts_per_tok"]
    )


def test_checkpoint_tensors_have_glm5s_shapes_and_a_nextn_layer():
    from helpers import glm5_shaped as M

    n = M.tensor_bytes(json.dumps(M.GLM5_SHAPED, sort_keys=True))
    bf16 = 2
    assert n["model.embed_tokens.weight"] == n["lm_head.weight"] == 154880 * 6144 * bf16
    assert n["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64) * 6144 * bf16  # the 576-wide row
    assert n["model.layers.0.self_attn.q_b_proj.weight"] == 64 * (192 + 64) * 2048 * bf16
    assert n["model.layers.0.self_attn.indexer.wq_b.weight"] == 32 * 128 * 2048 * bf16
    assert n["model.layers.0.mlp.gate_proj.weight"] == 12288 * 6144 * bf16  # layer 0: dense
    for layer in (1, 2, 3):  # MoE, the NextN layer (3) included
        assert f"model.layers.{layer}.mlp.gate_proj.weight" not in n, layer
        assert n[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"] == 6144 * 2048 * bf16, layer
        assert n[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] == 8 * 4, layer  # fp32, as HF stores it
    assert n["model.layers.3.eh_proj.weight"] == 6144 * 2 * 6144 * bf16
    assert not [k for k in n if k.startswith("model.layers.4.")]


def test_the_checkpoint_reads_through_transformers_and_sglangs_config(tmp_path):
    """The tiny variant (same structure, same writer) read by transformers' config class and
    SGLang's GLM-5 test; its NextN tensors are in the file (SGLang's loader skips layers >=
    num_hidden_layers without speculative decoding: the CPU servers load it, docs/sglang_gpu_server.md)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    from helpers import glm5_shaped as M

    path = M.write_checkpoint(str(tmp_path / "m"), M.tiny())
    hf = AutoConfig.from_pretrained(path)
    assert type(hf).__name__ == "GlmMoeDsaConfig"
    assert (hf.num_hidden_layers, hf.first_k_dense_replace, hf.num_nextn_predict_layers) == (3, 1, 1)
    assert (hf.scoring_func, hf.topk_method, hf.index_topk) == ("sigmoid", "noaux_tc", 128)
    from sglang.srt.configs.model_config import is_glm_moe_dsa

    assert is_glm_moe_dsa(hf)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.2.mlp.experts.3.up_proj.weight" in names
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 256 and tok.decode([5, 9]) == "t5 t9"


def test_pools_hold_the_128k_prompt_only_when_shared_and_fit_one_h200_two_at_a_time():
    from helpers import glm5_shaped as M
    from helpers import sglang_gpu_servers as GS

    spec = GS.MODELS["glm5-shaped"]
    assert spec.long_prompt == 131072 <= 4 * spec.per_rank - 4 * spec.chunk, "shared CP 4 holds it"
    assert spec.per_rank < spec.long_prompt < spec.big and spec.long_prompt + 6 < spec.context
    # bf16: 3 layers x (576 x 2 + 128 + 4) bytes; fp8: FlashMLA's 656-byte row + the index K
    assert M.kv_bytes_per_token(spec.config, "bfloat16") == 3 * 1284
    assert M.kv_bytes_per_token(spec.config, "fp8_e4m3") == 3 * 788
    est = [M.memory_estimate(spec.config, kv, 4, spec.pools()) for kv in ("bfloat16", "fp8_e4m3")]
    print(json.dumps(est, indent=1))
    # a CP rank holds the whole attention and dense MLP, a quarter of vocabulary and experts
    cp_rank, single = est[0]["roles"]["shared"], est[0]["roles"]["single"]
    assert 2.5 < cp_rank["gib_each"] - 1.5 < 3.5 and 6.5 < single["gib_each"] - 1.5 < 7.5, est[0]["roles"]
    ok, need = M.fits(est, at_once=2, gpu_gib=H200_GIB)
    assert ok, f"two configurations need {need} GiB of {H200_GIB}"
    assert not M.fits(est * 3, at_once=3, gpu_gib=H200_GIB)[0], "the estimate must be able to say no"


def test_glm5_servers_get_its_chunk_and_pools(tmp_path):
    from helpers import sglang_gpu_servers as GS

    spec = GS.MODELS["glm5-shaped"]
    cluster = GS.GpuCluster(tmp_path, cp=4, kv_cache_dtype="fp8_e4m3", spec=spec, checkpoint=str(tmp_path / "ck"))
    assert cluster.write_model("unused") == str(tmp_path / "ck"), "one checkpoint for every cluster"
    shared = cluster.role("shared")[0]
    assert shared[shared.index("--max-total-tokens") + 1] == str(spec.per_rank)
    single = cluster.role("single")[0]
    assert single[single.index("--max-total-tokens") + 1] == str(spec.big)
    cluster.model = "m"
    cmd = cluster.server_command(1, shared, 2, 3)
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == str(spec.chunk)


def _answer(tokens, logprobs, tops):
    return {"output_ids": tokens, "meta_info": {
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens, logprobs)],
        "output_top_logprobs": [[[v, i, None] for i, v in top.items()] for top in tops]}}  # fmt: skip


ORACLE = _answer([7, 3, 9], [-1.0, -2.0, -0.5], [{7: -1.0, 4: -1.5}, {3: -2.0, 8: -2.05}, {9: -0.5, 1: -3.0}])


def test_logprob_comparison_finds_a_difference_and_allows_only_near_ties():
    from helpers import logprob_compare as LP

    oracle = LP.positions(ORACLE)
    same = LP.positions(copy.deepcopy(ORACLE))
    assert LP.exact(same, oracle) == {"equal": True, "first_difference": None}
    bumped = copy.deepcopy(ORACLE)
    bumped["meta_info"]["output_top_logprobs"][2][1][0] = -3.0000002  # one top-5 value, one float32 ulp off
    assert LP.exact(LP.positions(bumped), oracle) == {"equal": False, "first_difference": 2}
    # the router's JSON re-parse (one double ulp) is not a difference: the values are float32
    routed = copy.deepcopy(ORACLE)
    routed["meta_info"]["output_token_logprobs"][1][0] = -2.0000000000000004
    assert LP.exact(LP.positions(routed), oracle)["equal"]

    close = _answer([7, 3, 9], [-1.01, -2.02, -0.49], [{7: -1.01, 4: -1.52}, {3: -2.02, 8: -2.04}, {9: -0.49}])
    c = LP.against_oracle(LP.positions(close), oracle, atol=0.05)
    assert c["ok"] and c["tokens_equal"] and abs(c["max_abs_logprob_diff"] - 0.02) < 1e-6, c
    # a near-tie flipped (8 vs 3: 0.05 apart in the oracle): allowed, and nothing compared after it
    flip = _answer([7, 8, 2], [-1.0, -2.01, -0.1], [{7: -1.0}, {8: -2.01, 3: -2.03}, {2: -0.1}])
    c = LP.against_oracle(LP.positions(flip), oracle, atol=0.05)
    assert c["ok"] and c["first_divergence"] == 1 and c["near_tie"], c
    # a clear choice flipped (4 is 0.5 below 7 in the oracle): caught
    wrong = _answer([4, 3, 9], [-0.9, -2.0, -0.5], [{4: -0.9, 7: -1.1}, {3: -2.0}, {9: -0.5}])
    c = LP.against_oracle(LP.positions(wrong), oracle, atol=0.05)
    assert not c["ok"] and c["oracle_margin_at_divergence"] == pytest.approx(0.5), c
    # same tokens, logprobs too far apart: caught
    far = _answer([7, 3, 9], [-1.3, -2.0, -0.5], [{7: -1.3}, {3: -2.0}, {9: -0.5}])
    c = LP.against_oracle(LP.positions(far), oracle, atol=0.05)
    assert not c["ok"] and c["max_abs_logprob_diff"] == pytest.approx(0.3) and c["max_diff_position"] == 0, c
    with pytest.raises(ValueError, match="logprob_request"):
        LP.positions({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [], "output_top_logprobs": []}})


def test_results_name_the_model_that_ran():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
    import sglang_server_check as C

    gpu = C.model_shape("glm5-shaped", "cuda")
    assert "toy model" not in gpu and (gpu["hidden_size"], gpu["vocab_size"], gpu["index_topk"]) == (6144, 154880, 2048)
    assert "1 dense, 2 MoE of 8 experts, top-2" in gpu["glm5-shaped model"]
    assert C.model_shape("glm5-shaped", "cpu")["hidden_size"] == 64
    assert "toy model" in C.model_shape("toy", "cuda")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
