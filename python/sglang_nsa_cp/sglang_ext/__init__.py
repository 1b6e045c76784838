"""The SGLang 0.5.23 plugin: `--enable-nsa-prefill-cp-shared-kv`. The only package that imports sglang.

SGLang loads it through the entry point `sglang.srt.plugins: nsa_cp_shared_kv =
sglang_nsa_cp.sglang_ext:register` in every process it starts (`load_plugins()` in the launcher,
`Engine`, each scheduler, the detokenizer). `register()` registers every entry of the patch ledger,
`ledger.LEDGER`, in its fixed order (HookRegistry targets and server-argument resolution steps);
SGLang's `load_plugins()` then applies them. Importing this package does nothing.

Without the flag (the resolved decision, `server_args.is_enabled()`), what still acts:
- the flag's declaration on SGLang's parser, and the resolution steps, which return to SGLang's
  at once when the flag was not asked for;
- the pool REPLACE: SGLang's `--enable-kv-cache-sharding` builds the plugin's subclass, whose
  overrides then call SGLang's methods only (test_pool_writes.py: the same pool and scratch bytes);
- the decode side, by design, since a decode instance runs without the flag: SGLang builds the
  plugin's Mooncake manager, sender and receiver (they act only on rooms whose statuses carry
  manifests, which only a prefill with the flag sends), a decode manager's status socket gets a
  frame limit, and a request whose prefill advertises owner-sharded pages at CP > 1 (the flag's,
  or SGLang's own sharding) gets its decode pages grouped by owner.
Every other runtime hook hands back SGLang's own result (test_sglang_ext.py,
`test_without_the_flag_only_the_decode_side_hooks_act`).

The patch ledger (`ledger.py`) holds each target with its kind, hook, why, the upstream change
that would remove it and its signature fingerprint, and fails closed at start-up with the flag.
Each hook's module mirrors the SGLang file it hooks and says how the hook works.

What the flag runs is SGLang's own KV sharding (`--enable-kv-cache-sharding`: its page-interleaved
DSA pool, owner-rotating allocator, admission gate, HiCache host tier, sharded MTP draft pool and
owner-page PD send), admitted on the Hopper path (`arg_groups/kv_shard_hook.py`), with the
plugin's delta: the pool subclass (`mem_cache/page_interleave_pool.py`), the scratch in contexts
(`mem_cache/page_interleave.py`), the narrow tail gather (`layers/`) and the PD checks
(`disaggregation/`: subclasses of SGLang's Mooncake classes). docs/upstream.md is the change that would make each unnecessary.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group: register every `LEDGER` entry, in order.
    Idempotent within a process."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_nsa_cp.sglang_ext import ledger
    from sglang_nsa_cp.sglang_ext.ledger import LEDGER

    for point in LEDGER:
        try:
            hook = point.load_hook()
        except ImportError as err:
            # Keep registering the rest, so that start-up validation runs and refuses the flag naming it.
            ledger.record_not_registered(point, f"its hook does not import: {type(err).__name__}: {err}")
            logger.error("sglang-nsa-cp: hook %s for %s does not import: %s", point.hook, point.target, err)
            continue
        try:
            if point.kind == "RESOLUTION":
                register_resolution_hook(point.step)(hook)
            else:
                if point.kind == "REPLACE":
                    ledger.capture_sglang_class(point)  # SGLang's class, before apply_hooks() replaces it
                HookRegistry.register(point.target, hook, HookType[point.kind])
        except (ValueError, TypeError) as err:
            # SGLang refused it (e.g. a step no longer overridable). Keep registering the rest, so that
            # start-up validation runs and `check_patch_points()` refuses the flag naming this hook.
            ledger.record_not_registered(point, f"SGLang refused it: {type(err).__name__}: {err}")
            logger.error("sglang-nsa-cp: could not register hook %s on %s: %s", point.hook, point.target, err)
    _registered = True
