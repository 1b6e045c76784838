"""Drive SGLang 0.5.23's PD-prefill speculative step on CPU: the DSA target forward that captures
every token's hidden state, then its NextN (MTP) draft's extend over the same tokens, as
`EAGLEWorkerV2._forward_prefill_batch` / `EagleDraftWorker._draft_extend_for_prefill` run them.

Used by test_sglang_speculative_forward.py (docs/speculative.md). Builds on
sglang_model_harness.py (the target model, pools, DSA backend, CPU stand-ins, the rotated-page
batches); adds SGLang's GLM-5 NextN class (`GlmMoeDsaForCausalLMNextN`, the one draft SGLang
shards: GLM DSA, one NextN layer, EAGLE top-k 1) with its own pool on the target's request table
and allocator. Under KV sharding that pool is the one SGLang's configurator builds for the draft
(`KVCacheConfigurator._build_mtp_kv_shard_pool`: a `PageInterleaveDSATokenToKVPool`, the
plugin's subclass once loaded, with the target's spec and shard group and its per-rank size).
Runs inside one rank process spawned by `helpers.distributed.run_ranks`.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from unittest import mock

from helpers import sglang_cpu_stand_ins as stand_ins
from helpers import sglang_model_harness as harness
import torch

PAGE = harness.PAGE
# GLM-5's checkpoint plus its one MTP layer.
TINY_GLM5_MTP = dict(harness.TINY_GLM5, num_nextn_predict_layers=1)
DRAFT_TOPK = 1  # --speculative-eagle-topk: the only value SGLang's sharded MTP supports


def mtp_checkpoint(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The target's weights plus the MTP layer under the HF names GLM-5 and DeepSeek-V3.2 share:
    decoder layer `model.layers.{L}` (L = num_hidden_layers) and its enorm / hnorm / eh_proj /
    shared_head.norm."""
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    sd = harness.random_checkpoint(cfg, seed)
    deeper = harness.random_checkpoint(dict(cfg, num_hidden_layers=L + 1), seed + 1)
    sd.update({k: v for k, v in deeper.items() if k.startswith(f"model.layers.{L}.")})
    g = torch.Generator().manual_seed(seed + 2)
    p = f"model.layers.{L}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        sd[p + name + ".weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)
    sd[p + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5).to(torch.bfloat16)
    return sd


def write_mtp_checkpoint(path: str, cfg: dict = TINY_GLM5_MTP, seed: int = 0) -> str:
    return harness.write_checkpoint(path, cfg, seed, tensors=mtp_checkpoint)


def build_draft(sa, target):
    """SGLang's draft ModelConfig (it renames the architecture to `GlmMoeDsaForCausalLMNextN`) and
    that class loaded from the checkpoint by its own loader, with the target's embedding and LM
    head (what `EagleDraftWorker` shares). Stand-in: the MTP layer's MLP is dense
    (`_is_layer_sparse` says MoE for every NextN layer; no fused MoE kernel runs on CPU). The MLP
    is per token, so it does not touch what is compared: KV, attention, gathers."""
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLMNextN

    mc = ModelConfig.from_server_args(sa, is_draft_model=True)
    arch = mc.hf_config.architectures[0]
    assert arch == GlmMoeDsaForCausalLMNextN.__name__, f"SGLang's draft config names {arch}"
    with (
        set_default_torch_dtype(torch.bfloat16),
        mock.patch.object(
            DeepseekV2DecoderLayer, "_is_layer_sparse", staticmethod(lambda config, layer_id, is_nextn: False)
        ),
        mock.patch.object(dsa_indexer, "_is_cuda", False),  # built as the target was, before patch_model
    ):
        draft = GlmMoeDsaForCausalLMNextN(mc.hf_config)
    weights = load_file(os.path.join(sa.model_path, "model.safetensors"))
    draft.load_weights(iter(weights.items()))  # keeps model.layers.{L}.*, renames as SGLang does
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = target.lm_head.weight
    stand_ins.patch_model(draft)
    return mc, draft


def build_mtp_kv_shard_pool(sa, mc, target):
    """The draft's pool as SGLang's configurator builds it under KV sharding: its own
    `_build_mtp_kv_shard_pool`, which finds the target's pool through the shared allocator and
    checks the spec, size and geometry. The configurator is reduced to the fields it reads."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kvc = SimpleNamespace(
        is_draft_worker=True, token_to_kv_pool_allocator=target.requests.allocator,
        spec_algorithm=SpeculativeAlgorithm.EAGLE, model_config=mc, use_mla_backend=True,
        is_hybrid_swa=False, mambaish_config=None, sliding_window_size=None, post_capture_kv_active=False,
        kv_cache_dtype_str=sa.kv_cache_dtype, kv_cache_dtype=target.kv_dtype, page_size=PAGE,
        pool_page_size=PAGE, device=target.device,
        layer_info=SimpleNamespace(num_effective_layers=1, start_layer=0, end_layer=1),
    )  # fmt: skip
    sizes = SimpleNamespace(max_total_num_tokens=target.pool.size)  # the draft's budget: the same per rank
    pool = KVCacheConfigurator._build_mtp_kv_shard_pool(kvc, sizes=sizes, is_dsa_model=True, is_dsv4_model=False)
    return harness.as_sglang_builds(pool)  # `_build_token_to_kv_pool` returns it through the plugin's hook


class DraftEngine(harness.RotatedEngine):
    """The draft's model, pool and DSA backend on the target's request table and allocator (one
    allocator for both pools). Sharded: SGLang's MTP shard pool; otherwise a one-layer
    `DSATokenToKVPool` over every logical page, as the target's."""

    def __init__(self, sa, mc, model, target: harness.RotatedEngine):
        self.target = target
        super().__init__(sa, mc, model, target.pages_per_rank, target.shard_size, sharded=target._sharded is not None)
        self.req_to_token, self.req_to_token_pool = target.req_to_token, target.req_to_token_pool
        self.requests = target.requests
        self.rebind_pool(self.pool)

    def make_pool(self, kw, pool_pages):
        if self._sharded is None:
            return super().make_pool(dict(kw, layer_num=1), pool_pages)
        return build_mtp_kv_shard_pool(self.sa, self.mc, self.target)


def draft_batch(fb, draft_ids):
    """The draft extend's ForwardBatch: the target's batch (same slots, lengths, positions) with
    the shifted ids; capture LAST, as `_draft_extend_for_prefill` builds it."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return dataclasses.replace(fb, input_ids=draft_ids, capture_hidden_mode=CaptureHiddenMode.LAST)


def shifted_ids(fb, tail_tokens):
    """`_draft_extend_for_prefill`: each request's chunk shifted left by one, its tail token appended."""
    out, pt = torch.empty_like(fb.input_ids), 0
    for i, n in enumerate(fb.extend_seq_lens_cpu):
        out[pt : pt + n] = torch.cat((fb.input_ids[pt + 1 : pt + n], tail_tokens[i].reshape(1)))
        pt += n
    return out


def _draft_kv(pool, slots):
    """The pool's MLA latent bytes, index K and scale at `slots` (logical; an unsharded pool)."""
    index_pages = pool.index_k_with_scale_buffer[0][slots // PAGE]  # [slots, page bytes]
    k_bytes = PAGE * 128
    within = (slots % PAGE)[:, None]
    return dict(
        latent=pool.kv_buffer[0][slots].view(torch.uint8).cpu(),
        index_k=index_pages[:, :k_bytes].view(-1, PAGE, 128).gather(1, within[..., None].expand(-1, 1, 128)).cpu(),
        index_scale=index_pages[:, k_bytes:].view(-1, PAGE, 4).gather(1, within[..., None].expand(-1, 1, 4)).cpu(),
    )


def run_scenario(rank, world, group, model_path, mode):
    """mode: 'off' (1 rank, no CP), 'replicated' (SGLang's CP: target and draft pools hold every
    page) or 'sharded' (SGLang's KV sharding with the plugin loaded: the target's and the draft's
    page-interleaved pools, both gather scratches poisoned as each batch begins). Per prefill
    batch of `harness.ROTATED_BATCHES`: the target's logits and hidden states, the draft's logits,
    top-k proposals and last hidden states; after the last batch the draft's KV at every written
    slot (sharded: assembled from the page owners)."""
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.utils.common import fast_topk

    sa = harness.setup_process(rank, world, model_path, 1 if mode == "off" else world)
    if mode == "sharded":
        from sglang.srt.plugins import load_plugins

        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()  # the plugin's entry point: its pool subclass replaces SGLang's
        setattr(sa, ATTR, True)  # the decision its start-up validation writes (see docs)
    mc, target = harness.build_model(sa)
    t_engine = harness.RotatedEngine(sa, mc, target, harness.PAGES_PER_RANK, world, sharded=mode == "sharded")
    t_engine.init_requests()
    d_mc, draft = build_draft(sa, target)
    d_engine = DraftEngine(sa, d_mc, draft, t_engine)
    out = dict(
        target_pool=type(t_engine.pool).__module__ + "." + type(t_engine.pool).__name__,
        draft_pool=type(d_engine.pool).__module__ + "." + type(d_engine.pool).__name__,
        draft_arch=type(draft).__name__,
    )
    if mode == "sharded":
        p, t = d_engine.pool, t_engine.pool
        out.update(
            draft_spec_is_targets=p.shard_spec == t.shard_spec, draft_group_is_targets=p.shard_group is t.shard_group,
            draft_layers=p.layer_num, draft_size_is_targets=p.size == t.size,
            draft_storage_is_own=p.kv_buffer[0].data_ptr() != t.kv_buffer[0].data_ptr(),
        )  # fmt: skip
        for e in (t_engine, d_engine):
            harness.poison_gather_scratch(e.pool)
    toks = harness.rotated_token_ids()
    last_batch = {i: b for b, batch in enumerate(harness.ROTATED_BATCHES) for i, _ in batch}
    keys = ("target_logits", "target_hidden", "draft_logits", "draft_topk", "draft_hidden", "tail_rows")
    out.update({k: [] for k in keys}, draft_history=[])
    written = []
    for b, batch in enumerate(harness.ROTATED_BATCHES):
        if b == harness.ROTATED_FORK[0]:
            t_engine.requests.fork(*harness.ROTATED_FORK[1:])
        fb = t_engine.forward_batch(batch, toks)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL  # what the EAGLE worker asks of the target
        written.append(fb.out_cache_loc.clone())
        d_fb_base = dataclasses.replace(fb)  # before the target run changes its metadata
        t_out = t_engine.run_output(fb)
        sampled = t_out.next_token_logits.argmax(-1)
        # The tail: the sampled token on a request's last chunk, its next prompt token otherwise.
        tails = torch.stack([
            sampled[k] if last_batch[i] == b else toks[i][int(d_fb_base.seq_lens_cpu[k])]
            for k, (i, _) in enumerate(batch)
        ])  # fmt: skip
        d_fb = draft_batch(d_fb_base, shifted_ids(d_fb_base, tails))
        d_fb.spec_info = EagleDraftExtendInput(
            hidden_states=t_out.hidden_states, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1
        )
        d_out = d_engine.run_output(d_fb)
        if mode == "sharded":  # whether the draft's batch gathered history from the owners
            out["draft_history"].append(d_engine.pool._block_pages > 0)
        probs = torch.softmax(d_out.next_token_logits.float(), dim=-1)
        out["target_logits"].append(t_out.next_token_logits.float().cpu())
        out["target_hidden"].append(t_out.hidden_states.float().cpu())  # every token's: the draft's input
        out["draft_logits"].append(d_out.next_token_logits.float().cpu())
        out["draft_topk"].append(fast_topk(probs, DRAFT_TOPK, dim=-1)[1].cpu())
        out["draft_hidden"].append(d_out.hidden_states.float().cpu())
        out["tail_rows"].append(int(t_out.hidden_states.shape[0]))
    if mode == "sharded":
        d_engine.pool.end_shard_extend()
        pool = harness._decode_pool_from_page_owners(d_engine)  # what the owners' transfer delivers
    else:
        pool = d_engine.pool
    out["draft_kv"] = _draft_kv(pool, torch.cat(written).long())
    destroy_model_parallel()
    destroy_distributed_environment()
    return out
