"""The patch ledger: every point where the plugin changes SGLang 0.5.23, as data.

`register()` (`sglang_ext/__init__.py`) installs the entries of `LEDGER` in its order: HookRegistry
hooks (BEFORE / AFTER / AROUND), which SGLang's `load_plugins()` then applies, and
RESOLUTION steps (`register_resolution_hook`). SGLang's `HookRegistry.apply_hooks()` only logs a
target it cannot patch and carries on, so `check_patch_points()` fails closed: with the flag,
start-up refuses, naming the hook, when a hook does not import or SGLang refused it, a target (or
an SGLang method a hook's subclass overrides, or an SGLang function whose math or parsing the plugin copies)
no longer resolves or changed signature or body (`fingerprint`), an SGLang name (private or not)
a hook or an override reads is gone or changed kind, or a hook is not installed. The launcher checks during argument
resolution, on a prefill and on a decode (the flag there is the decode's opt-in), and each of
their schedulers again before it sizes its KV pool (`require_patch_points()`, from the
`make_page_shard_spec` hook): every process that applies a hook.

    python -m sglang_nsa_cp.sglang_ext.ledger                 # the table docs/sglang_plugin.md carries
    python -m sglang_nsa_cp.sglang_ext.ledger --fingerprints  # current fingerprints, to re-record

Adding or removing a hook: its `PatchPoint` here (fingerprints from `--fingerprints`), then the
table and counts in docs/sglang_plugin.md. Importing this module imports neither sglang nor hooks.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import pkgutil
import sys
import textwrap
from dataclasses import dataclass
from importlib import import_module

PACKAGE = "sglang_nsa_cp.sglang_ext"
KINDS = ("BEFORE", "AFTER", "AROUND", "RESOLUTION")
NAME_KINDS = ("method", "attribute", "class")  # what an SGLang name the plugin relies on must be
RECORDED_FOR = "0.5.23"  # the SGLang version the fingerprints below were recorded on


@dataclass(frozen=True)
class PatchPoint:
    """One patched SGLang target.

    target: dotted path in sglang; for RESOLUTION, the resolution step's function (its last
    segment is the step name). hook: "module:function", the module relative to `PACKAGE`.
    signature: `fingerprint()` of the target in SGLang `RECORDED_FOR`. why: one line.
    upstream: the upstream SGLang change that would remove the patch. overrides: the SGLang methods
    that the subclass the hook installs (the classes a hook answers or adopts) overrides,
    each with its fingerprint, checked like the target's. copies: SGLang functions whose math or parsing the
    plugin's code reproduces (the fused fp8 store: SGLang's quantizer), fingerprinted the same way.
    relies_on: the SGLang names (private or
    not) those overrides and the hook read on SGLang's objects, each `Class.name` with its kind
    ("method", or "attribute": a class attribute, a field, or set on `self` by SGLang's class; or
    "class": an SGLang class the plugin imports, e.g. to tell SGLang's fake receiver apart).
    """

    target: str
    kind: str
    hook: str
    signature: str
    why: str
    upstream: str
    overrides: tuple[tuple[str, str], ...] = ()  # (SGLang method, fingerprint) a hook's subclass overrides
    copies: tuple[tuple[str, str], ...] = ()  # (SGLang function, fingerprint) whose math or parsing the plugin copies
    relies_on: tuple[tuple[str, str], ...] = ()  # (SGLang `Class.name`, its kind) the plugin reads

    def __post_init__(self):
        assert self.kind in KINDS, f"{self.target}: kind {self.kind!r} not in {KINDS}"
        assert self.hook.count(":") == 1, f"{self.target}: hook {self.hook!r} is not 'module:function'"
        for name, kind in self.relies_on:
            assert kind in NAME_KINDS, f"{self.target}: {name} has kind {kind!r}, not one of {NAME_KINDS}"

    @property
    def private(self) -> bool:
        """Whether any segment of the target is private to SGLang (starts with `_`)."""
        return any(part.startswith("_") for part in self.target.split("."))

    @property
    def step(self) -> str:
        """The resolution step a RESOLUTION entry wraps."""
        return self.target.rsplit(".", 1)[1]

    def load_hook(self):
        module, function = self.hook.split(":")
        return getattr(import_module(f"{PACKAGE}.{module}"), function)


_S = "sglang.srt."
_COMMON = f"{_S}disaggregation.common.conn"
_MOONCAKE = f"{_S}disaggregation.mooncake.conn"
_NO_FIELD_API = "a plugin API to declare ServerArgs fields and their CLI flags"
_PERMANENT = "none (start-up validation is the plugin's own)"
_NARROW = "SGLang gathers only last-token rows for CP batches that need no more"
_SHARDED_PD = "SGLang keys its sharded PD transfer on the pool, not its own flag, and checks coverage on the decode"
_POOL = f"{_S}mem_cache.page_interleave_pool.PageInterleaveDSATokenToKVPool"
_QUANT = "sglang.kernels.ops.quantization.dsa_quant_k_cache"  # SGLang's fp8 DSA quantizer


def _names(owner: str, names: str, methods: tuple[str, ...] = ("_prefill_unique_rank", "check_status",
           "conclude_failure")) -> tuple[tuple[str, str], ...]:  # fmt: skip
    """`relies_on` entries: SGLang's `owner` class and the space-separated attribute `names` the
    plugin reads on its objects (those in `methods` are methods)."""
    return tuple((f"{owner}.{name}", "method" if name in methods else "attribute") for name in names.split())


# What the PD subclasses, the status guard and the decode hook read on SGLang's objects.
_PD_MANAGER_NAMES = (
    "_deferred_abort_ack_tracker _prefill_unique_rank _staging_handler check_status conclude_failure "
    "defer_decode_allocation disaggregation_mode enable_staging failure_lock failure_records kv_args "
    "kv_status_msg_carries_reason kv_status_msg_tag prefill_response_tracker request_status "
    "required_prefill_response_num_table transfer_infos"
)
_PD_RECEIVER_NAMES = "bootstrap_room kv_mgr prefill_info required_dst_info_num"
_PREFILL_INFO_NAMES = (
    "attn_cp_size enable_kv_cache_sharding pp_size target_cp_ranks target_pp_ranks target_tp_rank target_tp_ranks"
)

# Fixed order: the flag before the validation that reads it, pools before the forward hooks.
LEDGER: tuple[PatchPoint, ...] = (
    # server_args.py
    PatchPoint(f"{_S}server_args.ServerArgs.add_cli_args", "AFTER", "server_args:add_cli_args", "8aa4240c52bb:f8e1950c62c3",
               "declares the flag on SGLang's parser (ServerArgs has no API to add a field)", _NO_FIELD_API),
    PatchPoint(f"{_S}server_args.ServerArgs.from_cli_args", "AROUND", "server_args:from_cli_args", "be17884e3c31:e42b052ddfaa",
               "copies the flag to `_nsa_cp_shared_kv_requested`, which SGLang pickles to its schedulers",
               _NO_FIELD_API),
    # arg_groups/parallel_hook.py
    PatchPoint(f"{_S}arg_groups.parallel_hook.validate_prefill_cp_platform", "RESOLUTION",
               "arg_groups.parallel_hook:refuse_unvalidatable", "87875d985046:30b9aed3bc67",
               "refuses the flag with `--model-path dummy`, for which SGLang skips the rest", _PERMANENT),
    PatchPoint(f"{_S}arg_groups.parallel_hook.handle_context_parallelism", "RESOLUTION",
               "arg_groups.parallel_hook:validate_then", "87875d985046:ed0b39c1a7dc",
               "the start-up checks (this ledger's too), before SGLang's CP checks and `init_cp_strategy`",
               _PERMANENT),
    PatchPoint(f"{_S}arg_groups.kv_shard_hook.handle_kv_cache_sharding", "RESOLUTION",
               "arg_groups.parallel_hook:validate_then", "e548fdb79089:b35516c4c975",
               "the same checks after late capability adjustments (SGLang runs this step again last)", _PERMANENT),
    # arg_groups/kv_shard_hook.py
    PatchPoint(f"{_S}arg_groups.kv_shard_hook.validate_kv_shard_attention_backend", "AROUND",
               "arg_groups.kv_shard_hook:validate_kv_shard_attention_backend", "ed9f2ffa89ab:215c1efda6cf",
               "SGLang's KV sharding admits DSA only with trtllm and fp8 (Blackwell); the flag's checks cover Hopper",
               "the validator admits `flashmla_sparse` with bf16 and fp8 KV (docs/upstream.md, item 1)"),
    # mem_cache/page_interleave.py, mem_cache/page_interleave_pool.py
    PatchPoint(f"{_S}mem_cache.page_interleave.make_page_shard_spec", "AROUND",
               "mem_cache.page_interleave:make_page_shard_spec", "257ab401a067:e97bf445263e",
               "the sharded scratch holds SGLANG_NSA_CP_SCRATCH_CONTEXTS contexts (default 1), not SGLang's fixed 8",
               "a server setting for `_KV_SHARD_SCRATCH_PREFIX_CONTEXTS`"),
    PatchPoint(f"{_S}mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool", "AFTER",
               "mem_cache.kv_cache_configurator:adopt_sharded_dsa_pool", "26a241a9d280:25943fb95d92",
               "with the flag, SGLang's sharded DSA pool becomes the plugin's subclass: the fp8 chunk quantized "
               "once (one pass for scratch and owned rows)",
               "the same change in `PageInterleaveDSATokenToKVPool` (docs/upstream.md)",
               overrides=((f"{_POOL}.set_mla_kv_buffer", "50d382e4c2f9:42929dcd3c83"),),
               copies=((f"{_QUANT}.quantize_k_cache_separate", "900b310910aa:c3dfb199fc8b"), (f"{_QUANT}._quantize_k_cache_fast_separate", "85132f489439:e83617337888"),
                       (f"{_QUANT}._quantize_k_cache_fast_kernel", "4a0a692c0951:a6a7cda216ec")),
               relies_on=((f"{_POOL}._slots", "attribute"), (f"{_POOL}._shard_extend_active", "attribute"),
                          (f"{_POOL}._translate_loc_cached", "method"))),
    # layers/cp/utils.py
    PatchPoint(f"{_S}layers.cp.utils.cp_gather_after_forward", "AROUND", "layers.cp.utils:cp_gather_after_forward",
               "37aa32f39122:405413c77e1e", "the narrow tail gather: N x bs last-token rows instead of every token's hidden state, "
               "returned in SGLang's [total_tokens, hidden] layout",
               _NARROW),
    # disaggregation/utils.py, disaggregation/common/conn.py
    PatchPoint(f"{_S}disaggregation.utils.get_kv_class", "AROUND", "disaggregation.utils:get_kv_class", "be9901394e6a:7a83a11c8e9c",
               "SGLang builds the plugin's Mooncake manager, sender and receiver: owned-page self-check and "
               "manifests (prefill), the commit rule (decode)", _SHARDED_PD,
               overrides=(
                   (f"{_MOONCAKE}.MooncakeKVManager.__init__", "bd013469fe2e:3f44a3cfbadf"),
                   (f"{_MOONCAKE}.MooncakeKVManager.add_transfer_request", "78f460ef87a7:da6cc207de58"),
                   (f"{_MOONCAKE}.MooncakeKVManager.maybe_send_extra", "155ffbab59eb:a42b620ad923"),
                   (f"{_MOONCAKE}.MooncakeKVManager.conclude_transfer", "0fb1c79a8940:dfe8160c94b6"),
                   (f"{_MOONCAKE}.MooncakeKVManager._encode_kv_status_message", "07e27438bb8e:2c9d85a12c0d"),
                   (f"{_MOONCAKE}.MooncakeKVManager.parse_kv_status_message", "a3584c3f4414:0b5e78269b57"),
                   (f"{_MOONCAKE}.MooncakeKVManager.apply_prefill_status", "49b6dd30b364:fc3d7906f001"),
                   (f"{_MOONCAKE}.MooncakeKVManager._make_worker_recv", "186d0a73099c:6c506422610f"),
                   (f"{_MOONCAKE}.MooncakeKVManager.build_receiver_metadata_message", "9f0d80d17c5f:bc62530b0955"),
                   (f"{_MOONCAKE}.MooncakeKVSender._prepare_send_indices", "12d63999a40d:206af34e6632"),
                   (f"{_MOONCAKE}.MooncakeKVSender.clear", "f4ca892d9e9f:0d9d86feac20"),
                   (f"{_MOONCAKE}.MooncakeKVReceiver.__init__", "92e5d7186036:9a75d8aa5189"),
                   (f"{_MOONCAKE}.MooncakeKVReceiver.send_metadata", "aa806ab9e114:d379a4c1aa11"),
                   (f"{_MOONCAKE}.MooncakeKVReceiver._check_waiting_timeout", "f4ca892d9e9f:98aa350de03a"),
                   (f"{_MOONCAKE}.MooncakeKVReceiver._clear", "f4ca892d9e9f:76ebc71f62dd"),
               ),
               # the prefill's bootstrap screen (`status_guard.bootstrap_message_problem`) parses what
               # SGLang's bootstrap thread and its staging handlers parse, frame by frame
               copies=((f"{_MOONCAKE}.MooncakeKVManager.start_prefill_thread", "f4ca892d9e9f:284e857907bc"),
                       (f"{_S}disaggregation.common.staging_handler.handle_watermark_msg", "8f973009cad0:df49b7f6fe4e"),
                       (f"{_S}disaggregation.common.staging_handler.handle_staging_rsp", "6a91cce4b2f3:c48cb9c8eab6")),
               relies_on=(*_names(f"{_MOONCAKE}.MooncakeKVManager", _PD_MANAGER_NAMES),
                          *_names(f"{_MOONCAKE}.MooncakeKVSender", "bootstrap_room curr_idx kv_mgr num_kv_indices"),
                          *_names(f"{_MOONCAKE}.MooncakeKVReceiver", _PD_RECEIVER_NAMES),
                          *_names(f"{_S}disaggregation.base.conn.KVArgs", "aux_data_lens aux_data_ptrs aux_item_lens "
                                  "kv_data_lens kv_item_lens state_types"),
                          *_names(f"{_MOONCAKE}.TransferInfo", "dst_kv_indices dst_port dst_state_indices endpoint "
                                  "is_dummy room"),
                          (f"{_MOONCAKE}.TransferInfo.from_zmq", "method"),
                          (f"{_MOONCAKE}.KVArgsRegisterInfo.from_zmq", "method"),
                          *_names(f"{_COMMON}.PrefillServerInfo", _PREFILL_INFO_NAMES),
                          *_names(f"{_COMMON}.DeferredAbortAckState", "generation"))),
    PatchPoint(f"{_COMMON}.get_zmq_socket_on_host", "AROUND", "disaggregation.common.conn:limit_status_frames",
               "1528319d6891:702d2a64029e", "a decode manager's status socket gets ZMQ_MAXMSGSIZE and a 65,536-message ZMQ_RCVHWM before "
               "it binds", _SHARDED_PD),
    # disaggregation/decode.py
    PatchPoint(f"{_S}disaggregation.decode.DecodePreallocQueue._alloc_for_decode_prealloc", "AROUND",
               "disaggregation.decode:allocate_grouped_by_owner", "3543d1920c47:c2fcc2927ba4",
               "decode: re-deals a request's pages so each prefill rank's owned positions form one run",
               "SGLang's decode allocator learns the prefill's page ownership",
               relies_on=(*_names(f"{_S}disaggregation.decode.DecodePreallocQueue", "kv_manager queue"),
                          *_names(f"{_S}disaggregation.decode.DecodeRequest", "kv_receiver req"),
                          *_names(f"{_MOONCAKE}.MooncakeKVReceiver", "bootstrap_addr prefill_info"),
                          *_names(f"{_MOONCAKE}.MooncakeKVManager", "prefill_info_table"),
                          *_names(f"{_COMMON}.PrefillServerInfo", "attn_cp_size enable_kv_cache_sharding"),
                          (f"{_S}disaggregation.fake.conn.FakeKVReceiver", "class"))),
)  # fmt: skip


@dataclass(frozen=True)
class EnvironmentSetting:
    """A variable the flag's start-up validation sets in the launcher's environment (only where the
    operator did not: `os.environ.setdefault`), which SGLang's schedulers and Mooncake inherit."""

    name: str
    value: str  # what it is set to
    why: str


# What the flag changes in SGLang's and Mooncake's environment (`parallel_hook.validate`, a
# shared-KV prefill only); nothing else is set.
ENVIRONMENT: tuple[EnvironmentSetting, ...] = (
    EnvironmentSetting("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535",
                       "Mooncake's TCP queue takes ~2048 entries a peer by default, 65535 at most: the most"),
    EnvironmentSetting("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "65535 // (layers + 1)",
                       "SGLang's batches (an entry a page and layer, the MTP layer's included) kept under that queue"),
)  # fmt: skip

# SGLang's private names the ledger itself reads to tell whether a hook is installed, with the
# type each must be; checked first (without them no installation can be checked).
LEDGER_READS: tuple[tuple[str, type], ...] = (
    (f"{_S}arg_groups.resolution_hooks._HOOKS", dict),
    (f"{_S}plugins.hook_registry.HookRegistry._patched", set),
)


def _ledger_read_problems() -> list[str]:
    problems = []
    for name, kind in LEDGER_READS:
        try:
            value = pkgutil.resolve_name(name)
        except (ImportError, AttributeError, ValueError) as err:
            value = err
        if not isinstance(value, kind):
            problems.append(
                f"the ledger reads SGLang's private `{name}` (a {kind.__name__}) to check its hooks, and it is "
                f"{'gone' if isinstance(value, Exception) else f'a {type(value).__name__}'}; port "
                f"`is_installed` in sglang_ext/ledger.py to the installed SGLang, or install sglang=={RECORDED_FOR}"
            )
    return problems


# Patch points `register()` could not register in this process: target -> why (an import error, SGLang's refusal).
_NOT_REGISTERED: dict[str, str] = {}
_checked_ok = False  # `require_patch_points()` found everything in place in this process


def record_not_registered(point: PatchPoint, why: str) -> None:
    _NOT_REGISTERED[point.target] = why


def resolve_sglang(name: str):
    """SGLang's object at dotted `name` (what a hook wraps: `HookRegistry`'s wrappers keep it as
    `__wrapped__`, which the fingerprint follows)."""
    return pkgutil.resolve_name(name)


def _function(target):
    """The Python function behind `target`: under HookRegistry's wrappers (`__wrapped__`), a
    bound method's function, a Triton kernel's (`JITFunction.fn`, the same under the interpreter)."""
    fn = inspect.unwrap(target)
    fn = getattr(fn, "__func__", fn)
    while not inspect.isfunction(fn) and inspect.isfunction(getattr(fn, "fn", None)):
        fn = fn.fn
    return fn


def fingerprint(target) -> str:
    """`SIGNATURE:BODY`, each the first 12 hex of a sha256. SIGNATURE: of the target's signature
    without annotations (parameter names, kinds and defaults; a typing-only change or another
    Python's way of printing types does not count). BODY: of its source, each line's trailing
    blanks dropped (the same on every Python, unlike bytecode; a changed comment counts too: check
    the hook and re-record). Follows `__wrapped__`, so it is the same once hooks are applied.
    Raises OSError when the source cannot be read."""
    fn = _function(target)
    signature = inspect.signature(fn)
    bare = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty,
    )
    source = "\n".join(line.rstrip() for line in textwrap.dedent(inspect.getsource(fn)).splitlines())
    return f"{hashlib.sha256(str(bare).encode()).hexdigest()[:12]}:{hashlib.sha256(source.encode()).hexdigest()[:12]}"


def _closes_over(fn, hook) -> bool:
    """Whether `fn`, or a function it wraps, is a wrapper whose closure holds `hook` (what
    `HookRegistry`'s wrappers are: a call of the target reaches the hook)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)  # a classmethod's bound method
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def is_installed(point: PatchPoint) -> bool:
    """Whether SGLang calls the point's hook: a registered resolution wrapper, or a target that
    `HookRegistry.apply_hooks()` patched and whose current value wraps the hook."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS as resolution_wrappers
    from sglang.srt.plugins.hook_registry import HookRegistry

    hook = point.load_hook()
    if point.kind == "RESOLUTION":
        return hook in resolution_wrappers.get(point.step, ())
    current = pkgutil.resolve_name(point.target)
    return point.target in HookRegistry._patched and _closes_over(current, hook)


def current_fingerprint(target: str) -> str:
    """The target's fingerprint now, or why it has none."""
    try:
        obj = resolve_sglang(target)
    except (ImportError, AttributeError, ValueError) as err:
        return f"unresolved ({type(err).__name__}: {err})"
    try:
        return fingerprint(obj)
    except OSError as err:  # an install without SGLang's .py sources
        return f"unreadable ({err})"
    except (TypeError, ValueError) as err:  # no longer a function
        return f"none ({err})"


def _signature_problem(what: str, target: str, recorded: str) -> str | None:
    now = current_fingerprint(target)
    if now.startswith("unresolved"):
        return (
            f"{what} no longer resolves in the installed SGLang ({now[len('unresolved (') : -1]}); port the hook "
            f"to the new target and update its entry in sglang_ext/ledger.py, or install sglang=={RECORDED_FOR}"
        )
    if now.startswith("unreadable"):
        return (
            f"{what}'s source cannot be read to fingerprint its body ({now[len('unreadable (') : -1]}); "
            "install SGLang with its .py sources"
        )
    if now != recorded:
        part = "signature" if now.split(":")[0] != recorded.split(":")[0] else "body"
        return (
            f"{what}'s {part} changed (fingerprint {now}, recorded {recorded} for SGLang "
            f"{RECORDED_FOR}); check the hook against the new code, then re-record it from "
            "`python -m sglang_nsa_cp.sglang_ext.ledger --fingerprints`"
        )
    return None


@functools.cache
def attributes_set_on_self(cls: type) -> frozenset[str]:
    """Names SGLang's code assigns on `self` (`self.x = ...`) in `cls` or its SGLang bases: the
    instance attributes a class sets, read from its source, so no instance is needed."""
    names = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("sglang."):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return frozenset(names)


def _declared_fields(cls: type) -> set[str]:
    """Fields SGLang's classes declare (annotations: dataclasses, `KVArgs`), over the MRO."""
    return {n for klass in cls.__mro__ if klass.__module__.startswith("sglang.") for n in vars(klass).get("__annotations__", {})}  # fmt: skip


def _name_problem(name: str, kind: str) -> str | None:
    """What is wrong with the SGLang `name` the plugin relies on as a `kind`, if anything."""
    if kind == "class":
        try:
            cls = resolve_sglang(name)
        except (ImportError, AttributeError, ValueError) as err:
            return f"no longer resolves ({type(err).__name__}: {err})"
        return None if isinstance(cls, type) else f"is now a {type(cls).__name__}, not a class"
    owner, attr = name.rsplit(".", 1)
    try:
        cls = resolve_sglang(owner)
    except (ImportError, AttributeError, ValueError) as err:
        return f"its class no longer resolves ({type(err).__name__}: {err})"
    try:
        attributes_set_on_self(cls)
    except (OSError, TypeError) as err:  # an install without SGLang's .py sources
        return f"cannot be checked: SGLang's source of {cls.__qualname__} is not readable ({err})"
    static = inspect.getattr_static(cls, attr, None)
    is_method = inspect.isfunction(static) or isinstance(static, (classmethod, staticmethod))
    if kind == "method":
        if is_method:
            return None
        return (
            "is no longer a method"
            if static is not None or attr in attributes_set_on_self(cls)
            else ("is no longer defined")
        )
    if is_method:
        return "is now a method, not an attribute"
    if static is not None or attr in attributes_set_on_self(cls) or attr in _declared_fields(cls):
        return None
    return "is no longer set by SGLang's class (renamed or removed)"


def _relies_on_problem(point: PatchPoint) -> str | None:
    for name, kind in point.relies_on:
        problem = _name_problem(name, kind)
        if problem:
            return (
                f"it relies on SGLang's `{name}` ({kind}), which {problem}; port the override to "
                f"the installed SGLang and update `relies_on` in sglang_ext/ledger.py, or install "
                f"sglang=={RECORDED_FOR}"
            )
    return None


def _problem(point: PatchPoint) -> str | None:
    if point.target in _NOT_REGISTERED:
        return f"it was not registered ({_NOT_REGISTERED[point.target]}); fix that cause"
    try:
        point.load_hook()
    except ImportError as err:
        return f"its hook does not import ({type(err).__name__}: {err}); fix that import"
    problem = _signature_problem("its target", point.target, point.signature)
    for method, recorded in point.overrides:
        problem = problem or _signature_problem(f"the overridden `{method}`", method, recorded)
    for function, recorded in point.copies:
        problem = problem or _signature_problem(f"the copied `{function}`", function, recorded)
    problem = problem or _relies_on_problem(point)
    if problem:
        return problem
    if not is_installed(point):
        return (
            "it is not installed (SGLang's `HookRegistry.apply_hooks()` logs 'Failed to apply hooks to' the "
            "target, with the cause); fix that cause, and make sure SGLang's `load_plugins()` ran in this "
            "process before argument resolution"
        )
    return None


def check_patch_points() -> list[str]:
    """One problem per patch point that is not in place, naming the hook, its target and the fix.

    Run it after SGLang's `load_plugins()` (registration, then `HookRegistry.apply_hooks()`); the
    start-up checks do, during argument resolution, which every SGLang entry point runs after it,
    and each scheduler does through `require_patch_points()`."""
    problems = _ledger_read_problems()
    if problems:
        return problems
    for point in LEDGER:
        problem = _problem(point)
        if problem:
            problems.append(f"hook {point.hook} ({point.kind} `{point.target}`): {problem}")
    return problems


def unvalidated_problem() -> str | None:
    """Why the flag's start-up validation cannot run, when none of the resolution steps that run it
    is in place (the flag would otherwise be ignored), else None."""
    validating = [p for p in LEDGER if p.kind == "RESOLUTION" and p.hook.endswith(":validate_then")]
    problems = {p.step: _problem(p) for p in validating}
    if all(problems.values()):
        return "its start-up validation cannot run: " + "; ".join(
            f"hook {p.hook} on `{p.step}`: {problems[p.step]}" for p in validating
        )
    return None


def require_patch_points(flag: str) -> None:
    """Raise `RuntimeError` naming every patch point that is not in place in this process (once
    all are, later calls cost nothing). A scheduler runs it before it builds a pool for `flag`."""
    global _checked_ok
    if _checked_ok:
        return
    problems = check_patch_points()
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise RuntimeError(f"{flag}: {len(problems)} patch point(s) not in place in this process:\n{lines}")
    _checked_ok = True


def markdown_table() -> str:
    """The table docs/sglang_plugin.md carries between `<!-- ledger:begin -->` and `<!-- ledger:end -->`."""
    lines = ["| target | kind | private | why | upstream change that removes it |", "| --- | --- | --- | --- | --- |"]
    for p in LEDGER:
        lines.append(f"| `{p.target}` | {p.kind} | {'yes' if p.private else ''} | {p.why} | {p.upstream} |")
    lines += ["", "SGLang methods the plugin's subclasses override (fingerprinted like the targets):", ""]
    for p in LEDGER:
        if p.overrides or p.relies_on:
            methods = ", ".join(f"`{m.rsplit('.', 2)[-2]}.{m.rsplit('.', 1)[-1]}`" for m, _ in p.overrides)
            lines.append(f"- through `{p.target}`: {methods or 'no override'}")
            if p.copies:
                copied = ", ".join(f"`{m.rsplit('.', 1)[-1]}`" for m, _ in p.copies)
                lines.append(f"  - SGLang functions whose math or parsing the plugin copies, fingerprinted: {copied}")
            if p.relies_on:
                names = ", ".join(f"`{'.'.join(n.rsplit('.', 2)[-2:])}` ({kind})" for n, kind in p.relies_on)
                lines.append(f"  - SGLang names the plugin reads there, checked for kind: {names}")
    lines += [
        "",
        "Environment the flag sets on a shared-KV prefill, where the operator did not (`os.environ.setdefault`):",
        "",
    ]
    lines += [f"- `{e.name}` = {e.value}: {e.why}" for e in ENVIRONMENT]
    lines += ["", "SGLang private names the ledger itself reads to check its hooks:", ""]
    lines += [f"- `{name}` ({kind.__name__})" for name, kind in LEDGER_READS]
    return "\n".join(lines)


def fingerprint_report() -> str:
    """The current fingerprint of every target, marking those that differ from the ledger's."""
    lines = []
    for p in LEDGER:
        for target, recorded in ((p.target, p.signature), *p.overrides, *p.copies):
            now = current_fingerprint(target)
            lines.append(f"{now}  {target}" + ("" if now == recorded else f"  (recorded {recorded})"))
    return "\n".join(lines)


if __name__ == "__main__":
    print(fingerprint_report() if "--fingerprints" in sys.argv[1:] else markdown_table())
