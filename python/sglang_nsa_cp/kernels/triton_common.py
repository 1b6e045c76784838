"""Triton, when it imports, and what the op modules' kernels share.

Without Triton the op modules still import (their torch references work); `triton` and `tl`
are then None, `jit` leaves functions undecorated, and a launcher raises `NoTriton`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from triton.errors import TritonError

    jit = triton.jit
    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as exc:
    triton = tl = None
    TRITON_IMPORT_ERROR = exc

    class TritonError(Exception):  # never raised: nothing launches without Triton
        pass

    def jit(fn):
        return fn


class NoTriton(RuntimeError):
    """Triton does not import here: a named reason to use the torch reference."""


def require_triton() -> None:
    if TRITON_IMPORT_ERROR is not None:
        raise NoTriton(
            f"triton does not import ({TRITON_IMPORT_ERROR}); install triton or use SGLANG_NSA_CP_KERNELS=torch"
        )


_INT32_LIMIT = 2**31


def wide(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into one of these 2-D tensors can reach 2**31 (int64 offsets)."""
    return any(t.shape[0] * max(t.stride(0), t.shape[1]) >= _INT32_LIMIT for t in tensors)


@jit
def owned_rows(slot, rank, CP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Shard row of each logical slot and whether `rank` owns it (formats.owned_physical_rows)."""
    page = slot // PAGE_SIZE
    owned = (slot >= 0) & (page % CP_SIZE == rank)
    return (page // CP_SIZE) * PAGE_SIZE + slot % PAGE_SIZE, owned
