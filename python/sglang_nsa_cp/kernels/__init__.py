"""Kernels of the shared-KV path, and the one place that picks their implementation.

Each public function below has the signature and semantics of its plain-torch reference in
`reference.py`; `triton_kernels.py` holds the Triton version of each, `cuda_fp8_store.py` a CUDA
version of the fp8 store (faster on GPUs, built on first use).

Dispatch rule, per call, from the tensors' device and `SGLANG_NSA_CP_KERNELS`:
- `auto` (default): for CUDA tensors the CUDA kernel where an op has one and it builds (else,
  with one warning, Triton), Triton for the other ops when triton imports; the reference
  otherwise. CPU
  tensors use the reference even under TRITON_INTERPRET=1 (the interpreter is far too slow for
  real work; tests call `triton_kernels` directly). If a Triton launch fails (compilation,
  resources, driver), the op warns once and uses the reference from then on.
- `triton`: always Triton; failures raise.
- `torch`: always the reference.
Input errors (shapes, dtypes, devices) raise ValueError/TypeError in every mode.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import torch

from sglang_nsa_cp.kernels import reference
from sglang_nsa_cp.kernels.reference import (
    dequantize_mla_fp8,
    owned_physical_rows,
    quantize_mla_fp8,
    read_index_k,
)

__all__ = [
    "gather_rows",
    "scatter_rows",
    "store_owned_rows",
    "store_owned_mla_fp8",
    "store_owned_index_k",
    "owned_physical_rows",
    "quantize_mla_fp8",
    "dequantize_mla_fp8",
    "read_index_k",
    "kernel_mode",
    "implementation",
]

# TODO(lead): declare in sglang_nsa_cp/envs.py once that registry exists (STYLE.md 13).
KERNELS_ENV = "SGLANG_NSA_CP_KERNELS"
KERNEL_MODES = ("auto", "triton", "torch")

_failed: set[str] = set()  # ops whose Triton launch failed in auto mode
_CUDA_OPS = ("store_owned_mla_fp8",)  # ops with a CUDA kernel (cuda_fp8_store.py)
_cuda_unbuildable: dict[str, str] = {}  # op -> why its CUDA kernel could not be built


@functools.cache
def kernel_mode() -> str:
    """The value of SGLANG_NSA_CP_KERNELS (cached; `kernel_mode.cache_clear()` re-reads it)."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r}; expected one of {KERNEL_MODES}")
    return mode


@functools.cache
def _triton_kernels() -> ModuleType | ImportError:
    try:
        from sglang_nsa_cp.kernels import triton_kernels
    except ImportError as exc:
        return exc
    return triton_kernels


def _cuda_kernel_builds(op: str, device: torch.device) -> bool:
    """Whether `op` has a CUDA kernel that builds for `device`; warns once when it does not."""
    if op not in _CUDA_OPS or op in _cuda_unbuildable:
        return False
    from sglang_nsa_cp.kernels import cuda_fp8_store

    try:
        cuda_fp8_store.build(device)
    except Exception as exc:  # noqa: BLE001 - any build failure (no nvcc or ninja, compiler error) falls back
        _cuda_unbuildable[op] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"sglang_nsa_cp.kernels.{op}: its CUDA kernel could not be built ({_cuda_unbuildable[op]}); "
            "using the Triton kernel (slower, same bytes). Install nvcc and ninja to build it.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def implementation(op: str, device: torch.device) -> str:
    """'cuda', 'triton' or 'torch': what a call of `op` on tensors of `device` runs now."""
    mode = kernel_mode()
    if mode == "torch" or (mode == "auto" and (device.type != "cuda" or op in _failed)):
        return "torch"
    if mode == "auto" and _cuda_kernel_builds(op, device):
        return "cuda"
    module = _triton_kernels()
    if isinstance(module, ImportError):
        if mode == "triton":
            raise RuntimeError(
                f"{KERNELS_ENV}=triton but triton does not import ({module}); install triton or use auto"
            )
        return "torch"
    return "triton"


def _run(op: str, device: torch.device, *args):
    impl = implementation(op, device)
    if impl == "torch":
        return getattr(reference, op)(*args)
    if impl == "cuda":
        from sglang_nsa_cp.kernels import cuda_fp8_store

        return getattr(cuda_fp8_store, op)(*args)
    triton_impl = getattr(_triton_kernels(), op)
    if kernel_mode() == "triton":
        return triton_impl(*args)
    from triton.errors import TritonError

    try:
        return triton_impl(*args)
    # Triton reports a missing C compiler or a driver failure as RuntimeError; bad input
    # (ValueError, TypeError) and out-of-memory are the caller's to see.
    except (TritonError, RuntimeError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        _failed.add(op)
        warnings.warn(
            f"sglang_nsa_cp.kernels.{op}: the Triton kernel failed ({type(exc).__name__}: {exc}); "
            f"using the torch reference from now on. Set {KERNELS_ENV}=torch to choose it "
            f"explicitly, or {KERNELS_ENV}=triton to make this an error.",
            RuntimeWarning,
            stacklevel=3,
        )
    return getattr(reference, op)(*args)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]] for every i with index[i] >= 0; other rows of `out` untouched.

    src [S, W], out [N, W] of one dtype; index [N] int32/int64. Materialize, packing owned
    pages for the all-gather, and rerange are all this.
    """
    return _run("gather_rows", out.device, src, index, out)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = src[i] for every i with index[i] >= 0 (distinct indices).

    dst [D, W], src [N, W] of one dtype; index [N] int32/int64.
    """
    return _run("scatter_rows", dst.device, dst, index, src)


def store_owned_rows(
    shard: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused store: rows[i] to the shard row of logical slot slots[i] where `rank` owns it.

    shard [R, W], rows [T, W] of one dtype; slots [T] int32/int64 (-1: none). Owner of a slot:
    (slot // page_size) % cp_size; shard row: see `owned_physical_rows`.
    """
    return _run("store_owned_rows", shard.device, shard, slots, rows, rank, cp_size, page_size)


def store_owned_mla_fp8(
    shard: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Fused quantize + store of owned bf16 latent rows kv [T, 576] into uint8 [R, 656]
    FlashMLA fp8 rows (see `quantize_mla_fp8`)."""
    return _run("store_owned_mla_fp8", shard.device, shard, slots, kv, rank, cp_size, page_size)


def store_owned_index_k(
    pages: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    cp_size: int,
    page_size: int,
) -> torch.Tensor:
    """Write owned fp8 index keys (uint8 [T, 128]) and fp32 scales ([T]) into SGLang's index-K
    pages (uint8 [local_pages, page_size * 132]: page_size keys, then page_size scales)."""
    return _run("store_owned_index_k", pages.device, pages, slots, key, scale, rank, cp_size, page_size)
