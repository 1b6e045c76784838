"""CPU stand-ins for what SGLang 0.5.23's EAGLE (MTP) path needs beyond the DSA model's. Test-only:
`sglang_cpu_stand_ins.register()` installs them in a server only when the test sets
NSA_CP_TEST_SPECULATIVE=1 (test_sglang_server_speculative.py). docs/sglang_cpu_server.md lists them.

These servers run `--device cpu` without SGLang's CPU engine (`is_cpu()` is False: it needs
SGLANG_USE_CPU_ENGINE and sgl-kernel's CPU build, not installed), so SGLang's speculative kernels
take neither their CUDA nor their CPU branch:
- `spec_tree.build_tree_kernel_efficient_func` calls `sgl_build_tree_kernel_efficient`, imported
  only on CUDA (NameError), and `spec_tree.verify_tree_greedy_func` falls through to
  `reject_out_of_tree_path`, which returns the outputs untouched (nothing verified);
- `cache_locs.assign_req_to_token_pool_func` / `assign_extend_cache_locs_func` return None.
Each of them has a Triton branch (XPU's: SGLang's own `sgl_build_tree_kernel_triton`,
`verify_tree_greedy_triton`, `assign_req_to_token_pool`, `assign_extend_cache_locs`), which the
Triton interpreter runs on CPU tensors: the stand-in sets those two modules' `_is_xpu`, read at
each call, so exactly those branches are taken.

The DSA backend's target-verify / draft-extend metadata calls `pad.seqlens_expand_triton`, which
asserts CUDA tensors: `seqlens_expand_reference` stands in for it at its two importers.
"""

from __future__ import annotations

import importlib

import torch

ENV = "NSA_CP_TEST_SPECULATIVE"


SEQLENS_EXPAND_IMPORTERS = ("sglang.srt.layers.attention.dsa_backend",
                            "sglang.srt.layers.attention.dsa.dsa_backend_mtp_precompute")  # fmt: skip


def seqlens_expand_reference(extend_seq_lens, seq_lens, total_len, max_q_len):
    """Stands in for `pad.seqlens_expand_triton` (its kernel `seqlens_expand_kernel`): for request
    i with q = extend_seq_lens[i] new tokens over kv = seq_lens[i], the visible lengths
    kv - q + 1 ... kv of its rows, clamped at 0, all requests concatenated (int32, total_len)."""
    rows = [(int(kv) - int(q) + 1 + torch.arange(int(q))).clamp(min=0) for q, kv in zip(extend_seq_lens, seq_lens)]
    out = torch.cat(rows).to(torch.int32) if rows else torch.empty(0, dtype=torch.int32)
    assert out.numel() == total_len, (out.numel(), total_len)
    return out.to(extend_seq_lens.device)


def install():
    """The Triton branches of the speculative kernels (above); torch.cuda.synchronize a no-op
    (`DeepseekV2ForCausalLM.set_embed_and_head`, when the draft takes the target's embedding and
    head, ends with it; on CPU there is no stream to wait for); the NextN layer's MLP dense
    (`DeepseekV2DecoderLayer._is_layer_sparse` says MoE for every NextN layer and no fused MoE
    kernel runs on CPU, as in sglang_draft_harness.build_draft: the checkpoint holds dense MLP
    tensors for it); and the draft's Indexer built on the platform's own branch (below)."""
    from sglang.kernels.ops.speculative import cache_locs, spec_tree
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    spec_tree._is_xpu = cache_locs._is_xpu = True
    for name in SEQLENS_EXPAND_IMPORTERS:
        importlib.import_module(name).seqlens_expand_triton = seqlens_expand_reference
    torch.cuda.synchronize = lambda *a, **k: None
    original = DeepseekV2DecoderLayer._is_layer_sparse

    def _is_layer_sparse(config, layer_id, is_nextn):
        return False if is_nextn else original(config, layer_id, is_nextn=is_nextn)

    DeepseekV2DecoderLayer._is_layer_sparse = staticmethod(_is_layer_sparse)
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model", _build_as_on_cpu,
                          HookType.BEFORE)  # fmt: skip


def _build_as_on_cpu(*args, **kwargs):
    """BEFORE `ModelRunner.load_model`: the draft's model is built after the target's, whose
    `patch_model` left `dsa_indexer._is_cuda` True; its Indexer's __init__ would then ask the CUDA
    device for its SM count. Built with the platform's own value, as the target was
    (sglang_draft_harness.build_draft does the same); patch_model sets it again after the load."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    dsa_indexer._is_cuda = False


# ---- a test-only dump of what a speculative decode received ---------------------------------------

DUMP_ENV = "NSA_CP_TEST_DRAFT_KV_DUMP"  # a folder: the decode writes one file per committed request
# bootstrap rooms (comma-separated) whose received draft KV the decode corrupts after the commit
CORRUPT_ENV = "NSA_CP_TEST_CORRUPT_DRAFT_ROOMS"
CORRUPT_VALUE = 64.0


def dump_received_draft(result, queue, decode_req, *args, **kwargs):
    """AFTER the decode's `DecodeTransferQueue._commit_transfer_to_req` (a request's KV and metadata
    have landed and been accepted): torch.save to $NSA_CP_TEST_DRAFT_KV_DUMP/<bootstrap_room>.pt the
    draft pool's bytes at the prompt's slots (MLA latent rows, index K and scale, as
    sglang_draft_harness._draft_kv reads them from the decode's stock `DSATokenToKVPool`) and the
    draft proposal in the metadata buffer (top-k p and ids, hidden state). Then, for a room named
    in $NSA_CP_TEST_CORRUPT_DRAFT_ROOMS only, overwrites those draft latent rows with CORRUPT_VALUE:
    a draft page corrupted in transfer, as the decode would go on with it (the commit checks
    pages' ids and owners, not their bytes)."""
    import os

    from helpers import sglang_draft_harness

    from sglang.srt.disaggregation.decode import _is_fake_transfer

    req = decode_req.req
    draft_pool = queue.scheduler.disagg_decode_prealloc_queue.draft_token_to_kv_pool
    if req.bootstrap_room is None or _is_fake_transfer(req) or draft_pool is None or req.kv.req_pool_idx is None:
        return result  # SGLang's own fake transfers (e.g. its health check) carry no KV
    slots = queue.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].long()
    buf = queue.metadata_buffers.get_buf(decode_req.metadata_buffer_index)
    dump = sglang_draft_harness._draft_kv(draft_pool, slots)
    dump.update(topk_p=buf[9].clone(), topk_index=buf[10].clone(), hidden_states=buf[11].clone(), slots=slots.clone())
    torch.save(dump, os.path.join(os.environ[DUMP_ENV], f"{req.bootstrap_room}.pt"))
    if str(req.bootstrap_room) in os.environ.get(CORRUPT_ENV, "").split(","):
        # what a transfer that wrote wrong bytes leaves: every received draft latent row of the
        # prompt overwritten (after the dump above, which shows what arrived), before the decode drafts
        draft_pool.kv_buffer[0][slots] = CORRUPT_VALUE
    return result


def install_dump():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
                          dump_received_draft, HookType.AFTER)  # fmt: skip
