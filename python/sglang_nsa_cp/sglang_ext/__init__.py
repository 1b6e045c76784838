"""The SGLang 0.5.23 plugin: `--enable-nsa-prefill-cp-shared-kv`. The only package that imports sglang.

SGLang loads it through the entry point `sglang.srt.plugins: nsa_cp_shared_kv =
sglang_nsa_cp.sglang_ext:register` in every process it starts (`load_plugins()` in the launcher,
`Engine`, each scheduler, the detokenizer). `register()` registers every entry of the patch ledger,
`ledger.LEDGER`, in its fixed order (HookRegistry targets and server-argument resolution steps);
SGLang's `load_plugins()` then applies them. Importing this package does nothing.

Without the flag (the resolved decision: `server_args.is_enabled()` on a prefill,
`server_args.decode_opted_in()` on a decode, where the same flag is the decode's opt-in), SGLang
runs its own classes and results everywhere: the flag is declared on SGLang's parser and the
resolution steps return to SGLang's at once; `get_kv_class` answers SGLang's Mooncake classes, the
pool SGLang builds stays SGLang's class (SGLang's own `--enable-kv-cache-sharding` included), and
every other hook hands SGLang's own result back (test_sglang_ext.py,
`test_without_the_flag_sglang_gets_its_own_classes_and_results`). A shared-KV prefill refuses a
decode that has not opted in (its rooms fail, naming the flag); an opted-in decode serves a
replicated or non-CP prefill as SGLang does.

The patch ledger (`ledger.py`) holds each target with its kind, hook, why, the upstream change
that would remove it and its fingerprint (signature and body), and fails closed at start-up
with the flag, on both roles and in every scheduler.
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
                HookRegistry.register(point.target, hook, HookType[point.kind])
        except (ValueError, TypeError) as err:
            # SGLang refused it (e.g. a step no longer overridable). Keep registering the rest, so that
            # start-up validation runs and `check_patch_points()` refuses the flag naming this hook.
            ledger.record_not_registered(point, f"SGLang refused it: {type(err).__name__}: {err}")
            logger.error("sglang-nsa-cp: could not register hook %s on %s: %s", point.hook, point.target, err)
    _registered = True
