"""Start-up validation of `--enable-nsa-prefill-cp-shared-kv`. Mirrors
`sglang/srt/arg_groups/parallel_hook.py`, whose resolution steps it wraps.

Resolution hooks (`sglang.srt.arg_groups.resolution_hooks.register_resolution_hook`):
- `validate_prefill_cp_platform`: runs before SGLang's early return for `--model-path dummy`,
  so a flag that could never be validated is refused instead of ignored.
- `handle_context_parallelism`: the full check, before SGLang's own CP checks and before
  `init_cp_strategy`. Page size, attention backends, KV dtype and HiCache are resolved by then
  (the KV dtype needs no check: SGLang's DSA resolution allows only bfloat16 and fp8_e4m3, and
  the pool takes both).
- `handle_kv_cache_sharding`: the same check again; SGLang runs this step right after CP and once
  more at the very end of resolution, after late capability adjustments that can still change
  the attention backend or speculative settings.

The checks include the patch ledger's (`ledger.check_patch_points()`). Every SGLang entry point
calls `load_plugins()` before it resolves the arguments, and resolution runs in the launcher,
before any scheduler starts or any weight loads. Every problem found is reported in one
`SharedKVConfigError` (a ValueError, as SGLang's own), each with its fix; on success the decision
is written to the record as `_nsa_cp_shared_kv` (pickled to the schedulers), which the runtime
hooks read.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolving_view
from sglang.srt.model_executor.cuda_graph_config import Backend

from sglang_nsa_cp.disagg.listeners import exposure
from sglang_nsa_cp.envs import envs
from sglang_nsa_cp.sglang_ext.ledger import ENVIRONMENT, check_patch_points
from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR, FLAG, SharedKVConfigError, requested

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
SUPPORTED_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
# DSA models SGLang serves whose prefill the flag cannot shard, with what breaks and the fix.
REFUSED_ARCHITECTURES = {
    # GLM-5-Next (GLM-5.3-Flash; a vision tower over a hybrid text model, 3 of 4 layers KDA linear
    # attention, the rest DSA). SGLang 0.5.23 builds its KV cache in
    # `KVCacheConfigurator._build_hybrid_linear_kv_pool` as a `HybridLinearKVPool` over an unsharded
    # `DSATokenToKVPool` (no shard spec), then raises "does not support this model family" under
    # `--enable-kv-cache-sharding`; and `cp_tp_group_sharing_hook` (which every GLM-5-Next prefill CP
    # run takes) admits a PD prefill only with DFLASH, which `handle_kv_cache_sharding` refuses.
    "Glm5NextForConditionalGeneration": (
        "does not support GLM-5-Next (Glm5NextForConditionalGeneration): its KV cache is SGLang's hybrid "
        "linear-attention pool (KDA recurrent state plus a DSA pool for the indexed-attention layers), which "
        "SGLang's KV sharding has no page-interleaved version of (SGLang refuses that pool only when it builds "
        "it, after loading the weights), and SGLang runs its prefill CP as CP-TP group sharing, which on a PD "
        "prefill needs --speculative-algorithm DFLASH, a draft KV sharding does not take; serve GLM-5 "
        f"(GlmMoeDsaForCausalLM), or drop {FLAG}"
    ),
}
SUPPORTED_CP_STRATEGIES = ("interleave",)
# flashmla_sparse_q8 (SM90 fp8 prefill) reads a prefix batch's KV through the sharded pool's scratch as
# flashmla_sparse does (`get_key_buffer`, the translated `page_table_1_flattened`): shared KV equals
# replicated CP bit for bit under it, bf16 and fp8 KV (test/sglang_ext/layers/test_sglang_q8_forward.py).
SUPPORTED_DSA_PREFILL_BACKENDS = ("flashmla_sparse", "flashmla_sparse_q8")
DSA_PAGE_SIZE = 64
SUPPORTED_SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")  # NEXTN, SGLang's alias, is refused with its own fix


def check_sglang_version() -> str | None:
    """The one SGLang version check: hooks target 0.5.23's private functions and layouts."""
    from sglang.version import __version__

    if __version__ != SGLANG_VERSION:
        return (
            f"this plugin hooks SGLang {SGLANG_VERSION} internals but SGLang {__version__} is "
            f"installed; install sglang=={SGLANG_VERSION} or an sglang-nsa-cp release for "
            f"{__version__}"
        )
    return None


def _model_problems(server_args: Any) -> list[str]:
    from sglang.srt.configs.model_config import get_dsa_index_kpool, get_dsa_index_kpool_compress, is_deepseek_dsa

    hf_config = model_config_of(server_args).hf_config
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch in REFUSED_ARCHITECTURES:
        return [REFUSED_ARCHITECTURES[arch]]
    if arch not in SUPPORTED_ARCHITECTURES or not is_deepseek_dsa(hf_config):
        return [
            f"needs a DSA model, one of {SUPPORTED_ARCHITECTURES} with an indexer (index_topk) in "
            f"its config.json; got architecture {arch!r}; serve DeepSeek-V3.2 or GLM-5, or drop {FLAG}"
        ]
    if get_dsa_index_kpool(hf_config) != 1 or get_dsa_index_kpool_compress(hf_config):
        return [
            f"does not support pooled indexer keys yet (config index_kpool="
            f"{get_dsa_index_kpool(hf_config)}, index_kpool_compress="
            f"{get_dsa_index_kpool_compress(hf_config)}); serve a model with index_kpool 1 or drop {FLAG}"
        ]
    return []


def _speculative_problems(server_args: Any, cfg: Any) -> list[str]:
    """EAGLE / NEXTN with GLM-5's own single MTP layer, as SGLang's KV sharding takes it (its draft
    pool shares the target's logical pages, docs/speculative.md). Other drafts bring pools that
    are not sharded."""
    algorithm = cfg.speculative_algorithm
    if algorithm is None:
        return []
    if str(algorithm).upper() not in SUPPORTED_SPECULATIVE_ALGORITHMS:
        return [
            f"supports speculative decoding with --speculative-algorithm EAGLE (the model's own MTP layer) only, "
            f"got {algorithm}: other drafts bring their own non-DSA pool (EAGLE3's is MHA), which would keep "
            "per-rank capacity under N times as many logical slots; use EAGLE or drop --speculative-algorithm on "
            "the prefill instance"
        ]
    problems = []
    if str(algorithm).upper() == "NEXTN":
        problems.append(
            "needs --speculative-algorithm EAGLE, SGLang's name for the same MTP draft: its KV-sharding check runs "
            "before NEXTN becomes EAGLE and refuses it; use --speculative-algorithm EAGLE"
        )
    if cfg.speculative_draft_model_path not in (None, cfg.model_path):
        problems.append(
            f"needs the checkpoint's own MTP layer as the draft, got --speculative-draft-model-path "
            f"{cfg.speculative_draft_model_path}; leave it unset"
        )
    if cfg.enable_multi_layer_eagle:
        problems.append(
            "does not support --enable-multi-layer-eagle (one draft runner and pool per MTP step, not shared "
            "yet); drop it"
        )
    hf_config = model_config_of(server_args).hf_config
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch != "GlmMoeDsaForCausalLM":
        problems.append(
            f"supports speculative decoding on the prefill for GLM-5 (GlmMoeDsaForCausalLM) only, got {arch}: "
            "SGLang's sharded MTP draft pool is wired for GLM's NextN layer; drop --speculative-algorithm on the "
            "prefill instance"
        )
    if cfg.speculative_eagle_topk != 1:
        problems.append(
            f"needs --speculative-eagle-topk 1 (got {cfg.speculative_eagle_topk}): SGLang's sharded draft pool "
            "takes one chain, and its check runs before the defaults are filled in; pass --speculative-eagle-topk 1 "
            "--speculative-num-steps 1 --speculative-num-draft-tokens 2"
        )
    if getattr(hf_config, "num_nextn_predict_layers", 0) != 1:
        problems.append(
            f"needs a checkpoint with one MTP layer for {algorithm} (config num_nextn_predict_layers="
            f"{getattr(hf_config, 'num_nextn_predict_layers', None)}); drop --speculative-algorithm"
        )
    if getattr(hf_config, "index_share_for_mtp_iteration", False):
        problems.append(
            "does not support MTP IndexShare (config index_share_for_mtp_iteration): the prefill sends the "
            "draft indexer's top-k captured under CP, not verified with the shared pool; drop "
            "--speculative-algorithm on the prefill instance"
        )
    return problems


def _tree_core_env():
    from sglang.srt.environ import envs

    return envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND


def _sharding_problems(cfg: Any) -> list[str]:
    """What SGLang's own KV sharding, which the flag turns on, supports besides the backend
    (`arg_groups/kv_shard_hook.py::handle_kv_cache_sharding` checks these one at a time)."""
    problems = []
    if cfg.radix_cache_backend is not None:
        problems.append(
            f"needs SGLang's built-in radix cache (got --radix-cache-backend {cfg.radix_cache_backend}): owner "
            "rotation is kept on its tree nodes; drop --radix-cache-backend"
        )
    tree_core = _tree_core_env()
    if not cfg.disable_radix_cache and tree_core.is_set() and tree_core.get() != "python":
        problems.append(
            f"needs SGLang's Python radix tree core (got {tree_core.name}={tree_core.get()}): only it keeps the "
            f"owner rotation of cached pages; unset {tree_core.name} or set it to python"
        )
    if not cfg.chunked_prefill_size or cfg.chunked_prefill_size <= 0:
        problems.append(
            f"needs chunked prefill (got --chunked-prefill-size {cfg.chunked_prefill_size}): the gather scratch "
            "holds one chunk; pass --chunked-prefill-size 8192 (SGLang rounds it to whole pages)"
        )
    for option in ("enable_unified_memory", "enable_flexkv", "enable_streaming_session", "enable_session_radix_cache"):
        if getattr(cfg, option):
            flag = "--" + option.replace("_", "-")
            problems.append(
                f"does not support {flag} (it allocates or tracks pages outside the owner-rotating allocator); "
                f"drop {flag}"
            )
    return problems


def _hicache_problems(cfg: Any) -> list[str]:
    """HiCache runs on SGLang's owner-sharded host tier (docs/sglang_plugin.md, "HiCache")."""
    hicache = "with --enable-hierarchical-cache"
    problems = []
    if cfg.hicache_storage_backend is not None:
        problems.append(
            f"{hicache} does not support --hicache-storage-backend (got {cfg.hicache_storage_backend}): SGLang's "
            "storage path reads and writes whole pages per rank, while each rank holds only the pages it owns; "
            "drop --hicache-storage-backend (the host tier alone works)"
        )
    if cfg.hicache_host_memory_mode != "cache":
        problems.append(
            f"{hicache} needs --hicache-host-memory-mode cache (got {cfg.hicache_host_memory_mode}): the "
            "owner-sharded host tier keeps host copies; use --hicache-host-memory-mode cache"
        )
    if cfg.hicache_io_backend != "kernel" or cfg.hicache_mem_layout not in ("layer_first", "page_first"):
        problems.append(
            f"{hicache} needs --hicache-io-backend kernel with --hicache-mem-layout layer_first or page_first "
            f"(got {cfg.hicache_io_backend}, {cfg.hicache_mem_layout}): the owner-sharded transfers move each "
            "rank's own rows with those kernels; use --hicache-io-backend kernel --hicache-mem-layout layer_first"
        )
    if cfg.speculative_algorithm is not None:
        problems.append(
            f"{hicache} does not support speculative decoding yet (got --speculative-algorithm "
            f"{cfg.speculative_algorithm}): not run together; drop --speculative-algorithm on the prefill "
            "instance or drop --enable-hierarchical-cache"
        )
    return problems


def environment_problems() -> list[str]:
    """Every SGLANG_NSA_CP_* variable that does not parse, and a PD secret that is missing while the
    operator has not declared the PD network trusted: checked at start-up on both roles, before any
    weight loads (a bad value would otherwise surface at the KV-manager build or the first request)."""
    problems = []
    for var in envs.all():
        try:
            var.get()
        except ValueError as err:
            problems.append(f"{err}")
    secret, trusted = envs.SGLANG_NSA_CP_PD_SECRET, envs.SGLANG_NSA_CP_PD_NETWORK_TRUSTED
    try:
        unkeyed = secret.get() is None and not trusted.get()
    except ValueError:
        unkeyed = False  # reported above
    if unkeyed:
        problems.append(
            f"needs {secret.name} (at least 16 bytes, the same on the decode and every prefill rank, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`): without it anyone who reaches the "
            f"decode's status port can forge a room's commit or fail it; set it, or set {trusted.name}=1 once "
            "only the PD peers can reach the prefill and decode ports (docs/disagg.md, threat model)"
        )
    return problems


def _mooncake_problems(cfg: Any, moves: str) -> list[str]:
    """Owned pages travel over Mooncake only, and its ports must be confined. `moves`: what this
    role does with the pages ("ships" on a prefill, "takes" on a decode)."""
    if cfg.disaggregation_transfer_backend != "mooncake":
        return [
            f"{moves} owned pages over Mooncake only, got --disaggregation-transfer-backend "
            f"{cfg.disaggregation_transfer_backend}; use --disaggregation-transfer-backend mooncake"
        ]
    if not envs.SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED.get():
        return list(filter(None, [exposure(envs.SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED.name)]))
    return []


def find_problems(server_args: Any) -> list[str]:
    """Every reason the resolved arguments cannot run shared-KV prefill CP (or, on a PD decode,
    serve it), each with its fix."""
    cfg = resolving_view(server_args)
    problems = []
    version = check_sglang_version()
    if version:
        problems.append(version)
    problems += check_patch_points()  # SGLang's load_plugins() applied the hooks before resolution
    problems += environment_problems()
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return problems + [
            f"needs a real DSA checkpoint, got --model-path {cfg.model_path}; pass the model or drop {FLAG}"
        ]
    if cfg.disaggregation_mode == "decode":
        return problems + _mooncake_problems(cfg, "takes")  # the flag on a decode: its opt-in
    problems += _model_problems(server_args)

    if not cfg.enable_prefill_cp or cfg.attn_cp_size <= 1:
        problems.append(
            f"needs prefill CP (got --enable-prefill-cp {bool(cfg.enable_prefill_cp)}, --attn-cp-size "
            f"{cfg.attn_cp_size}); add --enable-prefill-cp --cp-strategy interleave --attn-cp-size N with N > 1, "
            f"or drop {FLAG}"
        )
    if cfg.enable_prefill_cp and cfg.cp_strategy not in SUPPORTED_CP_STRATEGIES:
        problems.append(
            f"supports --cp-strategy {'/'.join(SUPPORTED_CP_STRATEGIES)} only, got {cfg.cp_strategy!r} "
            "(SGLang's DSA CUDA path wires only interleave; its zigzag writes KV straight into the pool "
            "and rejects DeepSeek-V3.2); use --cp-strategy interleave"
        )
    if cfg.page_size != DSA_PAGE_SIZE:
        problems.append(
            f"needs the DSA page size {DSA_PAGE_SIZE}, got --page-size {cfg.page_size}; use --page-size {DSA_PAGE_SIZE}"
        )
    if cfg.enable_dsa_cache_layer_split:
        problems.append(
            "cannot be combined with --enable-dsa-cache-layer-split (a second way of de-replicating the "
            "same cache); drop one of the two flags"
        )
    if cfg.disaggregation_mode != "prefill":
        problems.append(
            f"runs only on a PD prefill instance and, as their opt-in, on its decode instances (got "
            f"--disaggregation-mode {cfg.disaggregation_mode}): each rank keeps only its own pages, so decoding "
            "on this instance would re-gather the whole context every token; add --disaggregation-mode prefill "
            f"and serve decode from a separate non-CP instance started with {FLAG} too"
        )
    else:
        problems += _mooncake_problems(cfg, "ships")
    if cfg.device != "cuda":
        problems.append(f"runs on CUDA only, got --device {cfg.device}; use --device cuda")
    if cfg.attention_backend != "dsa" or cfg.prefill_attention_backend not in (None, "dsa"):
        problems.append(
            f"needs the dsa attention backend, got --attention-backend {cfg.attention_backend} "
            f"(prefill {cfg.prefill_attention_backend}); leave both unset for DSA models"
        )
    if cfg.dsa_prefill_backend not in SUPPORTED_DSA_PREFILL_BACKENDS:
        problems.append(
            f"supports --dsa-prefill-backend {'/'.join(SUPPORTED_DSA_PREFILL_BACKENDS)} only, got "
            f"{cfg.dsa_prefill_backend!r} (the Hopper readers verified over SGLang's sharded pool: bf16 rows or an "
            "fp8 cache's prefix dequantized to bf16, or both cast to fp8 by flashmla_sparse_q8; SGLang's fp8 default "
            "on SM90, flashmla_kv, reads other layouts, and trtllm is SGLang's own Blackwell path); use "
            "--dsa-prefill-backend flashmla_sparse"
        )
    if cfg.dsa_prefill_backend == "flashmla_sparse_q8" and cfg.enable_mixed_chunk:
        problems.append(
            "cannot run --dsa-prefill-backend flashmla_sparse_q8 with --enable-mixed-chunk (q8 prefill runs on "
            "extend batches only; SGLang refuses the pair only when a scheduler builds its attention backend, "
            "after loading the weights); drop --enable-mixed-chunk or use --dsa-prefill-backend flashmla_sparse"
        )
    problems += _sharding_problems(cfg)
    if cfg.enable_hierarchical_cache:
        problems += _hicache_problems(cfg)
    if cfg.enable_hisparse or cfg.enable_lmcache:
        problems.append(
            "does not support HiSparse or LMCache yet (they copy whole pages of the pool, while each rank "
            "holds only its own pages); drop --enable-hisparse/--enable-lmcache"
        )
    problems += _speculative_problems(server_args, cfg)
    if cfg.pp_size != 1:
        problems.append(f"does not support pipeline parallelism yet, got --pp-size {cfg.pp_size}; use --pp-size 1")
    if cfg.dcp_size != 1:
        problems.append(f"does not support decode context parallelism, got --dcp-size {cfg.dcp_size}; use --dcp-size 1")
    if cfg.attn_dp_size != 1:
        problems.append(
            f"supports one CP group per instance for now, got --attn-dp-size {cfg.attn_dp_size}; use --attn-dp-size 1"
        )
    if cfg.enable_layernorm_sp:
        problems.append(
            "does not support --enable-layernorm-sp yet (it re-gathers the sequence-sharded residual before the "
            "LM head, where the narrow tail gather hands over only last-token rows); drop it"
        )
    if cfg.disaggregation_enable_kv_checksum:
        problems.append(
            "does not support --disaggregation-enable-kv-checksum (it reads a request's pages by logical id "
            "from the rank's own pool, which holds only the pages that rank owns); drop it"
        )
    if cfg.enable_two_batch_overlap:
        problems.append(
            "does not support --enable-two-batch-overlap (it rebuilds attention metadata per micro-batch, "
            "which replaces the pool's per-batch dense plan); drop it"
        )
    if cfg.cuda_graph_config.prefill.backend != Backend.DISABLED:
        problems.append(
            f"needs eager prefill (the per-batch page all-gather has data-dependent sizes), got prefill CUDA "
            f"graph backend {cfg.cuda_graph_config.prefill.backend!r}; add --cuda-graph-backend-prefill disabled"
        )
    return problems


def validate(server_args: Any) -> None:
    """Raise `SharedKVConfigError` listing every problem, or record the resolved decision."""
    if not requested(server_args):
        return
    problems = find_problems(server_args)
    if problems:
        raise SharedKVConfigError.listing(problems)
    if resolving_view(server_args).disaggregation_mode == "decode":
        if not getattr(server_args, DECODE_ATTR, False):
            setattr(server_args, DECODE_ATTR, True)  # pickled to the schedulers, as ATTR
            logger.info("%s: this decode serves shared-KV prefills (owned-page commit rule)", FLAG)
        return
    if not getattr(server_args, ATTR, False):
        # Bookkeeping attributes stay writable during resolution and are pickled to schedulers.
        setattr(server_args, ATTR, True)
        # SGLang's own KV sharding does the work: its page-interleaved pool (the plugin's
        # subclass), owner-rotating allocator, admission gate, HiCache tier and owner-page send.
        declare_resolution(server_args, FLAG, enable_kv_cache_sharding=True)
        # The environment the flag sets (ledger.ENVIRONMENT, its why), inherited by the schedulers.
        queue, batch = ENVIRONMENT
        os.environ.setdefault(queue.name, queue.value)
        layers = model_config_of(server_args).num_hidden_layers + 1
        os.environ.setdefault(batch.name, str(int(queue.value) // layers))
        logger.info(
            "%s: shared-KV prefill CP on SGLang's KV sharding (attn_cp_size=%d)",
            FLAG,
            resolving_view(server_args).attn_cp_size,
        )


def refuse_unvalidatable(server_args: Any, previous: Callable[[Any], None]) -> None:
    """`validate_prefill_cp_platform`: SGLang returns early for dummy models, before the full check."""
    cfg = resolving_view(server_args)
    if requested(server_args) and str(cfg.model_path).lower() in ("none", "dummy"):
        raise SharedKVConfigError(
            f"{FLAG}: needs a real DSA checkpoint, got --model-path {cfg.model_path}; pass the model or drop {FLAG}"
        )
    previous(server_args)


def validate_then(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Our check first (so its message, not a later generic one, names the problem), then SGLang's step."""
    validate(server_args)
    previous(server_args)
