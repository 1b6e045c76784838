"""CPU: the plugin's registration, the `--enable-nsa-prefill-cp-shared-kv` flag and its
start-up validation, inside SGLang 0.5.23 (sglang_ext/__init__.py, server_args.py,
arg_groups/parallel_hook.py).

The plugin is loaded the way SGLang loads it: `load_plugins()` discovers the
`sglang.srt.plugins` entry point of the installed package. Validation runs in SGLang's real
resolution pipeline (`ServerArgs.resolve_once`) on tiny config.json-only model directories; the
stand-ins are `torch.cuda.get_device_capability`, patched to an SM90 GPU so that resolution
(which asks the GPU for its defaults) runs on a CPU machine, and SGLang's platform check for
Mamba state snapshots, answered as on CUDA (GLM-5-Next's KDA layers ask it). Two subprocess tests run
`python -m sglang.launch_server` itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.resolution import TINY_DSA  # noqa: E402

register_cpu_ci(est_time=40, suite="nsa-cp-test-cpu-unit")

FLAG = "--enable-nsa-prefill-cp-shared-kv"

_MODELS = {
    "v32": ("DeepseekV32ForCausalLM", "deepseek_v32", True),
    "glm5": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", True),
    "v3": ("DeepseekV3ForCausalLM", "deepseek_v3", False),  # MLA without the DSA indexer
}
# A supported deployment: one CP8 PD-prefill instance (flag -> value; None: a switch).
GOOD = {"--tp": "8", "--enable-prefill-cp": None, "--cp-strategy": "interleave", "--attn-cp-size": "8",
        "--device": "cuda", "--disaggregation-mode": "prefill"}  # fmt: skip
DROP = object()


def _argv(model_path, changes=None):
    args = dict(GOOD, **(changes or {}))
    argv = ["--model-path", model_path]
    for flag, value in args.items():
        if value is not DROP:
            argv += [flag] if value is None else [flag, value]
    return argv + [FLAG]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, (arch, model_type, dsa) in _MODELS.items():
        config = dict(TINY_DSA, architectures=[arch], model_type=model_type)
        if not dsa:
            for key in ("index_topk", "index_head_dim", "index_n_heads"):
                config.pop(key)
        variants = {name: config}
        if dsa:  # the same checkpoint with its MTP layer (what EAGLE / NEXTN drafts with)
            variants[f"{name}_mtp"] = dict(config, num_nextn_predict_layers=1)
        for variant, cfg in variants.items():
            (root / variant).mkdir()
            (root / variant / "config.json").write_text(json.dumps(cfg))
            paths[variant] = str(root / variant)
    # GLM-5-Next: a vision-language config whose DSA text model (NoPE, 3 of 4 layers KDA linear
    # attention) is nested under text_config, as its checkpoints ship it
    text = dict(TINY_DSA, model_type="glm5_next_text", num_hidden_layers=4, qk_rope_head_dim=0, index_kpool=1,
                linear_num_heads=8, linear_head_dim=64, mhc=False)  # fmt: skip
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text}
    (root / "glm5_next").mkdir()
    (root / "glm5_next" / "config.json").write_text(json.dumps(config))
    paths["glm5_next"] = str(root / "glm5_next")
    return paths


def _resolve(argv):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def test_register_installs_every_hook(plugin):
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_nsa_cp.sglang_ext.ledger import LEDGER

    for point in LEDGER:  # every patch point, as test_ledger.py checks in depth
        hook = point.load_hook()
        if point.kind == "RESOLUTION":
            assert hook in resolution_hooks._HOOKS[point.step], f"{point.hook} not on step {point.step}"
        else:
            assert point.target in HookRegistry._patched, f"{point.target} not patched"
            assert any(h is hook for _, h, _ in HookRegistry._hooks[point.target]), (
                f"{point.hook} not on {point.target}"
            )
    plugin.register()  # a second call (a second load_plugins in the process) registers nothing twice
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import validate_then

    assert resolution_hooks._HOOKS["handle_context_parallelism"].count(validate_then) == 1


def _decision(monkeypatch, attrs=None):
    """Published ServerArgs carrying `attrs` (the decisions the start-up validation writes); None:
    none published (a tool, a unit test: the plugin reads SGLANG_NSA_CP_SHARED_KV)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    def get_server_args():
        if attrs is None:
            raise ValueError("Global server args is not set yet!")
        return SimpleNamespace(**attrs)

    monkeypatch.setattr(runtime_context, "get_server_args", get_server_args)


def test_without_the_flag_sglang_gets_its_own_classes_and_results(plugin, monkeypatch):
    """Installed and loaded, nothing asked (no flag on a prefill, no opt-in on a decode): SGLang's
    own `get_kv_class` (hooked) answers SGLang's Mooncake classes, SGLang's pool name is its own
    class and a pool it builds stays that class, and every runtime hook hands SGLang's own result
    back; with the prefill's decision, or a decode's opt-in, the plugin's classes."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.disaggregation import mooncake
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache import page_interleave_pool
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from sglang_nsa_cp.sglang_ext.arg_groups.kv_shard_hook import validate_kv_shard_attention_backend
    from sglang_nsa_cp.sglang_ext.disaggregation.common.conn import limit_status_frames
    from sglang_nsa_cp.sglang_ext.disaggregation.decode import allocate_grouped_by_owner
    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn
    from sglang_nsa_cp.sglang_ext.layers.cp.utils import cp_gather_after_forward
    from sglang_nsa_cp.sglang_ext.mem_cache import page_interleave_pool as plugin_pool
    from sglang_nsa_cp.sglang_ext.mem_cache.kv_cache_configurator import adopt_sharded_dsa_pool
    from sglang_nsa_cp.sglang_ext.mem_cache.page_interleave import make_page_shard_spec
    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR

    kinds = (KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER)
    sglangs_classes = [mooncake.MooncakeKVManager, mooncake.MooncakeKVSender, mooncake.MooncakeKVReceiver]
    ours = [conn.OwnedPageKVManager, conn.OwnedPageKVSender, conn.OwnedPageKVReceiver]
    sglang_pool = page_interleave_pool.PageInterleaveDSATokenToKVPool
    assert sglang_pool.__module__ == "sglang.srt.mem_cache.page_interleave_pool" and sglang_pool is not plugin_pool
    assert plugin_pool.PageInterleaveDSATokenToKVPool.__bases__ == (sglang_pool,)

    def built_pool():  # what SGLang's `_build_token_to_kv_pool` hands out through the plugin's AFTER hook
        return adopt_sharded_dsa_pool(object.__new__(sglang_pool), SimpleNamespace())

    slots = torch.arange(64, 64 + 4 * 64)  # four pages in request order, from an owner-sharded CP 2 prefill
    info = SimpleNamespace(enable_kv_cache_sharding=True, attn_cp_size=2)
    req = object()
    queue = SimpleNamespace(queue=[SimpleNamespace(req=req, kv_receiver=SimpleNamespace(prefill_info=info))])

    def decode_pages():
        return allocate_grouped_by_owner(lambda self, allocator, **kw: slots, queue, SimpleNamespace(page_size=64),
                                         req=req)  # fmt: skip

    sglangs = object()  # what SGLang's original returns

    def original(*args, **kwargs):
        return sglangs

    monkeypatch.delenv("SGLANG_NSA_CP_SHARED_KV", raising=False)
    for attrs in (None, {ATTR: False, DECODE_ATTR: False}):  # nothing published (a tool), or a server
        _decision(monkeypatch, attrs)
        assert [get_kv_class(TransferBackend.MOONCAKE, k) for k in kinds] == sglangs_classes, attrs
        assert type(built_pool()) is sglang_pool, attrs
        assert torch.equal(decode_pages(), slots), f"{attrs}: a decode that did not opt in keeps request order"
        assert validate_kv_shard_attention_backend(original, SimpleNamespace()) is sglangs
        assert make_page_shard_spec(original, SimpleNamespace(is_draft_worker=False)) is sglangs
        assert cp_gather_after_forward(original, torch.zeros(3, 4), SimpleNamespace()) is sglangs
        assert limit_status_frames(original, SimpleNamespace(), 0) is sglangs
    assert KVCacheConfigurator._build_token_to_kv_pool.__wrapped__  # the hook is on SGLang's builder
    for attrs, pool_class in (({ATTR: True}, plugin_pool.PageInterleaveDSATokenToKVPool),
                              ({DECODE_ATTR: True}, sglang_pool)):  # fmt: skip
        _decision(monkeypatch, attrs)
        assert [get_kv_class(TransferBackend.MOONCAKE, k) for k in kinds] == ours, attrs
        assert get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER) is not conn.OwnedPageKVManager
        assert type(built_pool()) is pool_class, attrs
    got = decode_pages()  # the opted-in decode re-deals an owner-sharded prefill's pages by owner
    assert not torch.equal(got, slots) and torch.equal(got.sort().values, slots)
    info.enable_kv_cache_sharding = False  # a replicated CP prefill: SGLang's order
    assert torch.equal(decode_pages(), slots)


def test_launch_server_help_lists_the_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert FLAG in out.stdout, "flag missing from --help"
    assert "Failed to execute general plugin" not in out.stderr, out.stderr[-2000:]


def test_flag_parses_and_survives_pickling(plugin, models):
    from sglang.srt.server_args import prepare_server_args

    from sglang_nsa_cp.sglang_ext.server_args import REQUEST_ATTR

    on = prepare_server_args(_argv(models["v32"]))
    off = prepare_server_args(["--model-path", models["v32"]])
    assert getattr(on, REQUEST_ATTR) is True and getattr(off, REQUEST_ATTR) is False
    assert getattr(pickle.loads(pickle.dumps(on)), REQUEST_ATTR) is True  # what scheduler processes receive


@pytest.mark.parametrize(
    "model,kv_dtype,backend",
    [("v32", "bfloat16", "flashmla_sparse"), ("glm5", "bfloat16", "flashmla_sparse"),
     ("v32", "fp8_e4m3", "flashmla_sparse"), ("glm5", "fp8_e4m3", "flashmla_sparse"),
     ("glm5", "bfloat16", "flashmla_sparse_q8"), ("glm5", "fp8_e4m3", "flashmla_sparse_q8")],
)  # fmt: skip
def test_supported_configuration_resolves_enabled_and_reaches_the_schedulers(
    plugin, models, sm90, model, kv_dtype, backend
):
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    # SGLang's fp8 default prefill backend on SM90 is flashmla_kv: the fp8 deployment names flashmla_sparse
    server_args = _resolve(_argv(models[model], {"--kv-cache-dtype": kv_dtype, "--dsa-prefill-backend": backend}))
    assert getattr(server_args, ATTR) is True
    assert getattr(pickle.loads(pickle.dumps(server_args)), ATTR) is True
    cfg = resolving_view(server_args)
    assert (cfg.page_size, cfg.dsa_prefill_backend, cfg.kv_cache_dtype) == (64, backend, kv_dtype)
    assert cfg.enable_kv_cache_sharding is True  # SGLang's own sharding does the work
    # without the flag nothing changes
    plain = _resolve(_argv(models[model])[:-1])
    assert not getattr(plain, ATTR, False) and not resolving_view(plain).enable_kv_cache_sharding


@pytest.mark.parametrize("model,algorithm", [("glm5_mtp", "EAGLE")])
def test_mtp_speculative_decoding_resolves_enabled(plugin, models, sm90, model, algorithm):
    """EAGLE with GLM-5's own MTP layer: SGLang's sharded draft pool shares the target's logical
    pages (docs/speculative.md)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    server_args = _resolve(_argv(models[model], {"--speculative-algorithm": algorithm, **ONE_CHAIN}))
    assert getattr(server_args, ATTR) is True
    assert resolving_view(server_args).speculative_algorithm == "EAGLE"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_hicache_resolves_enabled_with_the_python_tree_core(plugin, models, sm90, monkeypatch, layout):
    """The host tier (kernel I/O) is accepted; SGLang's own sharding picks the Python radix tree
    core (the one that keeps owner rotation) unless the user chose one, which must be python."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    core = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
    monkeypatch.setenv(core, "unset by the test")  # restored (removed) at teardown
    monkeypatch.delenv(core)
    hicache = {"--enable-hierarchical-cache": None, "--hicache-io-backend": "kernel", "--hicache-mem-layout": layout}
    server_args = _resolve(_argv(models["v32"], hicache))
    assert getattr(server_args, ATTR) is True
    cfg = resolving_view(server_args)
    assert (cfg.enable_hierarchical_cache, cfg.hicache_mem_layout, cfg.hicache_storage_backend) == (True, layout, None)
    assert os.environ[core] == "python"
    monkeypatch.setenv(core, "rust")
    with pytest.raises(SharedKVConfigError, match=f"needs SGLang's Python radix tree core \\(got {core}=rust\\)"):
        _resolve(_argv(models["v32"], hicache))


def test_env_var_enables_it_for_engine_users(plugin, models, sm90, monkeypatch):
    """`sglang.Engine(**kwargs)` builds ServerArgs without the parser: the env var asks instead."""
    from sglang.srt.server_args import ServerArgs

    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    kwargs = dict(model_path=models["glm5"], tp_size=8, enable_prefill_cp=True, cp_strategy="interleave",
                  attn_cp_size=8, device="cuda", disaggregation_mode="prefill")  # fmt: skip
    monkeypatch.setenv("SGLANG_NSA_CP_SHARED_KV", "1")
    server_args = ServerArgs(**kwargs)
    server_args.resolve_once()
    assert getattr(server_args, ATTR) is True
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError

    with pytest.raises(SharedKVConfigError, match="runs only on a PD prefill instance"):
        ServerArgs(**dict(kwargs, disaggregation_mode="null")).resolve_once()


def test_the_flag_on_a_decode_is_its_opt_in(plugin, models, sm90, monkeypatch):
    """The same flag on a PD decode resolves as the decode's opt-in (the decision the plugin's
    Mooncake classes and decode hook read), with none of the prefill's CP checks and without
    SGLang's KV sharding; refused, naming the fix, over another transfer backend or with
    Mooncake's ports not confined. Without the flag a decode resolves as SGLang's."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR

    decode = ["--model-path", models["v32"], "--disaggregation-mode", "decode", "--device", "cuda"]
    server_args = _resolve(decode + [FLAG])
    assert getattr(server_args, DECODE_ATTR) is True and not getattr(server_args, ATTR, False)
    assert getattr(pickle.loads(pickle.dumps(server_args)), DECODE_ATTR) is True  # reaches the schedulers
    assert not resolving_view(server_args).enable_kv_cache_sharding
    assert not getattr(_resolve(decode), DECODE_ATTR, False)
    with pytest.raises(SharedKVConfigError, match="takes owned pages over Mooncake only"):
        _resolve(decode + ["--disaggregation-transfer-backend", "nixl", FLAG])
    monkeypatch.delenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED")
    with pytest.raises(SharedKVConfigError, match="then set SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED=1"):
        _resolve(decode + [FLAG])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_flag_needs_the_pd_secret_unless_the_network_is_declared_trusted(plugin, models, sm90, monkeypatch, role):
    """Issue 47: without SGLANG_NSA_CP_PD_SECRET forged statuses committed rooms early. The flag now
    refuses to start without it, on both roles, naming both fixes, unless the operator declares the
    PD network trusted; a secret too short is refused at start-up too (it was only at the KV-manager
    build, after the weights)."""
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR

    argv = _argv(models["v32"]) if role == "prefill" else [
        "--model-path", models["v32"], "--disaggregation-mode", "decode", "--device", "cuda", FLAG]  # fmt: skip
    decision = ATTR if role == "prefill" else DECODE_ATTR
    monkeypatch.delenv("SGLANG_NSA_CP_PD_SECRET")
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(argv)
    assert "1 problem(s)" in str(err.value), str(err.value)
    assert "needs SGLANG_NSA_CP_PD_SECRET" in str(err.value) and "or set SGLANG_NSA_CP_PD_NETWORK_TRUSTED=1" in str(
        err.value
    ), str(err.value)
    assert not getattr(_resolve(argv[:-1]), decision, False)  # without the flag: SGLang's, nothing asked
    monkeypatch.setenv("SGLANG_NSA_CP_PD_NETWORK_TRUSTED", "1")
    assert getattr(_resolve(argv), decision) is True
    monkeypatch.setenv("SGLANG_NSA_CP_PD_SECRET", "short")
    with pytest.raises(SharedKVConfigError, match="SGLANG_NSA_CP_PD_SECRET is 5 bytes long; it must be at least 16"):
        _resolve(argv)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(
    "name,value,message",
    [
        ("SGLANG_NSA_CP_SCRATCH_CONTEXTS", " 2", "has spaces around its value"),
        ("SGLANG_NSA_CP_SCRATCH_CONTEXTS", "0", "must be at least 1"),
        ("SGLANG_NSA_CP_KERNELS", "cuda", "expected one of ('auto', 'triton', 'torch')"),
        ("SGLANG_NSA_CP_PD_NETWORK_TRUSTED", "maybe", "is not a boolean"),
    ],
)
def test_a_bad_variable_refuses_the_flag_at_start_up(plugin, models, sm90, monkeypatch, role, name, value, message):
    """Issue 47: these passed the start-up check and were refused only after the weights loaded
    (pool sizing, the first fp8 request); a decode had no start-up check. Now every SGLANG_NSA_CP_*
    variable is parsed during argument resolution, on both roles."""
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError

    argv = _argv(models["v32"]) if role == "prefill" else [
        "--model-path", models["v32"], "--disaggregation-mode", "decode", "--device", "cuda", FLAG]  # fmt: skip
    monkeypatch.setenv(name, value)
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(argv)
    assert name in str(err.value) and message in str(err.value), str(err.value)


# SGLang's KV sharding checks the draft's top-k before it fills in the defaults: name them
ONE_CHAIN = {"--speculative-eagle-topk": "1", "--speculative-num-steps": "1", "--speculative-num-draft-tokens": "2"}

# (name, model, changes to GOOD, expected message)
BAD = [
    ("not a DSA model", "v3", {}, "needs a DSA model"),
    ("GLM-5-Next", "glm5_next", {}, "does not support GLM-5-Next (Glm5NextForConditionalGeneration): its KV cache"),
    ("no prefill CP", "v32", {"--enable-prefill-cp": DROP, "--attn-cp-size": "1"}, "needs prefill CP"),
    ("zigzag", "glm5", {"--cp-strategy": "zigzag"}, "supports --cp-strategy interleave only"),
    (
        "layer split",
        "glm5",
        {"--enable-dsa-cache-layer-split": None},
        "cannot be combined with --enable-dsa-cache-layer-split",
    ),
    ("V3.2 with MTP", "v32_mtp", {"--speculative-algorithm": "EAGLE"}, "for GLM-5 (GlmMoeDsaForCausalLM) only"),
    ("NEXTN", "glm5_mtp", {"--speculative-algorithm": "NEXTN", **ONE_CHAIN}, "needs --speculative-algorithm EAGLE"),
    ("no chunked prefill", "v32", {"--chunked-prefill-size": "-1"}, "needs chunked prefill"),
    ("colocated", "v32", {"--disaggregation-mode": DROP}, "runs only on a PD prefill instance"),
    ("nixl", "v32", {"--disaggregation-transfer-backend": "nixl"}, "ships owned pages over Mooncake only"),
    (
        "fp8 KV, SGLang's default backend",
        "v32",
        {"--kv-cache-dtype": "fp8_e4m3"},
        "supports --dsa-prefill-backend flashmla_sparse/flashmla_sparse_q8 only",
    ),
    (
        "q8 with mixed chunks",
        "glm5",
        {"--dsa-prefill-backend": "flashmla_sparse_q8", "--enable-mixed-chunk": None},
        "cannot run --dsa-prefill-backend flashmla_sparse_q8 with --enable-mixed-chunk",
    ),
    (
        "tilelang",
        "v32",
        {"--dsa-prefill-backend": "tilelang"},
        "supports --dsa-prefill-backend flashmla_sparse/flashmla_sparse_q8 only",
    ),
    (
        "HiCache storage tier",
        "v32",
        {"--enable-hierarchical-cache": None, "--hicache-storage-backend": "file"},
        "does not support --hicache-storage-backend",
    ),
    (
        "HiCache buffer-only host",
        "v32",
        {  # SGLang itself requires a storage tier for buffer_only
            "--enable-hierarchical-cache": None,
            "--hicache-host-memory-mode": "buffer_only",
            "--hicache-storage-backend": "file",
        },
        "needs --hicache-host-memory-mode cache",
    ),
    (
        "HiCache direct I/O",
        "v32",
        {"--enable-hierarchical-cache": None, "--hicache-io-backend": "direct", "--hicache-mem-layout": "layer_first"},
        "needs --hicache-io-backend kernel",
    ),
    (
        "HiCache with MTP",
        "v32_mtp",
        {"--enable-hierarchical-cache": None, "--speculative-algorithm": "NEXTN"},
        "does not support speculative decoding yet",
    ),
    (
        "speculative without MTP layer",
        "glm5",
        {"--speculative-algorithm": "EAGLE"},
        "needs a checkpoint with one MTP layer",
    ),
    (
        "EAGLE3",
        "glm5_mtp",
        {"--speculative-algorithm": "EAGLE3"},
        "supports speculative decoding with --speculative-algorithm EAGLE (the model's own MTP layer) only",
    ),
    (
        "multi-layer EAGLE",
        "glm5_mtp",
        {"--speculative-algorithm": "NEXTN", "--enable-multi-layer-eagle": None},
        "does not support --enable-multi-layer-eagle",
    ),
    ("PP", "v32", {"--pp-size": "2"}, "does not support pipeline parallelism"),
    ("TBO", "v32", {"--enable-two-batch-overlap": None}, "does not support --enable-two-batch-overlap"),
    (
        "KV checksum",
        "v32",
        {"--disaggregation-enable-kv-checksum": None},
        "does not support --disaggregation-enable-kv-checksum",
    ),
    ("LayerNorm SP", "v32", {"--enable-layernorm-sp": None}, "does not support --enable-layernorm-sp"),
    ("dummy model", "dummy", {}, "needs a real DSA checkpoint"),
]


@pytest.mark.parametrize("name,model,changes,message", BAD, ids=[b[0] for b in BAD])
def test_bad_combination_is_refused_with_its_fix(plugin, models, sm90, name, model, changes, message):
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError

    argv = _argv(models.get(model, model), changes)
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(argv)
    assert message in str(err.value), f"{name}: {argv}\n{err.value}"
    problems = [line for line in str(err.value).splitlines() if line.startswith("  - ")] or [str(err.value)]
    assert all("; " in p for p in problems), f"{name}: a problem without its fix:\n{err.value}"


def test_unconfined_mooncake_ports_refuse_the_flag_naming_the_setting(plugin, models, sm90, monkeypatch):
    """Mooncake listens on every interface and no setting binds it (test/disagg/test_listeners.py):
    the flag starts only once the operator says the ports are confined."""
    from sglang_nsa_cp.sglang_ext.arg_groups.parallel_hook import SharedKVConfigError
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    monkeypatch.delenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED")
    with pytest.raises(SharedKVConfigError) as err:
        _resolve(_argv(models["v32"]))
    message = str(err.value)
    assert "1 problem(s)" in message and "on every interface" in message, message
    assert "then set SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED=1" in message and "MC_MIN_RPC_PORT" in message, message
    monkeypatch.setenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED", "1")
    assert getattr(_resolve(_argv(models["v32"])), ATTR) is True


def test_the_flag_sizes_mooncakes_tcp_queue_and_sglangs_batches_unless_the_operator_did(
    plugin, models, sm90, monkeypatch
):
    """Mooncake's TCP transport fails batches past ~2048 entries per peer at its default queue and
    takes at most 65535 (docs/sglang_cpu_server.md, test_pd_many_pages.py): the flag's
    resolution sets the queue's maximum and SGLang's batch bound to fit it (an entry a page and layer,
    the tiny model's 2 layers plus one for MTP), which the schedulers inherit; an operator's own
    values stay."""
    for name in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"):
        monkeypatch.delenv(name, raising=False)
    _resolve(_argv(models["v32"]))
    assert os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "65535"
    assert os.environ["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] == str(65535 // 3)
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "4096")
    monkeypatch.setenv("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "100")
    _resolve(_argv(models["v32"]))
    assert os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "4096"
    assert os.environ["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] == "100"


def test_page_size_other_than_64_is_refused(plugin, monkeypatch):
    """SGLang forces page 64 for DSA models before our check runs, so the check is exercised on a
    resolved view directly."""
    from types import SimpleNamespace
    from unittest import mock

    from sglang_nsa_cp.sglang_ext.arg_groups import parallel_hook

    view = SimpleNamespace(
        model_path="m", enable_prefill_cp=True, attn_cp_size=8, cp_strategy="interleave", page_size=128,
        enable_dsa_cache_layer_split=False, enable_kv_cache_sharding=False, disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake", device="cuda", attention_backend="dsa",
        prefill_attention_backend=None, dsa_prefill_backend="flashmla_sparse", kv_cache_dtype="bfloat16",
        enable_hierarchical_cache=False, enable_hisparse=False, enable_lmcache=False, speculative_algorithm=None,
        pp_size=1, dcp_size=1, attn_dp_size=1, enable_two_batch_overlap=False, enable_layernorm_sp=False,
        disaggregation_enable_kv_checksum=False, radix_cache_backend=None, disable_radix_cache=False,
        chunked_prefill_size=8192, enable_unified_memory=False, enable_flexkv=False, enable_streaming_session=False,
        enable_session_radix_cache=False, cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="disabled")),
    )  # fmt: skip
    monkeypatch.setenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED", "1")
    monkeypatch.setenv("SGLANG_NSA_CP_PD_NETWORK_TRUSTED", "1")
    with (
        mock.patch.object(parallel_hook, "resolving_view", lambda sa: view),
        mock.patch.object(parallel_hook, "_model_problems", lambda sa: []),
    ):
        assert parallel_hook.find_problems(object()) == [
            "needs the DSA page size 64, got --page-size 128; use --page-size 64"
        ]
        view.page_size = 64
        assert parallel_hook.find_problems(object()) == []


def test_launch_server_exits_with_the_error_before_loading_anything(models):
    """`python -m sglang.launch_server` itself (SM90 capability patched in): exit code 1, our
    message, and no sign of a scheduler, distributed init or weight loading."""
    code = (
        "import sys, runpy, torch\n"
        "torch.cuda.get_device_capability = lambda *a, **k: (9, 0)\n"
        "sys.argv = ['sglang.launch_server'] + sys.argv[1:]\n"
        "runpy.run_module('sglang.launch_server', run_name='__main__')\n"
    )
    argv = _argv(models["v32"], {"--disaggregation-mode": DROP})  # colocated
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert "SharedKVConfigError" in log and "runs only on a PD prefill instance" in log, log[-3000:]
    for sign in ("Init torch distributed", "Load weight", "scheduler", "Memory pool"):
        assert sign not in log, f"{sign!r} in the log: something started before validation\n{log[-3000:]}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
