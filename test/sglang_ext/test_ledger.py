"""CPU, ~10-20 s: the patch ledger (sglang_ext/ledger.py) against the installed SGLang 0.5.23.

Every target resolves with its recorded signature and is patched after SGLang's `load_plugins()`;
a renamed target, a changed signature or an unpatched target makes the start-up validation of
`--enable-nsa-prefill-cp-shared-kv` (SGLang's real resolution pipeline, on a config.json-only
model directory, an SM90 GPU patched in) refuse, naming the hook; docs/sglang_plugin.md carries
the generated table and its counts.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pkgutil  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.resolution import V32, write_config  # noqa: E402

from sglang_nsa_cp.sglang_ext.ledger import (  # noqa: E402
    LEDGER,
    check_patch_points,
    fingerprint,
    is_installed,
    markdown_table,
)

register_cpu_ci(est_time=20, suite="nsa-cp-test-cpu")

ROOT = Path(__file__).resolve().parents[2]
FLAG = "--enable-nsa-prefill-cp-shared-kv"
SPEC_HOOK = "mem_cache.page_interleave:make_page_shard_spec"


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


def test_every_target_resolves_with_its_recorded_signature():
    for point in LEDGER:
        target = pkgutil.resolve_name(point.target)
        assert fingerprint(target) == point.signature, (
            f"{point.target}: SGLang changed its signature; check {point.hook}, then re-record it "
            "(python -m sglang_nsa_cp.sglang_ext.ledger --fingerprints)"
        )


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


def _unwrap_target(monkeypatch):
    """The original function back in place, as when apply_hooks failed on the target."""
    from sglang.srt.mem_cache import page_interleave

    monkeypatch.setattr(page_interleave, "make_page_shard_spec", page_interleave.make_page_shard_spec.__wrapped__)


def _drop_resolution_step(monkeypatch):
    from sglang.srt.arg_groups import resolution_hooks

    monkeypatch.setitem(resolution_hooks._HOOKS, "handle_kv_cache_sharding", [])


# (fault, the hook the refusal must name, what it must say)
FAULTS = [
    (_rename_target, SPEC_HOOK, "its target no longer resolves"),
    (_change_signature, SPEC_HOOK, "its target's signature changed"),
    (_unwrap_target, SPEC_HOOK, "it is not installed"),
    (_drop_resolution_step, "arg_groups.parallel_hook:validate_then", "it is not installed"),
]


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


def test_module_prints_the_table_without_importing_sglang():
    code = "import runpy, sys; runpy.run_module('sglang_nsa_cp.sglang_ext.ledger', run_name='__main__'); "
    code += "assert 'sglang' not in sys.modules, 'the ledger imported sglang'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip("\n") == markdown_table()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
