"""Drive SGLang 0.5.23's PD-prefill speculative step on CPU: the DSA target forward that captures
every token's hidden state, then its NextN (MTP) draft's extend over the same tokens, as
`EAGLEWorkerV2._forward_prefill_batch` / `EagleDraftWorker._draft_extend_for_prefill` run them.

Used by test_sglang_speculative_forward.py (docs/speculative.md). Builds on
sglang_model_harness.py (the target model, pools, DSA backend, CPU stand-ins); adds SGLang's own
`DeepseekV3ForCausalLMNextN` with its own pool on the target's request table. Runs inside one
rank process spawned by `sglang_nsa_cp.comm.run_ranks`.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

from helpers import sglang_cpu_stand_ins as stand_ins
from helpers import sglang_model_harness as harness
import torch

PAGE = harness.PAGE
# The target checkpoint plus its one MTP layer (DeepSeek-V3.2 / GLM-5 ship one).
TINY_V32_MTP = dict(harness.TINY_V32, num_nextn_predict_layers=1)
DRAFT_TOPK = 2  # --speculative-eagle-topk: the proposals compared


def mtp_checkpoint(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The target's weights plus the MTP layer under DeepSeek-V3.2's HF names: decoder layer
    `model.layers.{L}` (L = num_hidden_layers) and its enorm / hnorm / eh_proj / shared_head.norm."""
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


def write_mtp_checkpoint(path: str, cfg: dict = TINY_V32_MTP, seed: int = 0) -> str:
    return harness.write_checkpoint(path, cfg, seed, tensors=mtp_checkpoint)


def build_draft(sa, mc, target):
    """SGLang's `DeepseekV3ForCausalLMNextN` loaded from the checkpoint by its own loader, with the
    target's embedding and LM head (what `EagleDraftWorker` shares). Stand-in: the MTP layer's
    MLP is dense (`_is_layer_sparse` says MoE for every NextN layer; no fused MoE kernel runs on
    CPU). The MLP is per token, so it does not touch what is compared: KV, attention, gathers."""
    from safetensors.torch import load_file
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer

    from sglang.srt.layers.attention.dsa import dsa_indexer

    with (
        set_default_torch_dtype(torch.bfloat16),
        mock.patch.object(
            DeepseekV2DecoderLayer, "_is_layer_sparse", staticmethod(lambda config, layer_id, is_nextn: False)
        ),
        mock.patch.object(dsa_indexer, "_is_cuda", False),  # built as the target was, before patch_model
    ):
        draft = DeepseekV3ForCausalLMNextN(mc.hf_config)
    weights = load_file(os.path.join(sa.model_path, "model.safetensors"))
    draft.load_weights(iter(weights.items()))  # keeps model.layers.{L}.*, renames as SGLang does
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = target.lm_head.weight
    stand_ins.patch_model(draft)
    return draft


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


def run_scenario(rank, world, group, model_path, mode):
    """mode: 'off' (1 rank, no CP), 'replicated' (SGLang's CP: target and draft pools hold every
    page) or 'shared' (the
    plugin's pools for both, as its configurator hook builds them). Per prefill batch: the
    target's logits, the draft's logits, top-k proposals and last hidden states; after the last
    batch the draft's KV at every written slot (for 'shared', assembled from the page owners)."""
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.utils.common import fast_topk

    sa = harness.setup_process(rank, world, model_path, 1 if mode == "off" else world)
    if mode == "shared":
        from sglang.srt.plugins import load_plugins

        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()
        setattr(sa, ATTR, True)
    mc, target = harness.build_model(sa)
    draft = build_draft(sa, mc, target)
    cp_group = get_parallel().attn_cp_group.device_group if mode == "shared" else None
    t_engine = harness.Engine(sa, mc, target, pool_pages=24, cp_group=cp_group)
    d_engine = harness.Engine(sa, mc, draft, pool_pages=24, cp_group=cp_group, layer_num=1)
    # The draft shares the target's request table and slots (one allocator for both pools).
    d_engine.req_to_token, d_engine.req_to_token_pool = t_engine.req_to_token, t_engine.req_to_token_pool
    d_engine.rebind_pool(d_engine.pool)
    if mode == "shared":
        for e in (t_engine, d_engine):
            e.pool.prefetcher.min_pages_per_rank = 1  # launch these small histories ahead too
    t_engine.init_requests(seed=3)
    toks = harness.token_ids()
    last_batch = {i: b for b, batch in enumerate(harness.BATCHES) for i, _ in batch}
    out = dict(
        target_logits=[],
        target_hidden=[],
        draft_logits=[],
        draft_topk=[],
        draft_hidden=[],
        tail_rows=[],
        draft_history=[],
    )
    written = []
    for b, batch in enumerate(harness.BATCHES):
        if b == 2:
            t_engine.requests.fork(2, source=0, length=PAGE)  # request 2 reuses request 0's first page
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
        if mode == "shared":  # whether the draft's batch read history materialized from the owners
            out["draft_history"].append(d_engine.pool.plan.has_history)
        probs = torch.softmax(d_out.next_token_logits.float(), dim=-1)
        out["target_logits"].append(t_out.next_token_logits.float().cpu())
        out["target_hidden"].append(t_out.hidden_states.float().cpu())  # every token's: the draft's input
        out["draft_logits"].append(d_out.next_token_logits.float().cpu())
        out["draft_topk"].append(fast_topk(probs, DRAFT_TOPK, dim=-1)[1].cpu())
        out["draft_hidden"].append(d_out.hidden_states.float().cpu())
        out["tail_rows"].append(int(t_out.hidden_states.shape[0]))
    if mode == "shared":
        d_engine.pool.end_shard_extend()
        pool = harness._replicated_pool_from_owners(d_engine)  # what the owners' transfer delivers
    else:
        pool = d_engine.pool
    slots = torch.cat(written).long()
    index_pages = pool.index_k_with_scale_buffer[0][slots // PAGE]  # [slots, page bytes]
    k_bytes = PAGE * 128
    within = (slots % PAGE)[:, None]
    out["draft_kv"] = dict(
        latent=pool.kv_buffer[0][slots].view(torch.uint8).cpu(),
        index_k=index_pages[:, :k_bytes].view(-1, PAGE, 128).gather(1, within[..., None].expand(-1, 1, 128)).cpu(),
        index_scale=index_pages[:, k_bytes:].view(-1, PAGE, 4).gather(1, within[..., None].expand(-1, 1, 4)).cpu(),
    )
    out["draft_pool"] = type(d_engine.pool).__name__
    destroy_model_parallel()
    destroy_distributed_environment()
    return out
