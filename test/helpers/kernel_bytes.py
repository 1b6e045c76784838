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
