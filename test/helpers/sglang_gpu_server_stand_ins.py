"""GPU stand-ins for SGLang 0.5.23's real servers on the GPU machine (torch 2.11, the bundle of
docs/gpu_bundle.md), and the launcher that puts them in every server process.

A server runs as `python -m helpers.sglang_gpu_server_stand_ins <launch_server arguments>`.
Importing this module installs the import-time stand-ins (sgl_kernel's op library and deep_gemm,
which cannot load on torch 2.11: `gpu_stand_ins`) before SGLang is imported; as `__main__` it then
runs `sglang.launch_server`. SGLang spawns its schedulers and detokenizer, and a spawned process
imports its parent's main module before it unpickles its target, so the same install runs first
in each of them. `register()` is the entry point of the test-only plugin `gpu_stand_ins` (a
dist-info on the servers' PYTHONPATH, as on CPU: `sglang_servers.write_plugin_site`); it adds what
needs SGLang imported: the forward harness's kernel switches (docs/sglang_gpu_forward.md)
and, after SGLang loads the model, its native-module pins. Each stand-in the first time it is
used is logged with its caller ("gpu stand-in lookup|call: NAME at FILE:LINE"), so a server's log
names every one it needed.

The launcher also puts every rank of a server on GPU 0 (the machine has one), each rank its own
NCCL host (`helpers.distributed.SHARED_GPU_NCCL_ENV` in the server's environment, NCCL_HOSTID set
per rank by `helpers.distributed.on_gpu_zero`): NCCL then runs over sockets on loopback, exact and slow. Test-only: the product
never sets NCCL_HOSTID.
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
import sys
import types

from helpers import gpu_stand_ins
from helpers import sglang_gpu_harness as G
from helpers.distributed import on_gpu_zero

STAND_IN_LOG = "gpu stand-in"


def _log_first_use(use) -> None:
    name, caller, kind = use
    print(f"{STAND_IN_LOG} {kind}: {name} at {caller} (pid {os.getpid()})", file=sys.stderr, flush=True)


def install() -> None:
    """The import-time part, in every server process before SGLang is imported."""
    G.install()  # the forward harness's environment switches and gpu_stand_ins.install()
    gpu_stand_ins._USES.on_first_use = _log_first_use
    # The HTTP server imports soundfile for audio transcription only (not in the bundle).
    soundfile = types.ModuleType("soundfile")
    soundfile.__spec__ = importlib.machinery.ModuleSpec("soundfile", None)
    sys.modules.setdefault("soundfile", soundfile)


def _pin_loaded_model(result, runner, *args, **kwargs):
    """AFTER `ModelRunner.load_model`: the native-module pins on the model SGLang just built."""
    G.pin_native_modules(runner.model)


def _nextn_mlp_dense() -> None:
    """The speculative checkpoint's NextN layer is a copy of the target's dense layer 0
    (helpers/sglang_spec_model.py); SGLang's `DeepseekV2DecoderLayer._is_layer_sparse` says MoE for
    every NextN layer, so its MLP is built dense here, as on CPU (sglang_spec_stand_ins.install)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer

    original = DeepseekV2DecoderLayer._is_layer_sparse

    def _is_layer_sparse(config, layer_id, is_nextn):
        if is_nextn:
            _log_first_use(("DeepseekV2DecoderLayer._is_layer_sparse(is_nextn=True)->False", __name__, "call"))
            return False
        return original(config, layer_id, is_nextn=is_nextn)

    DeepseekV2DecoderLayer._is_layer_sparse = staticmethod(_is_layer_sparse)


def register():
    """Entry point of the test-only `gpu_stand_ins` plugin; runs in every SGLang process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    G._replace_kernels()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model", _pin_loaded_model, HookType.AFTER
    )
    if os.environ.get("NSA_CP_TEST_SPECULATIVE"):  # sglang_server_check.py --model mtp-toy
        _nextn_mlp_dense()
    if os.environ.get("NSA_CP_TEST_COUNT_COLLECTIVES"):  # sglang_server_check.py --layer-split counts them
        from helpers import collective_counter

        collective_counter.install_in_server(os.environ[collective_counter.ENV])


install()

if __name__ == "__main__":
    import sglang.srt.entrypoints.engine as engine

    engine.maybe_reindex_device_id = on_gpu_zero  # SGLang passes each rank's GPU id: here, its rank
    sys.argv[0] = "sglang.launch_server"
    # alter_sys=False keeps this module as __main__, so the spawned processes import it first
    runpy.run_module("sglang.launch_server", run_name="__main__")
