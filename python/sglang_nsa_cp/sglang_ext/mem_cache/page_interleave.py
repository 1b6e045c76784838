"""The sharded scratch sized in contexts. Mirrors `sglang/srt/mem_cache/page_interleave.py`.

Target: `page_interleave.make_page_shard_spec` (AROUND). SGLang sizes the double-buffered gather
scratch of its page-interleaved pools for eight full contexts of cached prefix plus one chunk
(`_KV_SHARD_SCRATCH_PREFIX_CONTEXTS`), charges it against the KV budget before sizing the pool
and gates batch admission on it (`PrefillAdder._kv_shard_reserve_scratch`). At a 160k-token
context that is GBs per rank of KV capacity (docs/sglang_plugin.md). With the flag the prefix
region holds `SGLANG_NSA_CP_SCRATCH_CONTEXTS` contexts (default 1): the same spec object feeds the
pool, the budget charge and the admission gate, so a batch never needs more than was reserved;
a batch whose cached prefixes exceed it waits for the next one.
"""

from __future__ import annotations

import msgspec

from sglang_nsa_cp.envs import envs
from sglang_nsa_cp.sglang_ext.server_args import is_enabled


def scratch_spec(spec, *, context_len: int, chunk_tokens: int, contexts: int):
    """`spec` (SGLang's `PageShardSpec`) with a prefix region of `contexts` contexts of
    `context_len` tokens, each rounded up to the shard group's gather span (N pages) as SGLang
    rounds its own, and a chunk region of `chunk_tokens` rounded up to whole pages."""
    if contexts < 1:
        raise ValueError(f"the scratch needs at least one context, got {contexts}")
    span = spec.shard_size * spec.page_size
    return msgspec.structs.replace(
        spec,
        max_prefix_tokens=contexts * -(-context_len // span) * span,
        chunk_tokens=-(-chunk_tokens // spec.page_size) * spec.page_size,
    )


def make_page_shard_spec(original, kvc):
    """AROUND `make_page_shard_spec`: the target's spec with the configured prefix contexts (a
    draft worker inherits its target's spec, as in SGLang)."""
    spec = original(kvc)
    if spec is None or kvc.is_draft_worker or not is_enabled():
        return spec
    return scratch_spec(
        spec,
        context_len=kvc.model_config.context_len,
        chunk_tokens=spec.chunk_tokens,
        contexts=envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.get(),
    )
