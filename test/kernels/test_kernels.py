"""Triton kernels against their torch references, on CPU under Triton's interpreter (CPU, ~10 s).

Inputs are fresh random draws each run; every failure message carries the seed, and
SGLANG_NSA_CP_TEST_SEED=<seed> replays it. Outputs are poisoned with 0xAB bytes before each
call, so an element the kernel should have written but did not fails the comparison.

All comparisons are bitwise, fp8 quantization included, rather than within a tolerance for the
interpreter's casts: its fp32->fp8 cast is not merely truncating but wrong (it halves values
whose rounding carries into an odd exponent, and mis-rounds subnormals), and its fma is not
fused. So under the interpreter the fp8 kernel divides with div_rn and rounds to e4m3 in
integer arithmetic (torch's round-to-nearest-even), exactly; on GPU it divides through fma
corrections and converts in hardware, which test_kernels_gpu.py checks bitwise.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (sglang imports it)

import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu")

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="CPU kernel tests need TRITON_INTERPRET=1 before triton is imported"
)

from triton.errors import TritonError  # noqa: E402

from sglang_nsa_cp import kernels  # noqa: E402
from sglang_nsa_cp.kernels import copy_rows, formats, index_k_store, mla_fp8_store  # noqa: E402

from helpers.kernel_bytes import POISON, assert_bytes_equal, every_bf16_block_value, random_rows, seed_torch  # noqa: E402

# (name, dtype, elements per row): the row kinds of the shared-KV path, plus widths that force
# 1- and 2-byte words and a strided source.
ROW_KINDS = [
    ("bf16-latent-1152B", torch.bfloat16, 576),
    ("fp8-latent-656B", torch.uint8, 656),
    ("index-132B", torch.uint8, 132),
    ("index-page-16x132B", torch.uint8, 16 * 132),
    ("odd-7B", torch.uint8, 7),
    ("int16-6B", torch.int16, 3),
]


@pytest.fixture
def seed() -> int:
    return seed_torch()


def poisoned(rows: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    out = torch.empty((rows, width), dtype=dtype)
    out.view(torch.uint8).fill_(POISON)
    return out


def with_skips(index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    index = index.clone()
    index[torch.rand(index.shape) < 0.2] = -1
    return index.to(dtype)


# ---- gather / scatter ------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype,width", ROW_KINDS, ids=[k[0] for k in ROW_KINDS])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_rows(seed, kind, dtype, width, index_dtype):
    src_rows = int(torch.randint(1, 40, ()))
    n = int(torch.randint(1, 40, ()))
    src = random_rows(src_rows, dtype, width)
    index = with_skips(torch.randint(0, src_rows, (n,)), index_dtype)
    got = copy_rows.gather_rows_triton(src, index, poisoned(n, dtype, width))
    want = copy_rows.gather_rows_torch(src, index.long(), poisoned(n, dtype, width))
    assert_bytes_equal(f"gather {kind} {index_dtype} {src_rows=} {n=} {seed=}", got, want)


@pytest.mark.parametrize("kind,dtype,width", ROW_KINDS, ids=[k[0] for k in ROW_KINDS])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_scatter_rows(seed, kind, dtype, width, index_dtype):
    dst_rows = int(torch.randint(1, 40, ()))
    n = int(torch.randint(1, dst_rows + 1, ()))
    src = random_rows(n, dtype, width)
    index = with_skips(torch.randperm(dst_rows)[:n], index_dtype)
    got = copy_rows.scatter_rows_triton(poisoned(dst_rows, dtype, width), index, src)
    want = copy_rows.scatter_rows_torch(poisoned(dst_rows, dtype, width), index.long(), src)
    assert_bytes_equal(f"scatter {kind} {index_dtype} {dst_rows=} {n=} {seed=}", got, want)


def test_gather_from_strided_source(seed):
    """Rows of a wider buffer (a column slice), as a latent view of a packed KV row would be."""
    wide = random_rows(30, torch.bfloat16, 600)
    src = wide[:, 8:584]
    index = with_skips(torch.randint(0, 30, (25,)), torch.int64)
    got = copy_rows.gather_rows_triton(src, index, poisoned(25, torch.bfloat16, 576))
    want = copy_rows.gather_rows_torch(src, index, poisoned(25, torch.bfloat16, 576))
    assert_bytes_equal(f"strided gather {seed=}", got, want)


def test_empty_and_all_skipped(seed):
    src = random_rows(5, torch.uint8, 656)
    out = poisoned(0, torch.uint8, 656)
    copy_rows.gather_rows_triton(src, torch.empty(0, dtype=torch.long), out)
    out = poisoned(4, torch.uint8, 656)
    copy_rows.gather_rows_triton(src, torch.full((4,), -1), out)
    assert (out == POISON).all(), f"an all -1 index wrote rows ({seed=})"
    shard = poisoned(8, torch.uint8, 656)
    copy_rows.store_owned_rows_triton(shard, torch.full((5,), -1), src, 0, 1, 4)
    assert (shard == POISON).all(), f"slots -1 were stored ({seed=})"


def test_rejects_bad_input():
    src = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(TypeError, match="rows are copied as they are"):
        copy_rows.gather_rows_triton(src, torch.zeros(2, dtype=torch.long), torch.zeros(2, 8, dtype=torch.int8))
    with pytest.raises(TypeError, match="int32 or int64"):
        copy_rows.gather_rows_triton(src, torch.zeros(2, dtype=torch.int16), torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D with 3 entries"):
        copy_rows.scatter_rows_triton(src, torch.zeros(2, dtype=torch.long), torch.zeros(3, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        copy_rows.gather_rows_triton(src.t(), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rank < cp_size"):
        copy_rows.store_owned_rows_triton(src, torch.zeros(4, dtype=torch.long), src, 2, 2, 64)


# ---- fused stores ----------------------------------------------------------------------------
def logical_slots(tokens: int, pages: int, page_size: int) -> torch.Tensor:
    """out_cache_loc-like slots: runs inside pages taken in random order, a few -1."""
    order = torch.randperm(pages)
    slots = (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    start = int(torch.randint(0, page_size, ()))  # a cached prefix that ends mid-page
    slots = slots[start : start + tokens]
    slots[torch.rand(slots.shape) < 0.05] = -1
    return slots


STORE_CASES = [(1, 64), (2, 16), (3, 1), (4, 16), (8, 4)]


@pytest.mark.parametrize("cp_size,page_size", STORE_CASES)
@pytest.mark.parametrize("kind,dtype,width", ROW_KINDS[:3], ids=[k[0] for k in ROW_KINDS[:3]])
def test_store_owned_rows(seed, cp_size, page_size, kind, dtype, width):
    pages = 4 * cp_size
    tokens = int(torch.randint(1, pages * page_size - page_size + 1, ()))
    slots = logical_slots(tokens, pages, page_size)
    rows = random_rows(tokens, dtype, width)
    shard_rows = pages // cp_size * page_size
    for rank in range(cp_size):
        got = copy_rows.store_owned_rows_triton(
            poisoned(shard_rows, dtype, width), slots.int(), rows, rank, cp_size, page_size
        )
        want = copy_rows.store_owned_rows_torch(
            poisoned(shard_rows, dtype, width), slots, rows, rank, cp_size, page_size
        )
        assert_bytes_equal(f"store {kind} {cp_size=} {page_size=} {rank=} {tokens=} {seed=}", got, want)


def bf16_latent(tokens: int) -> torch.Tensor:
    """Values over many magnitudes per block, exact zeros and a whole zero block."""
    kv = torch.randn(tokens, 576) * torch.exp(torch.randn(tokens, 1) * 4)
    kv[torch.rand(kv.shape) < 0.02] = 0.0
    kv[0, 128:256] = 0.0
    return kv.to(torch.bfloat16)


@pytest.mark.parametrize("cp_size,page_size", [(1, 64), (2, 16), (3, 4)])
def test_store_owned_mla_fp8(seed, cp_size, page_size):
    pages = 3 * cp_size
    tokens = int(torch.randint(1, pages * page_size - page_size + 1, ()))
    slots = logical_slots(tokens, pages, page_size)
    kv = bf16_latent(tokens)
    shard_rows = pages // cp_size * page_size
    for rank in range(cp_size):
        got = mla_fp8_store.store_owned_mla_fp8_triton(
            poisoned(shard_rows, torch.uint8, 656), slots, kv, rank, cp_size, page_size
        )
        want = mla_fp8_store.store_owned_mla_fp8_torch(
            poisoned(shard_rows, torch.uint8, 656), slots, kv, rank, cp_size, page_size
        )
        assert_bytes_equal(f"fp8 store {cp_size=} {page_size=} {rank=} {tokens=} {seed=}", got, want)


def test_fp8_rounding_of_every_bf16_value():
    kv = every_bf16_block_value()
    slots = torch.arange(kv.shape[0])
    got = mla_fp8_store.store_owned_mla_fp8_triton(poisoned(kv.shape[0], torch.uint8, 656), slots, kv, 0, 1, 64)
    want = formats.quantize_mla_fp8(kv)
    assert_bytes_equal("fp8 rounding of every bf16 value in [2**-12, 448]", got, want)


@pytest.mark.parametrize("cp_size,page_size", [(1, 64), (2, 16), (4, 8)])
def test_store_owned_index_k(seed, cp_size, page_size):
    pages = 3 * cp_size
    tokens = int(torch.randint(1, pages * page_size - page_size + 1, ()))
    slots = logical_slots(tokens, pages, page_size)
    key = random_rows(tokens, torch.uint8, 128)
    scale = torch.rand(tokens) * 10
    local_pages = pages // cp_size
    for rank in range(cp_size):
        got = index_k_store.store_owned_index_k_triton(
            poisoned(local_pages, torch.uint8, page_size * 132), slots, key, scale, rank, cp_size, page_size
        )
        want = index_k_store.store_owned_index_k_torch(
            poisoned(local_pages, torch.uint8, page_size * 132), slots, key, scale, rank, cp_size, page_size
        )
        name = f"index-K store {cp_size=} {page_size=} {rank=} {tokens=} {seed=}"
        assert_bytes_equal(name, got, want)
        # Round trip through SGLang's page layout: each owned token reads back where it belongs.
        rows = formats.owned_physical_rows(slots, rank, cp_size, page_size)
        mine = rows >= 0
        back_key, back_scale = formats.read_index_k(got, rows[mine], page_size)
        assert torch.equal(back_key, key[mine]), name
        assert torch.equal(back_scale, scale[mine]), name


# ---- dispatch --------------------------------------------------------------------------------
@pytest.fixture
def mode(monkeypatch):
    def set_mode(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
        else:
            monkeypatch.setenv(kernels.KERNELS_ENV, value)
        kernels.kernel_mode.cache_clear()

    yield set_mode
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    kernels.kernel_mode.cache_clear()
    kernels._failed.clear()
    kernels._cuda_unbuildable.clear()


def test_dispatch_rule(mode):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    mode(None)
    assert kernels.implementation("gather_rows", cpu) == "torch"
    assert kernels.implementation("gather_rows", cuda) == "triton"
    mode("torch")
    assert kernels.implementation("gather_rows", cuda) == "torch"
    mode("triton")
    assert kernels.implementation("gather_rows", cpu) == "triton"
    mode("cuda")
    with pytest.raises(ValueError, match="expected one of"):
        kernels.implementation("gather_rows", cpu)


def test_fp8_store_prefers_its_cuda_kernel_and_falls_back_to_triton_with_one_warning(mode, monkeypatch):
    cuda, op = torch.device("cuda"), "store_owned_mla_fp8"
    mode(None)
    monkeypatch.setattr(mla_fp8_store, "build_cuda", lambda device: object())
    assert kernels.implementation(op, cuda) == "cuda"
    assert kernels.implementation("store_owned_rows", cuda) == "triton"  # no CUDA kernel

    def no_toolkit(device):
        raise OSError("CUDA_HOME environment variable is not set")

    monkeypatch.setattr(mla_fp8_store, "build_cuda", no_toolkit)
    with pytest.warns(RuntimeWarning, match="could not be built .*CUDA_HOME.* using the Triton kernel"):
        assert kernels.implementation(op, cuda) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.implementation(op, cuda) == "triton"
    mode("triton")
    monkeypatch.setattr(mla_fp8_store, "build_cuda", lambda device: object())
    assert kernels.implementation(op, cuda) == "triton"


def test_forced_triton_on_cpu_runs_the_kernel(mode, monkeypatch):
    mode("triton")
    calls = []
    monkeypatch.setattr(copy_rows, "gather_rows_triton", lambda *a: calls.append(a) or copy_rows.gather_rows_torch(*a))
    src = random_rows(4, torch.uint8, 8)
    kernels.gather_rows(src, torch.tensor([3, -1]), poisoned(2, torch.uint8, 8))
    assert len(calls) == 1


def test_failed_launch_falls_back_once_with_a_warning(mode, monkeypatch):
    mode(None)
    monkeypatch.setattr(kernels, "implementation", lambda op, device: "torch" if op in kernels._failed else "triton")

    def broken(*args):
        raise TritonError("no compiler")

    monkeypatch.setattr(copy_rows, "scatter_rows_triton", broken)
    src = random_rows(3, torch.uint8, 8)
    index = torch.tensor([2, -1, 0])
    with pytest.warns(RuntimeWarning, match="scatter_rows: the Triton kernel failed"):
        got = kernels.scatter_rows(poisoned(4, torch.uint8, 8), index, src)
    assert_bytes_equal("fallback result", got, copy_rows.scatter_rows_torch(poisoned(4, torch.uint8, 8), index, src))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.scatter_rows(poisoned(4, torch.uint8, 8), index, src)
    assert kernels._failed == {"scatter_rows"}


def test_bad_input_is_not_a_launch_failure(mode, monkeypatch):
    mode(None)
    monkeypatch.setattr(kernels, "implementation", lambda op, device: "triton")
    with pytest.raises(TypeError, match="rows are copied as they are"):
        kernels.gather_rows(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), torch.zeros(1, 4))
    assert not kernels._failed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
