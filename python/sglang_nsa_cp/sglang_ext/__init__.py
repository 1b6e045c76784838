"""The SGLang 0.5.23 plugin: `--enable-nsa-prefill-cp-shared-kv`. The only package that imports sglang.

SGLang loads it through the entry point `sglang.srt.plugins: nsa_cp_shared_kv =
sglang_nsa_cp.sglang_ext:register` in every process it starts (`load_plugins()` in the launcher,
`Engine`, each scheduler, the detokenizer). `register()` imports the hook modules below in a fixed
order and registers what each declares (`HOOKS`: HookRegistry targets; `RESOLUTION_HOOKS`:
server-argument resolution steps); SGLang's `load_plugins()` then applies them. Importing this
package does nothing. Every runtime hook is a pass-through unless the resolved server arguments
enable shared KV (`server_args.is_enabled()`).

Patch ledger (target / why / how / upstream / when it can go):

- `ServerArgs.add_cli_args` (AFTER), `ServerArgs.from_cli_args` (AROUND) -- server_args.py.
  Why: ServerArgs has no API to add a field. How: parser flag + bookkeeping attribute.
  Upstream: none. Goes when SGLang lets plugins declare fields.
- resolution steps `validate_prefill_cp_platform`, `handle_context_parallelism`,
  `handle_kv_cache_sharding` -- arg_groups/parallel_hook.py. Why: refuse unsupported combinations
  before any process starts. How: wrappers that check, then call SGLang's step. Permanent.
- `KVCacheConfigurator._derive_pool_sizes` (AROUND) -- mem_cache/kv_cache_configurator.py.
  Why: each rank stores 1/N of the logical pages, so the same memory holds N x the tokens.
  How: logical `max_total_num_tokens` x attn_cp_size for the target worker's DSA pool and an
  EAGLE (MTP) draft worker's, which spans the same logical slots (docs/speculative.md).
- `KVCacheConfigurator._build_dsa_kv_pool` (AROUND) -- mem_cache/kv_cache_configurator.py.
  Why: build the sharded pool instead of `DSATokenToKVPool`, for the target and the MTP draft.
  How: pass our class as `dsa_pool_class`. Both go if SGLang adopts an owner-sharded DSA pool (PRs #29847, #31435, #35309).
- `KVCacheConfigurator._build_token_to_kv_pool_allocator` (AROUND, HiCache only) --
  mem_cache/kv_cache_configurator.py. Why: a HiCache load-back must get device pages of the
  owners its host copies live on; SGLang builds its owner-classed `PageInterleavePoolAllocator`
  only under its own `--enable-kv-cache-sharding`. How: build it (no `shard_spec`) over our pool;
  `_derive_pool_sizes` then leaves the count per-rank, since that allocator widens it by N.
  Goes if SGLang keys the allocator on the pool rather than on its own flag.
- `sglang.srt.layers.cp.utils.cp_gather_after_forward` (AROUND) -- layers/cp/utils.py. Why: the
  narrow tail gather (N x bs rows instead of every token). How: for batches that need only the
  last tokens, gather those rows with `comm.gather_last_token_hidden`.
- `LogitsProcessor._get_pruned_states` (AROUND) -- layers/logits_processor.py. Why: accept the
  already-pruned [bs, hidden] rows the narrow gather returns. How: pass them through.
  Both go if SGLang adopts a narrow tail gather.
- Owned-page PD transfer -- disaggregation/common/conn.py (`CommonKVManager.__init__`,
  `_register_topology_row`, `conclude_transfer`, `_encode_kv_status_message`,
  `parse_kv_status_message`, `apply_prefill_status`; `CommonKVSender._prepare_send_indices`,
  `clear`; `CommonKVReceiver.send_metadata`, `_check_waiting_timeout`, `_clear`; the module's
  `get_zmq_socket_on_host`, a pass-through except while a decode manager binds its status
  socket, which gets ZMQ_MAXMSGSIZE; all AROUND) and
  disaggregation/mooncake/conn.py (`MooncakeKVManager.add_transfer_request`, `maybe_send_extra`,
  AROUND). Why: each CP rank holds only the pages it owns (p % N, local p // N), which is the rule
  of SGLang's own `--enable-kv-cache-sharding` transfer. How: make the shared-KV prefill manager a
  shard rank of that path (every CP rank sends its owned KV and index-K pages; the bootstrap
  advertises sharding so any decode pulls from all CP ranks), add a per-rank self-check before
  Success, the failure reason on status messages and an owned-page manifest (typed, bounded by the
  decode's own request, keyed with SGLANG_NSA_CP_PD_SECRET when set) that a decode with the plugin
  checks before it commits. Goes if SGLang keys its sharded transfer on the pool rather than
  on its own flag and checks coverage on the decode.
- `DecodePreallocQueue._alloc_for_decode_prealloc` (AROUND) -- disaggregation/decode.py. Why: with
  pages in request order a prefill rank's owned positions sit N pages apart on the decode, one
  Mooncake entry per page, layer and kind. How: re-deal the allocated pages so positions
  k = c (mod N) are consecutive (one run per rank) for requests from an owner-sharded prefill.
  Goes if SGLang's decode allocator learns the prefill's page ownership.

The forward path itself (dense page tables for attention and the indexer, index-K writes and
reads) needs no patch: `mem_cache.memory_pool.SharedKVDSATokenToKVPool` implements the contract of
SGLang's own logical-page-sharded pools (`PageInterleaveKVPoolMixin`), which `dsa_backend` and
`dsa_indexer` already honour; see docs/sglang_plugin.md.
"""

from __future__ import annotations

from importlib import import_module

# Fixed order: the flag before the validation that reads it, pools before the forward hooks.
HOOK_MODULES = (
    "sglang_nsa_cp.sglang_ext.server_args",
    "sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook",
    "sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator",
    "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave",
    "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool",
    "sglang_nsa_cp.sglang_ext.layers.cp.utils",
    "sglang_nsa_cp.sglang_ext.layers.logits_processor",
    "sglang_nsa_cp.sglang_ext.disaggregation.common.conn",
    "sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn",
    "sglang_nsa_cp.sglang_ext.disaggregation.decode",
)

_registered = False


def hook_modules():
    return [import_module(name) for name in HOOK_MODULES]


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group. Idempotent within a process."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for module in hook_modules():
        for target, hook, hook_type in getattr(module, "HOOKS", ()):
            HookRegistry.register(target, hook, HookType[hook_type])
        for step, hook in getattr(module, "RESOLUTION_HOOKS", ()):
            register_resolution_hook(step)(hook)
    _registered = True
