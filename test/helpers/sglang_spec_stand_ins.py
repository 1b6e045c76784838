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
