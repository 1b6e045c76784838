"""Fixtures of the start-up tests: the plugin loaded as SGLang loads it, and the GPU node that
SGLang's argument resolution inspects, stood in on CPU."""

import os

import pytest
import torch

# What a resolution with the flag writes into the launcher's environment for its schedulers.
RESOLUTION_SETS = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES")
PD_SECRET = "start-up-tests-pd-secret-0123456789"


@pytest.fixture(scope="module")
def plugin():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # entry-point discovery, register(), HookRegistry.apply_hooks()
    import sglang_nsa_cp.sglang_ext as ext

    return ext


@pytest.fixture
def sm90(monkeypatch):
    """SM90's capability; a CUDA platform's Mamba/KDA state snapshots (GLM-5-Next's radix cache asks
    before CP is checked); no SGLANG_NSA_CP_SHARED_KV from the environment; a node whose Mooncake
    ports are confined (SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED=1, as docs/deploy.md sets it) and
    whose PD messages are keyed (SGLANG_NSA_CP_PD_SECRET, which the flag needs); the
    process-wide CP strategy and the environment that resolution sets restored afterwards."""
    from sglang.srt.arg_groups import mamba_hook
    from sglang.srt.layers.cp import base as cp_base

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(mamba_hook, "_platform_supports_mamba_cache_extra_buffer", lambda: True)
    monkeypatch.delenv("SGLANG_NSA_CP_SHARED_KV", raising=False)
    monkeypatch.setenv("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED", "1")
    monkeypatch.setenv("SGLANG_NSA_CP_PD_SECRET", PD_SECRET)
    monkeypatch.delenv("SGLANG_NSA_CP_PD_NETWORK_TRUSTED", raising=False)
    saved, saved_env = cp_base._STRATEGY, {name: os.environ.get(name) for name in RESOLUTION_SETS}
    yield
    cp_base._STRATEGY = saved
    for name, value in saved_env.items():  # what the test's resolutions set stays in the test
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
