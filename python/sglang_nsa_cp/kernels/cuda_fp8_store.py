"""The fused fp8 quantize + store as a CUDA kernel (`cuda/store_owned_mla_fp8.cu`), for GPUs
where the Triton version is short of memory bandwidth (docs/kernels.md).

Built on first use with torch's cpp_extension for the device's architecture (needs `nvcc` and
`ninja`, which SGLang's own JIT kernels need too; about a minute), cached under torch's extension
directory (TORCH_EXTENSIONS_DIR) so later processes load it in about a second; concurrent
builds wait on one another through the cache's lock. `kernels.store_owned_mla_fp8` uses it for
CUDA tensors and falls back to Triton, with one warning, when it cannot be built.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from sglang_nsa_cp.kernels.checks import check_mla_fp8_store

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "store_owned_mla_fp8.cu")


@functools.cache
def _module(major: int, minor: int) -> ModuleType:
    from torch.utils.cpp_extension import load

    arch = f"{major}{minor}"
    return load(
        name=f"sglang_nsa_cp_store_owned_mla_fp8_sm{arch}",
        sources=[SOURCE],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        verbose=False,
    )


def build(device: torch.device) -> ModuleType:
    """The compiled kernel for `device` (built or loaded from the cache on first call).
    Raises what the build raises (no nvcc, no ninja, a compiler error)."""
    return _module(*torch.cuda.get_device_capability(device))


def store_owned_mla_fp8(
    shard: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> torch.Tensor:
    """Same signature and bytes as `reference.store_owned_mla_fp8`, on CUDA tensors."""
    check_mla_fp8_store(shard, slots, kv, rank, cp_size, page_size)
    if kv.device.type != "cuda":
        raise ValueError(f"the CUDA fp8 store needs CUDA tensors, got {kv.device}")
    build(kv.device).store_owned_mla_fp8(shard, slots, kv, rank, cp_size, page_size)
    return shard
