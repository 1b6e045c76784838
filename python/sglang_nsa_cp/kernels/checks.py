"""Input checks of the kernels' launchers, shared by the Triton and CUDA versions: each names
the argument, what it must be and what it is."""

from __future__ import annotations

import torch

from sglang_nsa_cp.kernels.reference import MLA_FP8_ROW_BYTES, MLA_NOPE_DIM, MLA_ROPE_DIM


def check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows x row elements), got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs contiguous rows (stride(1) == 1), got strides {t.stride()}")


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


def check_mla_fp8_store(
    shard: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rank: int, cp_size: int, page_size: int
) -> None:
    """Arguments of store_owned_mla_fp8: bf16 [T, 576] rows with 16-byte aligned starts, a
    contiguous 16-byte aligned uint8 [R, 656] shard on the same device."""
    check_rows("kv", kv)
    check_rows("shard", shard)
    if kv.dtype != torch.bfloat16 or kv.shape[1] != MLA_NOPE_DIM + MLA_ROPE_DIM:
        raise TypeError(f"kv must be bf16 [T, {MLA_NOPE_DIM + MLA_ROPE_DIM}], got {kv.dtype} {tuple(kv.shape)}")
    if shard.dtype != torch.uint8 or shard.shape[1] != MLA_FP8_ROW_BYTES:
        raise TypeError(f"shard must be uint8 [R, {MLA_FP8_ROW_BYTES}], got {shard.dtype} {tuple(shard.shape)}")
    if shard.stride(0) != MLA_FP8_ROW_BYTES or shard.data_ptr() % 16 or kv.stride(0) % 8 or kv.data_ptr() % 16:
        raise ValueError("store_owned_mla_fp8 needs a contiguous 16-byte aligned shard and 16-byte aligned kv rows")
    if shard.device != kv.device:
        raise ValueError(f"kv is on {kv.device} but shard is on {shard.device}")
    check_index("slots", slots, kv.shape[0], kv.device)
    check_owner_args(cp_size, page_size, rank)
