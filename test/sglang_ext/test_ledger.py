"""CPU: the patch ledger (sglang_ext/ledger.py) against the installed SGLang 0.5.23.

Every target resolves with its recorded signature and is patched after SGLang's `load_plugins()`
(the plugin replaces no SGLang class: its pool subclass is adopted by a hook on SGLang's pool
builder, only with the flag). A renamed
target, a changed signature (of a target, or of an SGLang method a subclass overrides), a private
SGLang name an override relies on renamed or changed in kind, a hook that does not import, or an
unpatched target makes the start-up validation of `--enable-nsa-prefill-cp-shared-kv` (SGLang's
real resolution pipeline, on a config.json-only model directory, an SM90 GPU patched in) refuse,
naming the hook; so does SGLang refusing the resolution hooks that validate it, and each
scheduler checks again before it sizes its pool. docs/sglang_plugin.md carries the generated table
and its counts.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.resolution import V32, write_config  # noqa: E402

from sglang_nsa_cp.sglang_ext import ledger  # noqa: E402
from sglang_nsa_cp.sglang_ext.ledger import (  # noqa: E402
    LEDGER,
    check_patch_points,
    fingerprint,
    is_installed,
    markdown_table,
)

register_cpu_ci(est_time=20, suite="nsa-cp-test-cpu-unit")

ROOT = Path(__file__).resolve().parents[2]
FLAG = "--enable-nsa-prefill-cp-shared-kv"
SPEC_HOOK = "mem_cache.page_interleave:make_page_shard_spec"
POOL = "sglang.srt.mem_cache.page_interleave_pool.PageInterleaveDSATokenToKVPool"
POOL_HOOK = "mem_cache.kv_cache_configurator:adopt_sharded_dsa_pool"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("models") / "v32", V32)


def _resolve(model_path, flag=True):
    """A supported CP8 PD-prefill deployment, through SGLang's resolution pipeline."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", model_path, "--tp", "8", "--enable-prefill-cp", "--cp-strategy", "interleave",
            "--attn-cp-size", "8", "--device", "cuda", "--disaggregation-mode", "prefill"]  # fmt: skip
    server_args = prepare_server_args(argv + [FLAG] * flag)
    server_args.resolve_once()
    return server_args


def _point(hook):
    return next(p for p in LEDGER if p.hook == hook)


def test_every_target_resolves_with_its_recorded_signature(plugin):
    for point in LEDGER:
        target = ledger.resolve_sglang(point.target)
        assert fingerprint(target) == point.signature, (
            f"{point.target}: SGLang changed its signature; check {point.hook}, then re-record it "
            "(python -m sglang_nsa_cp.sglang_ext.ledger --fingerprints)"
        )


def test_every_fingerprint_covers_the_body_and_is_distinct(plugin):
    """SIGNATURE:BODY for every target, overridden method and copied function, no two the same
    (a signature alone repeats: three `(self)` methods, two `(server_args)` steps); a Triton
    kernel's is its Python function's, so the interpreter and the GPU agree."""
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import _quantize_k_cache_fast_kernel

    recorded = [fp for p in LEDGER for _, fp in ((p.target, p.signature), *p.overrides, *p.copies)]
    assert all(re.fullmatch(r"[0-9a-f]{12}:[0-9a-f]{12}", fp) for fp in recorded), recorded
    assert len(set(recorded)) == len(recorded), "two entries share a fingerprint"
    signatures = [fp.split(":")[0] for fp in recorded]
    assert len(set(signatures)) < len(signatures)  # what the bodies tell apart
    assert fingerprint(_quantize_k_cache_fast_kernel) == fingerprint(_quantize_k_cache_fast_kernel.fn)
    assert any(m.endswith("dsa_quant_k_cache.quantize_k_cache_separate") for p in LEDGER for m, _ in p.copies)


def test_every_hook_loads_and_every_step_is_overridable():
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    for point in LEDGER:
        assert callable(point.load_hook()), point.hook
        assert point.private == any(s.startswith("_") for s in point.target.split(".")), point.target
        if point.kind == "RESOLUTION":
            assert point.step in _OVERRIDABLE_HOOKS, f"{point.target}: not an overridable resolution step"
    assert len({(p.target, p.hook) for p in LEDGER}) == len(LEDGER), "a hook is listed twice"


def test_every_hook_is_installed_after_load_plugins(plugin):
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert [p.hook for p in LEDGER if not is_installed(p)] == []
    assert check_patch_points() == []
    # exactly the ledger's hooks, once each (load_plugins twice registers nothing twice)
    import sglang_nsa_cp.sglang_ext as ext

    ext.register()
    for point in LEDGER:
        if point.kind != "RESOLUTION":
            hooks = [h for _, h, _ in HookRegistry._hooks[point.target]]
            assert hooks.count(point.load_hook()) == 1, f"{point.hook} on {point.target}: {hooks}"


def _rename_target(monkeypatch):
    from sglang.srt.mem_cache import page_interleave

    monkeypatch.delattr(page_interleave, "make_page_shard_spec")  # as if SGLang renamed it


def _change_signature(monkeypatch):
    """SGLang adds a parameter; the plugin's hook still wraps the new function."""
    from sglang.srt.mem_cache import page_interleave
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def make_page_shard_spec(kvc, contexts=None):
        raise AssertionError("not called")

    hook = _point(SPEC_HOOK).load_hook()
    monkeypatch.setattr(page_interleave, "make_page_shard_spec", _wrap_fn(make_page_shard_spec, hook, HookType.AROUND))


def _change_body(monkeypatch):
    """SGLang changes what the function does, not its signature; the plugin's hook still wraps it."""
    from sglang.srt.mem_cache import page_interleave
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def make_page_shard_spec(kvc):
        return None  # a different body, the same signature

    hook = _point(SPEC_HOOK).load_hook()
    monkeypatch.setattr(page_interleave, "make_page_shard_spec", _wrap_fn(make_page_shard_spec, hook, HookType.AROUND))


def _change_overridden_body(monkeypatch):
    """SGLang's receiver clears a room differently; the plugin's `_clear` override still calls it."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    def _clear(self):
        return None

    monkeypatch.setattr(MooncakeKVReceiver, "_clear", _clear)


def _change_quantizer_math(monkeypatch):
    """SGLang's fp8 quantizer kernel, whose math the fused store copies, computes its scale otherwise."""
    from sglang.kernels.ops.quantization import dsa_quant_k_cache as quant

    source = inspect.getsource(quant._quantize_k_cache_fast_kernel.fn).replace("/ FP8_MAX", "/ (FP8_MAX - 1)")
    assert "FP8_MAX - 1" in source
    namespace = dict(vars(quant))
    exec(compile(textwrap.dedent(source), inspect.getsourcefile(quant), "exec"), namespace)
    monkeypatch.setattr(quant, "_quantize_k_cache_fast_kernel", namespace["_quantize_k_cache_fast_kernel"])


def _unwrap_target(monkeypatch):
    """The original function back in place, as when apply_hooks failed on the target."""
    from sglang.srt.mem_cache import page_interleave

    monkeypatch.setattr(page_interleave, "make_page_shard_spec", page_interleave.make_page_shard_spec.__wrapped__)


def _drop_resolution_step(monkeypatch):
    from sglang.srt.arg_groups import resolution_hooks

    monkeypatch.setitem(resolution_hooks._HOOKS, "handle_kv_cache_sharding", [])


def _sglang_pool_class():
    from sglang_nsa_cp.sglang_ext.ledger import resolve_sglang

    return resolve_sglang(POOL)


def _resign_sglang_set_mla_kv_buffer(monkeypatch):
    """SGLang's own pool gains a parameter on a method the plugin's subclass overrides (the
    subclass's override stays as it was)."""

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None, stream=None):
        raise AssertionError("not called")

    monkeypatch.setattr(_sglang_pool_class(), "set_mla_kv_buffer", set_mla_kv_buffer)


def _rename_shard_extend_active(monkeypatch):
    """SGLang's pool module as if SGLang renamed `_shard_extend_active` (a copy of its source, imported)."""
    source = Path(inspect.getsourcefile(_sglang_pool_class()))
    renamed = Path(tempfile.mkdtemp()) / "page_interleave_pool.py"
    renamed.write_text(source.read_text().replace("_shard_extend_active", "_shard_extend_running"))
    spec = importlib.util.spec_from_file_location("sglang.srt.mem_cache.page_interleave_pool_renamed", renamed)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    # the overridden method as it was (its body is fingerprinted): only the attribute's name changed
    module.PageInterleaveDSATokenToKVPool.set_mla_kv_buffer = _sglang_pool_class().set_mla_kv_buffer
    monkeypatch.setattr(importlib.import_module("sglang.srt.mem_cache.page_interleave_pool"),
                        "PageInterleaveDSATokenToKVPool", module.PageInterleaveDSATokenToKVPool)  # fmt: skip


def _make_slots_a_method(monkeypatch):
    """SGLang's pool turns `_slots`, which the subclass indexes, into a method."""
    monkeypatch.setattr(_sglang_pool_class(), "_slots", lambda self: [], raising=False)


def _break_hook_import(monkeypatch):
    """A hook module that does not import (as when a name it imports from SGLang went away)."""
    monkeypatch.setitem(sys.modules, "sglang_nsa_cp.sglang_ext.layers.cp.utils", None)


def _renamed_dataclass(monkeypatch, module, cls_name, old, new):
    """SGLang's dataclass `cls_name` as if SGLang renamed its field `old` to `new` (a fake with the
    same fields otherwise, in SGLang's module, where the ledger resolves it)."""
    import dataclasses

    cls = getattr(importlib.import_module(module), cls_name)
    fields = [(new if f.name == old else f.name, f.type, f) for f in dataclasses.fields(cls)]
    fake = dataclasses.make_dataclass(cls_name, [(n, t, dataclasses.field(default=f.default, default_factory=f.default_factory))
                                                 for n, t, f in fields])  # fmt: skip
    fake.__module__ = module
    monkeypatch.setattr(importlib.import_module(module), cls_name, fake)


def _rename_transfer_info_is_dummy(monkeypatch):
    """SGLang's Mooncake `TransferInfo.is_dummy`, which the prefill manager reads per destination, renamed."""
    _renamed_dataclass(
        monkeypatch, "sglang.srt.disaggregation.mooncake.conn", "TransferInfo", "is_dummy", "is_placeholder"
    )


def _rename_decode_request_kv_receiver(monkeypatch):
    """SGLang's `DecodeRequest.kv_receiver`, through which the decode hook finds the prefill's page
    ownership, renamed (the hook fell back to request order without a word)."""
    _renamed_dataclass(monkeypatch, "sglang.srt.disaggregation.decode", "DecodeRequest", "kv_receiver", "receiver")


def _move_fake_kv_receiver(monkeypatch):
    """SGLang moves `FakeKVReceiver`, which the decode hook imports to tell its warm-up request
    apart (that import raised in the decode's scheduler at the first request)."""
    monkeypatch.delattr(importlib.import_module("sglang.srt.disaggregation.fake.conn"), "FakeKVReceiver")


def _change_staging_rsp_layout(monkeypatch):
    """SGLang's staging reply moves a field, which the prefill's bootstrap screen parses where
    SGLang's handler did."""
    from sglang.srt.disaggregation.common import staging_handler

    def handle_staging_rsp(msg_parts, transfer_infos):
        return None

    monkeypatch.setattr(staging_handler, "handle_staging_rsp", handle_staging_rsp)


def _drop_transfer_info_from_zmq(monkeypatch):
    """SGLang's `TransferInfo.from_zmq`, the parser the bootstrap screen runs first, is gone."""
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    monkeypatch.delattr(TransferInfo, "from_zmq")


# (fault, the hook the refusal must name, what it must say)
FAULTS = [
    (_rename_target, SPEC_HOOK, "its target no longer resolves"),
    (_change_signature, SPEC_HOOK, "its target's signature changed"),
    (_change_body, SPEC_HOOK, "its target's body changed"),
    (_change_overridden_body, "disaggregation.utils:get_kv_class",
     "the overridden `sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver._clear`'s body changed"),
    (_change_quantizer_math, POOL_HOOK,
     "the copied `sglang.kernels.ops.quantization.dsa_quant_k_cache._quantize_k_cache_fast_kernel`'s body changed"),
    (_unwrap_target, SPEC_HOOK, "it is not installed"),
    (_drop_resolution_step, "arg_groups.parallel_hook:validate_then", "it is not installed"),
    (_resign_sglang_set_mla_kv_buffer, POOL_HOOK, f"the overridden `{POOL}.set_mla_kv_buffer`'s signature changed"),
    (_rename_shard_extend_active, POOL_HOOK, f"relies on SGLang's `{POOL}._shard_extend_active` (attribute), "
                                             "which is no longer set by SGLang's class"),
    (_rename_transfer_info_is_dummy, "disaggregation.utils:get_kv_class",
     "relies on SGLang's `sglang.srt.disaggregation.mooncake.conn.TransferInfo.is_dummy` (attribute), which is no "
     "longer set by SGLang's class"),
    (_rename_decode_request_kv_receiver, "disaggregation.decode:allocate_grouped_by_owner",
     "relies on SGLang's `sglang.srt.disaggregation.decode.DecodeRequest.kv_receiver` (attribute), which is no "
     "longer set by SGLang's class"),
    (_move_fake_kv_receiver, "disaggregation.decode:allocate_grouped_by_owner",
     "relies on SGLang's `sglang.srt.disaggregation.fake.conn.FakeKVReceiver` (class), which no longer resolves"),
    (_change_staging_rsp_layout, "disaggregation.utils:get_kv_class",
     "the copied `sglang.srt.disaggregation.common.staging_handler.handle_staging_rsp`'s"),
    (_drop_transfer_info_from_zmq, "disaggregation.utils:get_kv_class",
     "relies on SGLang's `sglang.srt.disaggregation.mooncake.conn.TransferInfo.from_zmq` (method), which is no "
     "longer defined"),
    (_make_slots_a_method, POOL_HOOK, f"`{POOL}._slots` (attribute), which is now a method"),
    (_break_hook_import, "layers.cp.utils:cp_gather_after_forward", "its hook does not import"),
]  # fmt: skip


@pytest.mark.parametrize("fault,hook,message", FAULTS, ids=[f[0].__name__.strip("_") for f in FAULTS])
def test_a_broken_patch_point_refuses_the_flag_naming_the_hook(plugin, model, sm90, monkeypatch, fault, hook, message):
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    fault(monkeypatch)
    problems = check_patch_points()
    assert len(problems) == 1 and problems[0].startswith(f"hook {hook} (") and message in problems[0], problems
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(model)
    assert f"  - hook {hook} (" in str(err.value) and message in str(err.value), str(err.value)
    assert not getattr(_resolve(model, flag=False), ATTR, False)  # without the flag nothing refuses


def test_no_sglang_class_is_replaced(plugin):
    """SGLang's pool name stays SGLang's class after `load_plugins()`; the ledger reads it for the
    overridden method and the private names."""
    from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool as Plugin

    sglang_pool = ledger.resolve_sglang(POOL)
    assert pkgutil.resolve_name(POOL) is sglang_pool and Plugin.__bases__ == (sglang_pool,)
    assert sglang_pool.__module__ == "sglang.srt.mem_cache.page_interleave_pool"
    assert ledger.resolve_sglang(f"{POOL}.set_mla_kv_buffer") is sglang_pool.set_mla_kv_buffer
    assert {"_slots", "_shard_extend_active"} <= ledger.attributes_set_on_self(sglang_pool)
    assert all(p.kind != "REPLACE" for p in LEDGER)


def test_the_ledger_lists_every_private_sglang_name_the_pool_overrides_use(plugin):
    """Every `self._name` the subclass reads that SGLang's class defines is in `relies_on`, with its kind."""
    import ast

    from sglang_nsa_cp.sglang_ext.mem_cache import page_interleave_pool

    cls = page_interleave_pool.PageInterleaveDSATokenToKVPool  # the plugin's module
    tree = ast.parse(inspect.getsource(cls))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_")
            and not node.attr.startswith("__") and node.attr not in vars(cls)}  # fmt: skip
    kinds = {name: "method" if inspect.isfunction(getattr(ledger.resolve_sglang(POOL), name, None)) else "attribute"
             for name in used}  # fmt: skip
    point = next(p for p in LEDGER if p.hook == POOL_HOOK)
    assert dict((n.rsplit(".", 1)[1], k) for n, k in point.relies_on) == kinds


def _attributes_read(source: str, owners: set[str]) -> set[str]:
    """Names read as `X.name` in `source`, X a name in `owners` or an attribute `.o` with o in `owners`."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in owners) or (
                isinstance(owner, ast.Attribute) and owner.attr in owners
            ):
                names.add(node.attr)
    return names


def test_the_ledger_lists_every_sglang_name_the_pd_classes_and_the_guard_read(plugin):
    """Issue 47: every name, private or not, of SGLang's Mooncake manager, sender and receiver that
    the PD subclasses (`self.`, `kv_mgr.`) or the status guard (`mgr.`) read is in the get_kv_class
    point's `relies_on`, with its kind (listed beyond what the source reads as attributes: only
    `prefill_info`, which SGLang sets in `init()` and the plugin reads with `vars()`, and SGLang's
    wire-format switch `kv_status_msg_carries_reason`, which the plugin's manager sets on its class)."""
    from sglang_nsa_cp.sglang_ext.disaggregation import status_guard
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn

    mooncake = "sglang.srt.disaggregation.mooncake.conn"
    point = next(p for p in LEDGER if p.target.endswith("disaggregation.utils.get_kv_class"))
    ours = set(vars(conn.OwnedPageKVManager)) | set(vars(conn.OwnedPageKVSender)) | set(vars(conn.OwnedPageKVReceiver))
    reads = {
        "MooncakeKVManager": _attributes_read(inspect.getsource(conn.OwnedPageKVManager), {"self"})
        | _attributes_read(inspect.getsource(conn), {"kv_mgr", "mgr"})
        | _attributes_read(inspect.getsource(status_guard), {"mgr"}),
        "MooncakeKVSender": _attributes_read(inspect.getsource(conn.OwnedPageKVSender), {"self"}),
        "MooncakeKVReceiver": _attributes_read(inspect.getsource(conn.OwnedPageKVReceiver), {"self", "receiver"}),
    }
    for cls_name, used in reads.items():
        cls = ledger.resolve_sglang(f"{mooncake}.{cls_name}")
        sglangs = {n for n in used - ours if hasattr(cls, n) or n in ledger.attributes_set_on_self(cls)}
        kinds = {
            n: "method" if inspect.isfunction(inspect.getattr_static(cls, n, None)) else "attribute" for n in sglangs
        }
        listed = {n.rsplit(".", 1)[1]: k for n, k in point.relies_on if n.rsplit(".", 1)[0] == f"{mooncake}.{cls_name}"}
        assert set(listed) - set(kinds) <= {"prefill_info", "kv_status_msg_carries_reason"}, (
            cls_name,
            listed.keys() - kinds,
        )
        assert kinds.items() <= listed.items(), (cls_name, kinds.items() - listed.items())


def test_the_decode_hook_does_not_fall_back_to_request_order_on_a_renamed_name():
    """Issue 47: `prefill_owner_cp_size` read SGLang's objects through `getattr(..., default)`, so a
    renamed `DecodeRequest.kv_receiver` quietly gave CP 1 (request order). It now reads them
    directly: a missing name raises, naming it (and the ledger refuses it at start-up)."""
    from types import SimpleNamespace

    from sglang_nsa_cp.sglang_ext.disaggregation.decode import prefill_owner_cp_size

    req = object()
    info = SimpleNamespace(enable_kv_cache_sharding=True, attn_cp_size=4)
    queue = SimpleNamespace(queue=[SimpleNamespace(req=req, kv_receiver=SimpleNamespace(prefill_info=info))])
    assert prefill_owner_cp_size(queue, req) == 4
    queue.queue[0] = SimpleNamespace(req=req, receiver=SimpleNamespace(prefill_info=info))
    with pytest.raises(AttributeError, match="kv_receiver"):
        prefill_owner_cp_size(queue, req)
    # SGLang's warm-up request on a decode has its fake receiver (no prefill, no bootstrap address)
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

    queue.queue[0] = SimpleNamespace(req=req, kv_receiver=object.__new__(FakeKVReceiver))
    assert prefill_owner_cp_size(queue, req) == 1


def test_sglang_refusing_the_resolution_hooks_refuses_the_flag(plugin, model, sm90, monkeypatch):
    """SGLang refuses every resolution hook: nothing would validate the flag, so parsing it refuses."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    ours = {p.load_hook() for p in LEDGER if p.kind == "RESOLUTION"}
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: [h for h in v if h not in ours]
                                                     for k, v in resolution_hooks._HOOKS.items()})  # fmt: skip

    def refuse(step):
        raise ValueError(f"{step} is not an overridable resolution step")

    monkeypatch.setattr(resolution_hooks, "register_resolution_hook", refuse)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list, {k: list(v) for k, v in HookRegistry._hooks.items()}))
    monkeypatch.setattr(ledger, "_NOT_REGISTERED", {})
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()  # as SGLang's load_plugins() calls it in a fresh process
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(model)
    assert "its start-up validation cannot run" in str(err.value), str(err.value)
    for step in ("handle_context_parallelism", "handle_kv_cache_sharding"):
        assert f"hook arg_groups.parallel_hook:validate_then on `{step}`: it was not registered (SGLang refused " \
            f"it: ValueError: {step} is not an overridable" in str(err.value), str(err.value)  # fmt: skip
    assert not getattr(_resolve(model, flag=False), ATTR, False)


def test_each_scheduler_checks_the_patch_points_before_it_sizes_its_pool(plugin, monkeypatch):
    """A scheduler with the flag requested (a prefill's, or an opted-in decode's) refuses to
    configure its KV cache when a patch point is not in place in its own process, or when the
    launcher's validation never ran."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave import make_page_shard_spec
    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR, REQUEST_ATTR

    server_args = SimpleNamespace(**{REQUEST_ATTR: True, ATTR: True})
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server_args)
    monkeypatch.setattr(ledger, "_checked_ok", False)
    kvc = SimpleNamespace(is_draft_worker=False)
    assert make_page_shard_spec(lambda kvc: None, kvc) is None  # all in place: SGLang's answer (sharding off)
    monkeypatch.setattr(ledger, "_checked_ok", False)
    with monkeypatch.context() as broken:
        _resign_sglang_set_mla_kv_buffer(broken)
        with pytest.raises(RuntimeError, match=f"  - hook {POOL_HOOK} .*set_mla_kv_buffer`'s signature changed"):
            make_page_shard_spec(lambda kvc: None, kvc)
    monkeypatch.setattr(ledger, "_checked_ok", False)
    decode = SimpleNamespace(**{REQUEST_ATTR: True, DECODE_ATTR: True})  # a decode's scheduler, opted in
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: decode)
    assert make_page_shard_spec(lambda kvc: None, kvc) is None
    monkeypatch.setattr(ledger, "_checked_ok", False)
    with monkeypatch.context() as broken:
        _change_overridden_signature(broken)  # a method the decode's manager overrides
        with pytest.raises(RuntimeError, match=r"  - hook disaggregation.utils:get_kv_class .*maybe_send_extra"):
            make_page_shard_spec(lambda kvc: None, kvc)
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server_args)
    setattr(server_args, ATTR, False)  # requested, but no resolution step wrote the decision
    with pytest.raises(RuntimeError, match="was requested but its start-up validation never ran"):
        make_page_shard_spec(lambda kvc: None, kvc)
    setattr(server_args, REQUEST_ATTR, False)
    assert make_page_shard_spec(lambda kvc: None, kvc) is None  # not requested: no check


def test_docs_carry_the_generated_table_and_the_counts():
    doc = (ROOT / "docs" / "sglang_plugin.md").read_text()
    table = doc.split("<!-- ledger:begin -->\n", 1)[1].split("\n<!-- ledger:end -->", 1)[0]
    assert table == markdown_table(), (
        "docs/sglang_plugin.md's ledger table is stale: paste `python -m sglang_nsa_cp.sglang_ext.ledger` "
        "between its ledger markers"
    )
    counts = re.search(
        r"There are (\d+) patch points, (\d+) of them on private SGLang names.*?\s+subclasses the plugin "
        r"installs override (\d+) SGLang methods, (\d+) of them private",
        doc,
        re.S,
    )
    assert counts, "docs/sglang_plugin.md lost the sentence counting the patch points"
    overrides = [method.rsplit(".", 1)[1] for p in LEDGER for method, _ in p.overrides]
    private = sum(m.startswith("_") and not m.startswith("__") for m in overrides)
    want = (len(LEDGER), sum(p.private for p in LEDGER), len(overrides), private)
    assert tuple(map(int, counts.groups())) == want, f"update the counts in docs/sglang_plugin.md to {want}"
    assert len(LEDGER) <= 12, "at most 12 patch points: fold a new one into an existing subclass or hook"


def test_the_ledger_lists_every_sglang_method_the_subclasses_override(plugin):
    """A method a subclass overrides is fingerprinted, so an SGLang change to it refuses the flag."""
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn
    from sglang_nsa_cp.sglang_ext.mem_cache import page_interleave_pool as pool

    overridden = set()
    for cls in (conn.OwnedPageKVManager, conn.OwnedPageKVSender, conn.OwnedPageKVReceiver,
                pool.PageInterleaveDSATokenToKVPool):  # fmt: skip
        base = cls.__mro__[1]
        overridden |= {f"{base.__module__}.{base.__qualname__}.{name}" for name, value in vars(cls).items()
                       if callable(value) and hasattr(base, name)}  # fmt: skip
    assert overridden == {method for p in LEDGER for method, _ in p.overrides}


def _change_overridden_signature(monkeypatch):
    """SGLang adds a parameter to a method the plugin's Mooncake manager overrides."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    monkeypatch.setattr(MooncakeKVManager, "maybe_send_extra", lambda self, req, indices, executor, more: None)


def test_a_changed_overridden_method_refuses_the_flag(plugin, model, sm90, monkeypatch):
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError

    _change_overridden_signature(monkeypatch)
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(model)
    assert "  - hook disaggregation.utils:get_kv_class (" in str(err.value), str(err.value)
    assert "the overridden `sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra`'s " \
        "signature changed" in str(err.value), str(err.value)  # fmt: skip


def test_the_environment_the_flag_sets_is_the_ledgers(plugin, model, sm90, monkeypatch):
    """Every variable the flag's resolution sets beyond what SGLang's resolution of the same server
    without it sets is a ledger entry (`ENVIRONMENT`, in the table), set only where the operator did
    not. (SGLang's own KV sharding, which the flag turns on, picks its Python radix tree core in the
    environment: SGLang's, not the plugin's.)"""
    names = {e.name for e in ledger.ENVIRONMENT}
    sglangs = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # arg_groups/kv_shard_hook.py:handle_kv_cache_sharding
    for name in names | {sglangs}:
        monkeypatch.setenv(name, "unset by the test")  # restored (removed) at teardown
        monkeypatch.delenv(name)
    _resolve(model, flag=False)  # what SGLang's own resolution sets
    assert not names & set(os.environ)
    before = dict(os.environ)
    _resolve(model)
    changed = {k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)} - {sglangs}
    assert changed == names, changed
    assert all(f"`{name}`" in markdown_table() for name in names)
    queue = ledger.ENVIRONMENT[0].name
    monkeypatch.setenv(queue, "1024")  # the operator's value stays
    _resolve(model)
    assert os.environ[queue] == "1024"


def _drop_hook_registry_patched(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.delattr(HookRegistry, "_patched")


def test_a_private_sglang_name_the_ledger_reads_refuses_when_gone(plugin, monkeypatch):
    """The ledger's own reads of SGLang privates (`LEDGER_READS`, in the table) are checked before any
    hook is: gone, the check names it instead of failing with an AttributeError."""
    assert [n for n, _ in ledger.LEDGER_READS] == ["sglang.srt.arg_groups.resolution_hooks._HOOKS",
                                                   "sglang.srt.plugins.hook_registry.HookRegistry._patched"]  # fmt: skip
    _drop_hook_registry_patched(monkeypatch)
    (problem,) = check_patch_points()
    assert "reads SGLang's private `sglang.srt.plugins.hook_registry.HookRegistry._patched` (a set)" in problem
    assert "and it is gone" in problem, problem


def test_module_prints_the_table_without_importing_sglang():
    code = "import runpy, sys; runpy.run_module('sglang_nsa_cp.sglang_ext.ledger', run_name='__main__'); "
    code += "assert 'sglang' not in sys.modules, 'the ledger imported sglang'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip("\n") == markdown_table()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
