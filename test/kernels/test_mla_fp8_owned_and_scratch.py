"""The fused fp8 store of SGLang's sharded DSA pool against SGLang's own quantizer, byte for byte
(CPU under Triton's interpreter).

Two comparisons, each for every rank of CP 1, 2, 3, 4, 8:
- the Triton kernel against the bytes of `quantize_k_cache_separate`, placed by a per-token loop
  over the ownership formula (owner (s // page_size) % N, local row (s // (N * page_size)) *
  page_size + s % page_size): 1, 3, 63, 65 and 130 tokens, page sizes 64 and 1;
- the Triton kernel against the `_torch` reference on a few of those cases.
Destinations start as 0xFF bytes, so a row written that should not be, or not written that
should, differs. The kernel runs before the reference. Inputs are fresh random draws; failure
messages carry the seed and SGLANG_NSA_CP_TEST_SEED=<seed> replays it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (sglang imports it)

import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

register_cpu_ci(est_time=50, suite="nsa-cp-test-cpu")

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(
        not triton.knobs.runtime.interpret, reason="CPU kernel tests need TRITON_INTERPRET=1 before triton is imported"
    ),
    # numpy's "divide by zero" / "invalid value" from the interpreter: amax == 0 blocks, on purpose.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate  # noqa: E402

from sglang_nsa_cp import kernels  # noqa: E402
from sglang_nsa_cp.kernels import mla_fp8_owned_and_scratch as op  # noqa: E402

from helpers.kernel_bytes import assert_bytes_equal, seed_torch  # noqa: E402

UNTOUCHED = 0xFF
ROW_BYTES = 656
CP_SIZES = [1, 2, 3, 4, 8]
TOKENS = [1, 3, 63, 65, 130]
SCRATCH_SPARE_ROWS = 7  # scratch rows no token targets


@pytest.fixture(scope="module")
def seed() -> int:
    return seed_torch()


def latent(tokens: int) -> torch.Tensor:
    """bf16 [T, 576]: magnitudes over many decades per row, exact zeros, one all-zero block."""
    kv = torch.randn(tokens, 576) * torch.exp(torch.randn(tokens, 1) * 4)
    kv[torch.rand(kv.shape) < 0.02] = 0.0
    kv[0, 128:256] = 0.0
    return kv.to(torch.bfloat16)


@pytest.fixture(scope="module")
def chunks(seed) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """tokens -> (latent rows [T, 576] bf16, SGLang's fp8 rows of them [T, 656]), quantized once."""
    out = {}
    for tokens in TOKENS:
        kv = latent(tokens)
        out[tokens] = (kv, sglang_rows(kv[:, :512], kv[:, 512:]))
    return out


def sglang_rows(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    nope, rope = quantize_k_cache_separate(k_nope, k_rope)
    return torch.cat([nope.squeeze(1), rope.squeeze(1)], dim=1)


def untouched(rows: int) -> torch.Tensor:
    return torch.full((rows, ROW_BYTES), UNTOUCHED, dtype=torch.uint8)


def chunk_slots(tokens: int, cp_size: int, page_size: int) -> tuple[torch.Tensor, int]:
    """out_cache_loc-like slots (runs inside pages in random order, starting mid-page; never the
    reserved first N pages) and the shard rows each rank holds."""
    pages = -(-(tokens + page_size) // page_size) + 2 * cp_size
    pages += -pages % cp_size
    order = cp_size + torch.randperm(pages - cp_size)
    slots = (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    start = int(torch.randint(0, page_size, ()))
    return slots[start : start + tokens].clone(), pages // cp_size * page_size


def expected(rows, scratch_rows, slots, rank, cp_size, page_size, scratch_len, shard_len):
    """Brute force: each token's SGLang row to its scratch row, and to its shard row if `rank` owns it."""
    scratch, shard = untouched(scratch_len), untouched(shard_len)
    for i, (srow, slot) in enumerate(zip(scratch_rows.tolist(), slots.tolist(), strict=True)):
        if srow >= 0:
            scratch[srow] = rows[i]
        if slot >= 0 and (slot // page_size) % cp_size == rank:
            shard[(slot // (cp_size * page_size)) * page_size + slot % page_size] = rows[i]
    return scratch, shard


def run_kernel(scratch_rows, slots, kv, rank, cp_size, page_size, scratch_len, shard_len):
    return op.store_mla_fp8_owned_and_scratch_triton(
        untouched(scratch_len), scratch_rows, untouched(shard_len), slots, kv[:, :512], kv[:, 512:],
        rank, cp_size, page_size,
    )  # fmt: skip


def check_every_rank(name, kv, rows, scratch_rows, slots, cp_size, page_size, shard_len):
    scratch_len = max(int(scratch_rows.max()) + 1, 0) + SCRATCH_SPARE_ROWS
    for rank in range(cp_size):
        got = run_kernel(scratch_rows, slots, kv, rank, cp_size, page_size, scratch_len, shard_len)
        want = expected(rows, scratch_rows, slots, rank, cp_size, page_size, scratch_len, shard_len)
        assert_bytes_equal(f"{name} {rank=} scratch", got[0], want[0])
        assert_bytes_equal(f"{name} {rank=} shard", got[1], want[1])


# ---- against SGLang's bytes ------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_matches_sglang_quantizer(seed, chunks, tokens, cp_size, page_size):
    kv, rows = chunks[tokens]
    slots, shard_len = chunk_slots(tokens, cp_size, page_size)
    scratch_rows = torch.randperm(tokens + SCRATCH_SPARE_ROWS)[:tokens]
    index_dtype = torch.int32 if tokens % 2 else torch.int64
    name = f"{tokens=} {cp_size=} {page_size=} {index_dtype=} {seed=}"
    check_every_rank(name, kv, rows, scratch_rows.to(index_dtype), slots.to(index_dtype), cp_size, page_size, shard_len)


@pytest.mark.parametrize("tokens,cp_size,page_size", [(65, 2, 64), (130, 3, 64), (63, 4, 1)])
def test_matches_torch_reference(seed, chunks, tokens, cp_size, page_size):
    kv, _ = chunks[tokens]
    slots, shard_len = chunk_slots(tokens, cp_size, page_size)
    slots[torch.rand(tokens) < 0.1] = -1
    scratch_rows = torch.randperm(tokens + SCRATCH_SPARE_ROWS)[:tokens]
    scratch_rows[torch.rand(tokens) < 0.1] = -1
    scratch_len = tokens + SCRATCH_SPARE_ROWS
    for rank in range(cp_size):
        name = f"{tokens=} {cp_size=} {page_size=} {rank=} {seed=}"
        got = run_kernel(scratch_rows, slots, kv, rank, cp_size, page_size, scratch_len, shard_len)
        want = op.store_mla_fp8_owned_and_scratch_torch(
            untouched(scratch_len), scratch_rows, untouched(shard_len), slots, kv[:, :512], kv[:, 512:],
            rank, cp_size, page_size,
        )  # fmt: skip
        assert_bytes_equal(f"{name} scratch", got[0], want[0])
        assert_bytes_equal(f"{name} shard", got[1], want[1])


# ---- edge cases ------------------------------------------------------------------------------
def edge_latent() -> torch.Tensor:
    """One row per edge: all zeros; huge values (near bf16's max); tiny values (bf16 subnormals,
    whose scale is an fp32 subnormal and whose reciprocal overflows); one huge value among tiny
    ones (codes underflow to zero); -0.0 only; +-inf; a NaN among normal values."""
    kv = torch.randn(9, 576)
    kv[0] = 0.0
    kv[1, :512] = torch.randn(512) * 1e38
    kv[2, :512] = torch.randn(512) * 1e-39
    kv[3, :512] = torch.randn(512) * 1e-30
    kv[3, ::128] = 3e38
    kv[4] = -0.0
    kv[5, 7] = float("inf")
    kv[6, 300] = float("-inf")
    kv[7, 200] = float("nan")
    kv[8, :512] = 448.0 * torch.sign(torch.randn(512))
    return kv.to(torch.bfloat16)


@pytest.mark.parametrize("cp_size,page_size", [(1, 64), (2, 64), (3, 1)])
def test_extreme_values(seed, cp_size, page_size):
    kv = edge_latent()
    rows = sglang_rows(kv[:, :512], kv[:, 512:])
    assert (rows[0, 512:528] == 0).all(), "an all-zero block has scale 0 in SGLang's format"
    slots, shard_len = chunk_slots(kv.shape[0], cp_size, page_size)
    scratch_rows = torch.randperm(kv.shape[0])
    name = f"extreme values {cp_size=} {page_size=} {seed=}"
    check_every_rank(name, kv, rows, scratch_rows, slots, cp_size, page_size, shard_len)


def test_padding_slot_and_skips(seed):
    """CUDA-graph padding: tokens at slot 0 (rank 0's reserved page 0, shard row 0), all zeros and
    all staged to one trash row; slot -1 and scratch row -1 store nothing."""
    cp_size, page_size = 4, 64
    kv = latent(12)
    slots, shard_len = chunk_slots(12, cp_size, page_size)
    scratch_rows = torch.arange(12)
    slots[8:], kv[8:], scratch_rows[8:] = 0, 0.0, 15  # four padding tokens
    slots[2] = -1
    scratch_rows[5] = -1
    rows = sglang_rows(kv[:, :512], kv[:, 512:])
    check_every_rank(f"padding {seed=}", kv, rows, scratch_rows, slots, cp_size, page_size, shard_len)
    # Rank 0 writes exactly shard row 0 of page 0; other ranks hold no part of page 0.
    got = run_kernel(scratch_rows, slots, kv, 1, cp_size, page_size, 16, shard_len)
    assert (got[1][:page_size] == UNTOUCHED).all(), "rank 1 wrote into its first local page for slot 0"
    got = run_kernel(torch.full((12,), -1), torch.full((12,), -1), kv, 0, cp_size, page_size, 16, shard_len)
    assert (got[0] == UNTOUCHED).all() and (got[1] == UNTOUCHED).all(), "all -1 rows and slots stored something"


def test_layouts_sglang_passes(seed):
    """[T, 1, 512] / [T, 1, 64] views, and k_nope / k_rope as column slices of one latent row."""
    packed = torch.cat([latent(21), torch.zeros(21, 8, dtype=torch.bfloat16)], 1)  # 584-value rows
    k_nope, k_rope = packed[:, :512], packed[:, 512:576]
    rows = sglang_rows(k_nope.contiguous(), k_rope.contiguous())
    slots, shard_len = chunk_slots(21, 2, 64)
    scratch_rows = torch.randperm(21)
    for rank in range(2):
        want = expected(rows, scratch_rows, slots, rank, 2, 64, 21, shard_len)
        for name, nope, rope in (("slices", k_nope, k_rope), ("3-D", k_nope[:, None], k_rope[:, None])):
            got = op.store_mla_fp8_owned_and_scratch_triton(
                untouched(21), scratch_rows, untouched(shard_len), slots, nope, rope, rank, 2, 64
            )
            assert_bytes_equal(f"{name} {rank=} {seed=} scratch", got[0], want[0])
            assert_bytes_equal(f"{name} {rank=} {seed=} shard", got[1], want[1])


def test_empty_chunk():
    k = torch.empty(0, 576, dtype=torch.bfloat16)
    none = torch.empty(0, dtype=torch.long)
    got = op.store_mla_fp8_owned_and_scratch_triton(
        untouched(2), none, untouched(2), none, k[:, :512], k[:, 512:], 0, 2, 64
    )
    assert (got[0] == UNTOUCHED).all() and (got[1] == UNTOUCHED).all()


def test_rejects_bad_input():
    k = torch.zeros(3, 576, dtype=torch.bfloat16)
    idx = torch.zeros(3, dtype=torch.long)
    call = op.store_mla_fp8_owned_and_scratch_triton
    with pytest.raises(TypeError, match=r"k_nope must be bf16 \[T, 512\]"):
        call(untouched(4), idx, untouched(4), idx, k[:, :512].float(), k[:, 512:], 0, 1, 64)
    with pytest.raises(TypeError, match=r"k_rope must be bf16 \[T, 64\]"):
        call(untouched(4), idx, untouched(4), idx, k[:, :512], k[:, 500:], 0, 1, 64)
    with pytest.raises(ValueError, match="k_nope has 3 tokens but k_rope has 2"):
        call(untouched(4), idx, untouched(4), idx, k[:, :512], k[:2, 512:], 0, 1, 64)
    with pytest.raises(TypeError, match=r"shard must be uint8 \[R, 656\]"):
        call(untouched(4), idx, torch.zeros(4, 576, dtype=torch.bfloat16), idx, k[:, :512], k[:, 512:], 0, 1, 64)
    with pytest.raises(ValueError, match="scratch_rows must be 1-D with 3 entries"):
        call(untouched(4), idx[:2], untouched(4), idx, k[:, :512], k[:, 512:], 0, 1, 64)
    with pytest.raises(TypeError, match="slots must be int32 or int64"):
        call(untouched(4), idx, untouched(4), idx.short(), k[:, :512], k[:, 512:], 0, 1, 64)
    with pytest.raises(ValueError, match="rank < cp_size"):
        call(untouched(4), idx, untouched(4), idx, k[:, :512], k[:, 512:], 3, 3, 64)
    with pytest.raises(op.KernelUnsupported, match="contiguous scratch"):
        call(untouched(4)[::2], idx, untouched(4), idx, k[:, :512], k[:, 512:], 0, 1, 64)
    with pytest.raises(op.KernelUnsupported, match="4-byte aligned"):
        odd = torch.zeros(3, 577, dtype=torch.bfloat16)  # odd row stride: rope rows not word-aligned
        call(untouched(4), idx, untouched(4), idx, odd[:, :512], odd[:, 512:576], 0, 1, 64)


def test_dispatch(seed, monkeypatch):
    """Forced Triton runs the kernel on CPU tensors; auto uses the reference there."""
    kv = latent(5)
    slots, shard_len = chunk_slots(5, 2, 64)
    args = (torch.arange(5), untouched(shard_len), slots, kv[:, :512], kv[:, 512:], 0, 2, 64)
    calls = []
    monkeypatch.setattr(op, "store_mla_fp8_owned_and_scratch_triton", lambda *a: calls.append("triton"))
    monkeypatch.setattr(op, "store_mla_fp8_owned_and_scratch_torch", lambda *a: calls.append("torch"))
    try:
        for mode in ("triton", "auto", "torch"):
            monkeypatch.setenv(kernels.KERNELS_ENV, mode)
            kernels.kernel_mode.cache_clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                kernels.store_mla_fp8_owned_and_scratch(untouched(5), *args)
    finally:
        kernels.kernel_mode.cache_clear()
    assert calls == ["triton", "torch", "torch"], calls


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
