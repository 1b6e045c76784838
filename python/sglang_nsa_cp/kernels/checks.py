"""Named input checks shared by the ops' kernels and references: each names the argument, what it
must be and what it is. Bad input raises ValueError/TypeError in every implementation; a layout
only the kernels cannot take (strided rows, misaligned starts) raises `KernelUnsupported`."""

from __future__ import annotations

import torch


class KernelUnsupported(ValueError):
    """Valid input the kernel cannot take (a named reason for the dispatcher to use the reference)."""


def check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows x row elements), got shape {tuple(t.shape)}")


def check_contiguous_rows(name: str, t: torch.Tensor) -> None:
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise KernelUnsupported(f"{name} needs contiguous rows (stride(1) == 1), got strides {t.stride()}")


def check_index(name: str, index: torch.Tensor, rows: int, device: torch.device) -> None:
    if index.dim() != 1 or index.numel() != rows:
        raise ValueError(f"{name} must be 1-D with {rows} entries, got shape {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device} but the rows are on {device}")


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} is {a.dtype} but {name_b} is {b.dtype}; rows are copied as they are")
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{name_a} rows have {a.shape[1]} elements but {name_b} rows have {b.shape[1]}")


def check_owner_args(cp_size: int, page_size: int, rank: int) -> None:
    if cp_size < 1 or page_size < 1 or not 0 <= rank < cp_size:
        raise ValueError(
            f"need cp_size >= 1, page_size >= 1, 0 <= rank < cp_size; got {cp_size=}, {page_size=}, {rank=}"
        )


def check_aligned(op: str, what: str, *, bytes_: int, offsets: tuple[int, ...]) -> None:
    """Every byte offset (base address, row stride in bytes) a multiple of `bytes_`."""
    if any(n % bytes_ for n in offsets):
        raise KernelUnsupported(f"{op}'s kernel needs {what} ({bytes_}-byte aligned), got byte offsets {offsets}")
