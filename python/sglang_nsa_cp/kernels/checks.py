"""Named input checks shared by the ops' kernels and references: each names the argument, what it
must be and what it is. Bad input raises ValueError/TypeError in every implementation; a layout
only the kernels cannot take (strided rows, misaligned starts) raises `KernelUnsupported`."""

from __future__ import annotations

import torch


class KernelUnsupported(ValueError):
    """Valid input the kernel cannot take (a named reason for the dispatcher to use the reference)."""


def check_index(name: str, index: torch.Tensor, rows: int, device: torch.device) -> None:
    if index.dim() != 1 or index.numel() != rows:
        raise ValueError(f"{name} must be 1-D with {rows} entries, got shape {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device} but the rows are on {device}")


def check_owner_args(cp_size: int, page_size: int, rank: int) -> None:
    if cp_size < 1 or page_size < 1 or not 0 <= rank < cp_size:
        raise ValueError(
            f"need cp_size >= 1, page_size >= 1, 0 <= rank < cp_size; got {cp_size=}, {page_size=}, {rank=}"
        )


def check_aligned(op: str, what: str, *, bytes_: int, offsets: tuple[int, ...]) -> None:
    """Every byte offset (base address, row stride in bytes) a multiple of `bytes_`."""
    if any(n % bytes_ for n in offsets):
        raise KernelUnsupported(f"{op}'s kernel needs {what} ({bytes_}-byte aligned), got byte offsets {offsets}")
