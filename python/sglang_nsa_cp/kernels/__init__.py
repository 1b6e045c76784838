"""The plugin's kernel, and the one place that picks its implementation.

The op lives in one module with its Triton kernel and launcher (`<op>_triton`), its torch
reference (`<op>_torch`, the semantics) and the named input checks both run:
`mla_fp8_owned_and_scratch.py` (store_mla_fp8_owned_and_scratch, SGLang's fp8 rounding), called
by the plugin's page-interleaved DSA pool. Row format and ownership: `formats.py`.

Dispatch rule, from the tensors' device and `SGLANG_NSA_CP_KERNELS` (read on first use):
- `auto` (default): Triton for CUDA tensors; the reference for CPU tensors, even under
  TRITON_INTERPRET=1 (the interpreter is far too slow for real work; tests call the `_triton`
  launcher directly). It falls back to the reference only for named reasons, warning once per
  op: Triton does not import; the input's layout is one the kernel cannot take (strided or
  misaligned rows: `KernelUnsupported`, that call only); the Triton kernel does not compile for
  this device (`TritonError`, from then on). Every other error, a CUDA illegal address
  included, is raised.
- `triton`: always Triton; failures raise.
- `torch`: always the reference.
Input errors (shapes, dtypes, devices) raise ValueError/TypeError in every mode.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

from sglang_nsa_cp.envs import envs
from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch
from sglang_nsa_cp.kernels.checks import KernelUnsupported
from sglang_nsa_cp.kernels.formats import owned_physical_rows
from sglang_nsa_cp.kernels.triton_common import TRITON_IMPORT_ERROR, NoTriton, TritonError

__all__ = ["store_mla_fp8_owned_and_scratch", "owned_physical_rows", "kernel_mode", "implementation"]

KERNELS_ENV = envs.SGLANG_NSA_CP_KERNELS.name

# op -> the module holding its `<op>_torch` and `<op>_triton`
OP_MODULES: dict[str, ModuleType] = {"store_mla_fp8_owned_and_scratch": mla_fp8_owned_and_scratch}
_failed: set[str] = set()  # ops whose Triton kernel does not compile here (auto mode)
_warned_unsupported: set[str] = set()


@functools.cache
def kernel_mode() -> str:
    """SGLANG_NSA_CP_KERNELS, read on first use (`kernel_mode.cache_clear()` re-reads it)."""
    return envs.SGLANG_NSA_CP_KERNELS.get()


def implementation(op: str, device: torch.device) -> str:
    """'triton' or 'torch': what a call of `op` on tensors of `device` runs now."""
    mode = kernel_mode()
    if mode == "torch" or (mode == "auto" and (device.type != "cuda" or op in _failed)):
        return "torch"
    if TRITON_IMPORT_ERROR is not None:
        if mode == "triton":
            raise NoTriton(
                f"{KERNELS_ENV}=triton but triton does not import ({TRITON_IMPORT_ERROR}); install triton or use auto"
            )
        return "torch"
    return "triton"


def _fallback_warning(op: str, why: str, when: str) -> None:
    warnings.warn(
        f"sglang_nsa_cp.kernels.{op}: {why}; using the torch reference {when}. Set {KERNELS_ENV}=torch "
        f"to choose it explicitly, or {KERNELS_ENV}=triton to make this an error.",
        RuntimeWarning,
        stacklevel=4,
    )


def _run(op: str, device: torch.device, *args):
    impl = implementation(op, device)
    module = OP_MODULES[op]
    kernel = getattr(module, f"{op}_{impl}")
    if impl == "torch" or kernel_mode() == "triton":
        return kernel(*args)
    try:
        return kernel(*args)
    except KernelUnsupported as exc:
        if op not in _warned_unsupported:
            _warned_unsupported.add(op)
            _fallback_warning(op, f"the {impl} kernel cannot take this input ({exc})", "for such inputs")
    except TritonError as exc:
        _failed.add(op)
        _fallback_warning(op, f"the Triton kernel failed ({type(exc).__name__}: {exc})", "from now on")
    return getattr(module, f"{op}_torch")(*args)


def store_mla_fp8_owned_and_scratch(
    scratch: torch.Tensor,
    scratch_rows: torch.Tensor,
    shard: torch.Tensor,
    slots: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    rank: int,
    cp_size: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's fp8 quantization of a chunk, once, stored to the scratch and to the owned shard rows.

    row_i = quantize_k_cache_separate(k_nope, k_rope)[i] as one FlashMLA fp8 row (bitwise: scale =
    amax / 448, codes = e4m3(clamp(x * (1 / scale)))); scratch[scratch_rows[i]] = row_i where
    scratch_rows[i] >= 0; shard[owned_physical_rows(slots[i])] = row_i where `rank` owns slots[i]
    (other shard rows untouched, no host sync).

    scratch [S, 656], shard [R, 656] uint8; scratch_rows, slots [T] int32/int64 (-1: skip);
    k_nope bf16 [T, 512] or [T, 1, 512]; k_rope bf16 [T, 64] or [T, 1, 64]. Returns (scratch, shard).
    The torch reference runs SGLang's Triton quantizer: CUDA tensors, or TRITON_INTERPRET=1.
    """
    return _run(
        "store_mla_fp8_owned_and_scratch",
        shard.device,
        scratch,
        scratch_rows,
        shard,
        slots,
        k_nope,
        k_rope,
        rank,
        cp_size,
        page_size,
    )
