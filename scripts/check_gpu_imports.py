"""Import SGLang 0.5.23's DSA modules from the unpacked GPU bundle, with the stand-ins installed.

The first thing a GPU run does after `source scripts/gpu_unpack.sh`, and what the CPU check
(scripts/gpu_bundle_cpu_check.sh) runs against a venv that holds only the GPU machine's packages.
Prints one line per module (OK with its time, or FAIL with the error and the SGLang line that
raised it), where sglang, transformers and flash_mla were loaded from, and the stand-ins used;
exits 1 if any import failed.

    python3 scripts/check_gpu_imports.py            # FlashMLA is imported only where CUDA is
    python3 scripts/check_gpu_imports.py --pretend-cuda   # CPU only: see below

--pretend-cuda (CPU machines only) makes torch report one SM90 device before SGLang is imported,
so SGLang's import-time platform checks take their CUDA branches (`if _is_cuda: from sgl_kernel
import ...`, `import deep_gemm`, JIT module imports) as they will on the GPU machine. It proves
only that those imports resolve; no CUDA code runs. --no-deep-gemm leaves deep_gemm absent.
"""

import argparse
import importlib
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test"))

# What the GPU harness needs: SGLang's DSA model forward, its CP strategy, KV pools (the
# page-interleaved pool the flag runs, its placement, the owner-rotating allocator, the kv-shard
# hooks and the PyNccl communicator it gathers history with), model loader, ServerArgs resolution
# and distributed init, and the plugin's hooks on them.
MODULES = [
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.cp.base",
    "sglang.srt.layers.cp.interleave",
    "sglang.srt.layers.cp.utils",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.page_interleave_pool",
    "sglang.srt.mem_cache.page_interleave",
    "sglang.srt.mem_cache.allocator.page_interleave",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.layers.attention.kv_shard_hooks",
    "sglang.srt.arg_groups.kv_shard_hook",
    "sglang.srt.distributed.device_communicators.pynccl",
    "sglang.srt.distributed.device_communicators.pynccl_allocator",
    "sglang.srt.layers.attention.dsa.dsa_indexer",
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.glm4_moe",
    "sglang.srt.configs.model_config",
    "sglang.srt.model_loader.loader",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.forward_context",
    "sglang.srt.model_executor.runner.eager_runner",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.plugins",
    "sglang_nsa_cp.sglang_ext",
    "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool",
    "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave",
    "sglang_nsa_cp.sglang_ext.arg_groups.kv_shard_hook",
    "helpers.sglang_gpu_harness",
]


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "sglang" in f.filename]
    f = (ours or frames)[-1]
    return f"{f.filename}:{f.lineno}"


def pretend_cuda() -> None:
    """torch answers as one H200 would, for import-time checks only (CPU machines)."""
    import types

    import torch

    if torch.cuda.is_available():
        raise SystemExit("--pretend-cuda is for CPU machines; this one has CUDA: drop the flag")
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, name="NVIDIA H200 (pretended)",
                                  total_memory=143 << 30, L2_cache_size=60 << 20, gcnArchName="")  # fmt: skip
    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_properties = lambda *a, **k: props


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretend-cuda", action="store_true", help="CPU only: SGLang imports its CUDA branches")
    parser.add_argument("--no-deep-gemm", action="store_true", help="do not install the deep_gemm stand-in")
    args = parser.parse_args()
    if args.pretend_cuda:
        pretend_cuda()
    from helpers import gpu_stand_ins

    gpu_stand_ins.install(deep_gemm=not args.no_deep_gemm)
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda available {torch.cuda.is_available()}")
    failed = []
    for name in MODULES:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
            print(f"[OK]   {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as exc:
            failed.append(name)
            print(f"[FAIL] {name}: {type(exc).__name__}: {str(exc)[:300]} @ {_where(exc)}", flush=True)
    import sglang
    import transformers

    print(f"sglang from {os.path.dirname(sglang.__file__)}")
    print(f"transformers {transformers.__version__} from {os.path.dirname(transformers.__file__)}")
    if torch.cuda.is_available() and not args.pretend_cuda:
        try:
            import flash_mla

            print(f"[OK]   flash_mla from {os.path.dirname(flash_mla.__file__)}")
        except Exception as exc:
            failed.append("flash_mla")
            print(f"[FAIL] flash_mla: {type(exc).__name__}: {exc}")
    else:
        print("[SKIP] flash_mla: no real CUDA device here (its library needs one)")
    print(gpu_stand_ins.report())
    print(
        f"imports: {len(MODULES) - len(failed)} ok, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
