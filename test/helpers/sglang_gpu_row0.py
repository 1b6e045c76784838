"""One rank of the row-0 check on CUDA (test_row0_gpu.py): a batch without cached history through
SGLang's own DSA forward with FlashMLA's real sparse prefill kernel, over three pools built in the
same process from the same pages (`sglang_gpu_harness.GpuEngine`): SGLang's replicated pool,
SGLang's own page-interleaved class and the plugin's subclass, the two sharded ones with their
gather scratch NaN (0xFF bytes) as the batch begins.
"""

from __future__ import annotations

import torch

POOLS = ("replicated", "sglang_pool", "shared")


def run_poisoned_batch_without_history(rank, world, group, model_path, kv_cache_dtype="bfloat16"):
    """{pool: {"logits", "pool_module", "history"}} for this rank; the plugin is loaded and
    enabled, so "shared" is its subclass and "sglang_pool" SGLang's class (the subclass's base)."""
    from helpers import sglang_gpu_harness as G
    from helpers import sglang_model_harness as H

    sa = G.setup_process(rank, world, model_path, world, kv_cache_dtype)
    from sglang.srt.plugins import load_plugins

    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    load_plugins()
    setattr(sa, ATTR, True)  # the decision the flag's start-up validation writes
    mc, model = G.build_model(sa)
    toks = G.check_token_ids(mc.hf_config.vocab_size)
    out = {}
    for pool in POOLS:
        engine = G.GpuEngine(sa, mc, model, pool, G.CHECK_PAGES_PER_RANK, world, max_len=G.CHECK_MAX_LEN,
                             chunk_tokens=G.CHECK_MAX_LEN)  # fmt: skip
        if pool != "replicated":
            H.poison_gather_scratch(engine.pool)
        logits = engine.run(engine.forward_batch(G.CHECK_BATCHES[0], toks))
        out[pool] = dict(
            logits=logits,
            pool_module=type(engine.pool).__module__,
            history=bool(getattr(engine.pool, "_block_pages", 0)),
        )
        if pool != "replicated":
            engine.pool.end_shard_extend()
        del engine
        torch.cuda.empty_cache()
    return out
