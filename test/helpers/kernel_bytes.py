"""Byte-exact checks shared by the CPU and GPU kernel tests (test/kernels/): outputs are
poisoned with POISON before a kernel runs, so a row it should have written but did not differs."""

import os

import pytest
import torch

from sglang_nsa_cp.envs import envs

POISON = 0xAB


def seed_torch() -> int:
    """Seed torch from SGLANG_NSA_CP_TEST_SEED, or at random; the seed is returned so a failing
    test's parameters name it and the run can be repeated."""
    value = envs.SGLANG_NSA_CP_TEST_SEED.get() or int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def random_rows(rows: int, dtype: torch.dtype, width: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Random bytes of every pattern (NaN bit patterns included: rows are moved as bytes)."""
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, device=device).view(dtype)


def assert_bytes_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got_b, want_b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert got_b.shape == want_b.shape, f"{name}: shape {tuple(got_b.shape)} != {tuple(want_b.shape)}"
    diff = (got_b != want_b).nonzero()
    if len(diff):
        r, c = diff[0].tolist()
        pytest.fail(
            f"{name}: {len(diff)} of {got_b.numel()} bytes differ; first at row {r} byte {c}: "
            f"got {got_b[r, c].item():#04x}, want {want_b[r, c].item():#04x} (poison {POISON:#04x})"
        )


def every_bf16_block_value() -> torch.Tensor:
    """Latent rows whose 128-value blocks each hold 448 (so the scale is exactly 1 and the fp8
    codes are the values themselves) and then every bf16 value from 2**-12 to 448, both signs:
    all rounding ties, mantissa carries into the next exponent, and subnormal codes."""
    bits = torch.arange(0x3980, 0x43E1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = torch.cat([bits, -bits])
    per_block = 127
    blocks = -(-values.numel() // per_block)
    values = torch.cat([values, torch.zeros(blocks * per_block - values.numel(), dtype=torch.bfloat16)])
    tile = torch.cat([torch.full((blocks, 1), 448.0, dtype=torch.bfloat16), values.view(blocks, per_block)], 1)
    tile = torch.cat([tile, tile[: (-blocks) % 4]])  # whole rows of four blocks
    nope = tile.reshape(-1, 512)
    return torch.cat([nope, torch.randn(nope.shape[0], 64).to(torch.bfloat16)], 1)
