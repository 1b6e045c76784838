"""The sharded scratch sized in contexts. Mirrors `sglang/srt/mem_cache/page_interleave.py`.

Target: `page_interleave.make_page_shard_spec` (AROUND). SGLang sizes the double-buffered gather
scratch of its page-interleaved pools for eight full contexts of cached prefix plus one chunk
(`_KV_SHARD_SCRATCH_PREFIX_CONTEXTS`), charges it against the KV budget before sizing the pool
and gates batch admission on it (`PrefillAdder._kv_shard_reserve_scratch`). At a 160k-token
context that is GBs per rank of KV capacity (docs/sglang_plugin.md). With the flag the prefix
region holds `SGLANG_NSA_CP_SCRATCH_CONTEXTS` contexts (default 1): the same spec object feeds the
pool, the budget charge and the admission gate, so a batch never needs more than was reserved;
a batch whose cached prefixes exceed it waits for the next one.

Every scheduler calls the target while it configures its KV cache, before any pool memory is
taken; with the flag requested (a prefill's or a decode's) the hook first checks the patch ledger in that process
(`ledger.require_patch_points`: the launcher's check covers only the launcher) and that the
flag's start-up validation ran (it writes the decision the runtime hooks read).
"""

from __future__ import annotations

import msgspec

from sglang_nsa_cp.envs import envs
from sglang_nsa_cp.sglang_ext.ledger import require_patch_points
from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR, FLAG, is_enabled, requested


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


def refuse_unless_in_place() -> None:
    """In a process with published ServerArgs that request the flag (a scheduler of a prefill or of
    a decode, which applies the decode-side hooks): raise unless every patch point is in place here
    and the start-up validation wrote its decision."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!": a tool or unit test, no scheduler
        return
    if not requested(server_args):
        return
    require_patch_points(FLAG)
    if not (getattr(server_args, ATTR, False) or getattr(server_args, DECODE_ATTR, False)):
        raise RuntimeError(
            f"{FLAG} was requested but its start-up validation never ran in the launcher (no resolution "
            "step called it), so nothing checked the server arguments; load the plugin through SGLang's "
            f"load_plugins() before the arguments are resolved, or drop {FLAG}"
        )


def make_page_shard_spec(original, kvc):
    """AROUND `make_page_shard_spec`: the target's spec with the configured prefix contexts (a
    draft worker inherits its target's spec, as in SGLang)."""
    refuse_unless_in_place()
    spec = original(kvc)
    if spec is None or kvc.is_draft_worker or not is_enabled():
        return spec
    return scratch_spec(
        spec,
        context_len=kvc.model_config.context_len,
        chunk_tokens=spec.chunk_tokens,
        contexts=envs.SGLANG_NSA_CP_SCRATCH_CONTEXTS.get(),
    )
