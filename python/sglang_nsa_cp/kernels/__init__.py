"""Kernels of the shared-KV path, and the one place that picks their implementation.

Each op lives in one module with its Triton kernel and launcher (`<op>_triton`), its torch
reference (`<op>_torch`, the semantics) and the named input checks both run:
`copy_rows.py` (gather_rows, scatter_rows, store_owned_rows), `mla_fp8_store.py`
(store_owned_mla_fp8, plus a CUDA kernel, `<op>_cuda`, built on first use),
`mla_fp8_owned_and_scratch.py` (store_mla_fp8_owned_and_scratch, SGLang's fp8 rounding) and
`index_k_store.py` (store_owned_index_k). Row formats and their constants: `formats.py`.

Dispatch rule, from the tensors' device and `SGLANG_NSA_CP_KERNELS` (read on first use):
- `auto` (default): for CUDA tensors the CUDA kernel where an op has one and it builds (else,
  with one warning, Triton), Triton for the other ops; the reference for CPU tensors, even under
  TRITON_INTERPRET=1 (the interpreter is far too slow for real work; tests call the `_triton`
  launchers directly). It falls back to the reference only for named reasons, warning once per
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
from sglang_nsa_cp.kernels import copy_rows, index_k_store, mla_fp8_owned_and_scratch, mla_fp8_store
from sglang_nsa_cp.kernels.checks import KernelUnsupported
from sglang_nsa_cp.kernels.formats import dequantize_mla_fp8, owned_physical_rows, quantize_mla_fp8, read_index_k
from sglang_nsa_cp.kernels.triton_common import TRITON_IMPORT_ERROR, NoTriton, TritonError

__all__ = [
    "gather_rows",
    "scatter_rows",
    "store_owned_rows",
    "store_owned_mla_fp8",
    "store_mla_fp8_owned_and_scratch",
    "store_owned_index_k",
    "owned_physical_rows",
    "quantize_mla_fp8",
    "dequantize_mla_fp8",
    "read_index_k",
    "kernel_mode",
    "implementation",
]

KERNELS_ENV = envs.SGLANG_NSA_CP_KERNELS.name
KERNEL_MODES = envs.SGLANG_NSA_CP_KERNELS.choices

# op -> the module holding its `<op>_torch`, `<op>_triton` (and `<op>_cuda`, `build_cuda`)
OP_MODULES: dict[str, ModuleType] = {
    "gather_rows": copy_rows,
    "scatter_rows": copy_rows,
    "store_owned_rows": copy_rows,
    "store_owned_mla_fp8": mla_fp8_store,
    "store_mla_fp8_owned_and_scratch": mla_fp8_owned_and_scratch,
    "store_owned_index_k": index_k_store,
}
_CUDA_OPS = ("store_owned_mla_fp8",)  # ops with a CUDA kernel
_failed: set[str] = set()  # ops whose Triton kernel does not compile here (auto mode)
_cuda_unbuildable: dict[str, str] = {}  # op -> why its CUDA kernel could not be built
_warned_unsupported: set[str] = set()


@functools.cache
def kernel_mode() -> str:
    """SGLANG_NSA_CP_KERNELS, read on first use (`kernel_mode.cache_clear()` re-reads it)."""
    return envs.SGLANG_NSA_CP_KERNELS.get()


def _cuda_kernel_builds(op: str, device: torch.device) -> bool:
    """Whether `op` has a CUDA kernel that builds for `device`; warns once when it does not."""
    if op not in _CUDA_OPS or op in _cuda_unbuildable:
        return False
    try:
        OP_MODULES[op].build_cuda(device)
    except mla_fp8_store.CUDA_BUILD_ERRORS as exc:
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
        if impl != "triton":
            raise
        _failed.add(op)
        _fallback_warning(op, f"the Triton kernel failed ({type(exc).__name__}: {exc})", "from now on")
    return getattr(module, f"{op}_torch")(*args)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]] for every i with index[i] >= 0; other rows of `out` untouched.

    src [S, W], out [N, W] of one dtype (rows are copied as bytes); index [N] int32/int64.
    Materialize, packing owned pages for the all-gather, and rerange are all this.
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
    FlashMLA fp8 rows (`quantize_mla_fp8`, bitwise in every implementation); slots [T]."""
    return _run("store_owned_mla_fp8", shard.device, shard, slots, kv, rank, cp_size, page_size)


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


def store_owned_index_k(
    pages: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    scale: torch.Tensor,
    rank: int,
    cp_size: int,
    page_size: int,
) -> torch.Tensor:
    """Write owned fp8 index keys (uint8 [T, 128]) and scales ([T], stored as fp32) into
    SGLang's index-K pages (uint8 [local_pages, page_size * 132]: page_size keys, then
    page_size scales); slots [T]."""
    return _run("store_owned_index_k", pages.device, pages, slots, key, scale, rank, cp_size, page_size)
