"""Specification of the reference DSA model and its single-rank oracle path.

CPU, about 10 s. The tiny config has index_topk = 16, so prompts of 20-300 tokens are sparse.
Float32 comparisons are within 1e-5 relative (the oracle's bar in docs/design.md); the dense
re-derivation below runs in float64 so it pins the math, not the rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.reference import (
    CONFIGS,
    DSAConfig,
    DSAModel,
    SlotKVCache,
    apply_rope,
    decode_step,
    dequantize_index_key,
    get_config,
    prefill_single,
    quantize_index_key,
)

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

TINY = get_config("tiny")


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5, what: str = "") -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def model() -> DSAModel:
    return DSAModel(TINY, seed=0)


@pytest.fixture(scope="module")
def model64() -> DSAModel:
    return DSAModel(TINY, seed=0, dtype=torch.float64)


def new_cache(model: DSAModel, page_size: int = 4, num_slots: int = 2048) -> SlotKVCache:
    return SlotKVCache(model.config, num_slots, page_size, dtype=model.embed_tokens.weight.dtype)


def run_prompt(model: DSAModel, ids: torch.Tensor, return_topk: bool = False):
    """Hidden states (and top-k) of one request prefilled in one go."""
    cache = new_cache(model)
    batch = cache.begin_batch(["r"], [len(ids)])
    return model(ids, batch.positions, batch.request_ids, cache, return_topk=return_topk)


# --- configuration ---------------------------------------------------------------------------


def test_get_config_names_the_known_configs():
    assert get_config("tiny") is CONFIGS["tiny"]
    with pytest.raises(ValueError, match=r"'glm5-attn'.*'tiny'"):
        get_config("glm5")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"index_head_dim": 64}, "index_head_dim must be 128"),
        ({"qk_rope_head_dim": 15}, "must be even"),
        ({"qk_rope_head_dim": 130}, "must be <= index_head_dim"),
        ({"num_heads": 0}, "num_heads must be a positive int"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number"),
        ({"architecture": "LlamaForCausalLM"}, "expected one of"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_glm5_attn_has_glm5_attention_dims():
    cfg = get_config("glm5-attn")
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (6144, 64, 2048, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (192, 64, 256)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert cfg.latent_dim == 576


def test_hf_config_uses_deepseek_v32_names():
    hf = TINY.to_hf_dict()
    assert hf["architectures"] == ["GlmMoeDsaForCausalLM"] and hf["model_type"] == "glm_moe_dsa"
    assert hf["num_hidden_layers"] == TINY.num_layers and hf["num_attention_heads"] == TINY.num_heads
    assert DSAConfig.from_hf_dict(hf) == TINY


# --- weights ---------------------------------------------------------------------------------


def test_weights_are_a_function_of_the_seed(model):
    same, other = DSAModel(TINY, seed=0), DSAModel(TINY, seed=1)
    for (name, p), q, r in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(p, q), f"{name} differs for the same seed"
        assert not torch.equal(p, r), f"{name} is the same for seeds 0 and 1"


def test_save_load_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == [TINY.architecture] and hf["index_topk"] == TINY.index_topk
    loaded = DSAModel.from_pretrained(tmp_path)
    ids = tokens(40, seed=1)
    want, got = run_prompt(model, ids), run_prompt(loaded, ids)
    assert torch.equal(model.logits(got), model.logits(want))


# --- building blocks -------------------------------------------------------------------------


def test_index_key_fp8_round_trip():
    key = torch.randn(50, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 50)[:, None]
    key[7] = 0.0
    key_bytes, scale = quantize_index_key(key)
    assert key_bytes.dtype == torch.uint8 and key_bytes.shape == (50, 128) and scale.dtype == torch.float32
    assert_close(scale[:7], key[:7].abs().amax(-1) / 448, rtol=1e-6, atol=0, what="scale = amax / 448")
    assert scale[7] == 1e-12 and torch.all(key_bytes[7] == 0), "an all-zero key quantizes to zeros"
    back = dequantize_index_key(key_bytes, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each element's magnitude, plus the
    # subnormal floor (2^-9 of the row's scale) for elements much smaller than the row's amax.
    bound = key.abs() * 2**-4 + scale[:, None] * 2**-9
    assert torch.all((back - key).abs() <= bound), "fp8 round trip beyond half an e4m3 step"


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 16, generator=gen, dtype=torch.float64)

    def score(pq: int, pk: int) -> torch.Tensor:
        return (apply_rope(q, torch.tensor([pq]), 1e4) * apply_rope(k, torch.tensor([pk]), 1e4)).sum()

    assert_close(score(10, 3), score(1010, 1003), rtol=1e-12, atol=1e-12, what="shifted pair")
    assert not torch.allclose(score(10, 3), score(10, 4))


# --- the model against a dense re-derivation -------------------------------------------------


def dense_reference(model: DSAModel, ids: torch.Tensor) -> torch.Tensor:
    """The same model written the unabsorbed way: per-head K/V from kv_b_proj, index scores and
    top-k by brute force over the full [T, T] matrix (ties to the lower position), attention as a
    masked dense softmax. Shares only the norms, RoPE and the fp8 key format with the model."""
    cfg = model.config
    t, h, r = len(ids), cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pos = torch.arange(t)
    hidden = model.embed_tokens.weight[ids]
    for layer in model.layers:
        a, ind = layer.self_attn, layer.self_attn.indexer
        x = layer.input_layernorm(hidden)
        q_lat = a.q_a_layernorm(x @ a.q_a_proj.weight.T)
        q = (q_lat @ a.q_b_proj.weight.T).view(t, h, dn + dr)
        kv_a = x @ a.kv_a_proj_with_mqa.weight.T
        c_kv = a.kv_a_layernorm(kv_a[:, :r])
        k_nope, v = (c_kv @ a.kv_b_proj.weight.T).view(t, h, dn + dv).split([dn, dv], -1)
        k = torch.cat([k_nope, apply_rope(kv_a[:, r:], pos, cfg.rope_theta)[:, None].expand(t, h, dr)], -1)
        q = torch.cat([q[..., :dn], apply_rope(q[..., dn:], pos, cfg.rope_theta)], -1)

        iq = (q_lat @ ind.wq_b.weight.T).view(t, cfg.index_n_heads, 128)
        iq = torch.cat([apply_rope(iq[..., :dr], pos, cfg.rope_theta), iq[..., dr:]], -1)
        ik = F.layer_norm(x @ ind.wk.weight.T, (128,), ind.k_norm.weight, ind.k_norm.bias, 1e-6)
        ik = torch.cat([apply_rope(ik[:, :dr], pos, cfg.rope_theta), ik[:, dr:]], -1)
        ik = dequantize_index_key(*quantize_index_key(ik), ik.dtype)
        w = (x @ ind.weights_proj.weight.T) / math.sqrt(cfg.index_n_heads * 128)
        score = (w[:, :, None] * torch.relu(torch.einsum("thd,jd->thj", iq, ik))).sum(1)
        allowed = torch.zeros(t, t, dtype=torch.bool)
        for i in range(t):
            ranked = sorted(range(i + 1), key=lambda j: (-score[i, j].item(), j))
            allowed[i, ranked[: cfg.index_topk]] = True

        logits = torch.einsum("thd,jhd->thj", q, k) * cfg.softmax_scale
        probs = logits.masked_fill(~allowed[:, None, :], -math.inf).softmax(-1)
        out = torch.einsum("thj,jhv->thv", probs, v).reshape(t, h * dv)
        hidden = hidden + out @ a.o_proj.weight.T
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden


def test_absorbed_sparse_model_matches_dense_reference(model64):
    ids = tokens(40, seed=2)
    assert_close(run_prompt(model64, ids), dense_reference(model64, ids), rtol=1e-10, atol=1e-10, what="hidden")


def test_topk_is_sparse(model):
    n = 60
    _, topks = run_prompt(model, tokens(n, seed=3), return_topk=True)
    k = TINY.index_topk
    for layer, sel in enumerate(topks):
        assert sel.shape == (n, k), f"layer {layer}: {sel.shape=}"
        for p in range(n):
            row = sel[p]
            chosen = row[row >= 0]
            want = min(k, p + 1)
            assert len(chosen) == want and torch.all(row[want:] == -1), f"{layer=} {p=}: {row.tolist()}"
            assert torch.all(chosen[1:] > chosen[:-1]) and chosen[-1] <= p, f"{layer=} {p=}: {row.tolist()}"
        late = sel[k:]
        assert torch.any(late[:, -1] != torch.arange(k, n)), f"layer {layer}: top-k is just a sliding window"


def test_query_chunking_does_not_change_the_result(model):
    ids = tokens(70, seed=4)
    want = run_prompt(model, ids, return_topk=True)
    model.query_chunk_size = 7
    try:
        got = run_prompt(model, ids, return_topk=True)
    finally:
        model.query_chunk_size = DSAModel(TINY).query_chunk_size
    assert_close(got[0], want[0], what="hidden")
    for layer, (g, w) in enumerate(zip(got[1], want[1])):
        assert torch.equal(g, w), f"layer {layer} selections differ"


# --- the single-rank serving path ------------------------------------------------------------


def test_chunked_prefill_matches_one_shot(model):
    ids = tokens(150, seed=5)
    one_cache, chunk_cache = new_cache(model), new_cache(model)
    want, want_topk = prefill_single(model, [ids], one_cache, ["r"], return_topk=True)
    # Chunk ends at 41 and 97 fall mid-page (page_size 4), so a page is shared across chunks.
    for chunk in (ids[:41], ids[41:97]):
        prefill_single(model, [chunk], chunk_cache, ["r"])
    got, got_topk = prefill_single(model, [ids[97:]], chunk_cache, ["r"], return_topk=True)
    assert_close(got, want, what="last-token logits")
    for layer, (g, w) in enumerate(zip(got_topk, want_topk)):
        assert torch.equal(g, w[97:]), f"layer {layer}: selections of the last chunk differ"


def test_decode_step_matches_prefill_of_prompt_plus_token(model):
    prompt, nxt = tokens(33, seed=6), torch.tensor([17])
    cache = new_cache(model)
    prefill_single(model, [prompt], cache, ["r"])
    got = decode_step(model, cache, ["r"], nxt)
    want = prefill_single(model, [torch.cat([prompt, nxt])], new_cache(model), ["r"])
    assert_close(got, want, what="decode logits")


def test_batching_matches_running_alone(model):
    a, b = tokens(45, seed=7), tokens(23, seed=8)
    cache = new_cache(model)
    # "b" has a cached prefix of 10 tokens, so the batch mixes a fresh and a continuing request.
    prefill_single(model, [b[:10]], cache, ["b"])
    got = prefill_single(model, [a, b[10:]], cache, ["a", "b"])
    alone = [prefill_single(model, [ids], new_cache(model), ["x"]) for ids in (a, b)]
    assert_close(got, torch.cat(alone), what="batched logits")


def test_token_order_within_a_forward_does_not_matter(model):
    ids = tokens(50, seed=9)
    want = run_prompt(model, ids)
    cache = new_cache(model)
    batch = cache.begin_batch(["r"], [len(ids)])
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    batch.out_cache_loc = batch.out_cache_loc[perm]  # the context must store row i at token i's slot
    got = model(ids[perm], batch.positions[perm], batch.request_ids[perm], cache)
    assert_close(got, want[perm], what="hidden of shuffled tokens")


def test_causality_later_tokens_do_not_change_earlier_ones(model):
    ids = tokens(40, seed=10)
    changed = ids.clone()
    changed[30:] = (changed[30:] + 1) % TINY.vocab_size
    want, got = run_prompt(model, ids), run_prompt(model, changed)
    assert torch.equal(got[:30], want[:30]), "a later token changed an earlier hidden state"
    assert not torch.allclose(got[30:], want[30:])


def test_slot_cache_pages():
    cache = SlotKVCache(TINY, num_slots=32, page_size=4)
    first = cache.begin_batch(["a", "b"], [6, 3])
    assert first.out_cache_loc.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    second = cache.begin_batch(["b", "a"], [1, 3])
    assert (second.prefix_lens, second.seq_lens) == ([3, 6], [4, 9])
    assert second.out_cache_loc.tolist() == [11, 6, 7, 12], "continuing requests fill their last page first"
    assert second.req_to_token[0].tolist() == [8, 9, 10, 11, -1, -1, -1, -1, -1]
    assert second.positions.tolist() == [3, 6, 7, 8] and second.request_ids.tolist() == [0, 1, 1, 1]
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.begin_batch(["c"], [32])
    cache.free("a")
    reused = cache.begin_batch(["c"], [28]).out_cache_loc // 4
    assert sorted(set(reused.tolist())) == [0, 1, 3, 4, 5, 6, 7], "freed pages are reused"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
