"""GPU, 1 x H200, ~8 min: `--dsa-prefill-backend flashmla_sparse_q8` through SGLang 0.5.23's own DSA
forward on CUDA at GLM-5's attention shapes (test/helpers/sglang_gpu_harness.py, the batches of
test_sglang_gpu_forward.py), shared KV against replicated CP at CP 2, bf16 and fp8 KV.

Runs only where CUDA and the GPU bundle are; `bash scripts/gpu_run.sh q8` runs it. q8's prep
kernels (q cast, prefix gathers) are SGLang's Triton kernels, compiled; first checked bit for bit
against the torch twins the CPU test (test_sglang_q8_forward.py) runs in their place. The
attention kernel is SGLang's SM90 JIT kernel (`sparse_mla_q8kv8_prefill_sm90`, CUTLASS + tvm-ffi,
built by nvcc on first use) when it builds: it needs CUTLASS headers, which SGLang finds in
flashinfer or DeepGEMM (neither loads on the GPU machine) or `NSA_CP_CUTLASS_INCLUDE` names
(`gpu_run.sh q8` unpacks `.gpu_bundle/cutlass.tar.xz`, from scripts/gpu_cutlass.sh). When it does
not build, `test_q8_jit_kernel_builds` fails with the build's error and the forward runs with
`sparse_mla_q8kv8_reference` (logged as a stand-in), so shared KV is still checked against
replicated CP through SGLang's compiled prep kernels and the sharded pool on NCCL.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import functools  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

from helpers.distributed import run_ranks  # noqa: E402
from helpers.gpu_only import NEEDS_CUDA_AND_THE_BUNDLE  # noqa: E402

register_cuda_ci(est_time=480, suite="nsa-cp-test-1-gpu-h200")

pytestmark = NEEDS_CUDA_AND_THE_BUNDLE

Q8 = "flashmla_sparse_q8"
RUNS = {  # name: (ranks, mode, kv_cache_dtype)
    "replicated": (2, "replicated", "bfloat16"),
    "shared": (2, "shared", "bfloat16"),
    "fp8-replicated": (2, "replicated", "fp8_e4m3"),
    "fp8-shared": (2, "shared", "fp8_e4m3"),
}
PAIRS = [("shared", "replicated"), ("fp8-shared", "fp8-replicated")]


@functools.cache
def jit_build() -> str | None:
    """Build SGLang's q8 JIT kernel here (nvcc, cached on disk for the ranks) and run it once;
    None when it works, else the error."""
    from helpers import sglang_gpu_harness as G

    G.install()
    G.use_cutlass_from_env()
    try:
        from sglang.kernels.ops.attention import sparse_mla_q8kv8_prefill_sm90 as q8kv8

        q8kv8._jit_sparse_mla_q8kv8_prefill_module()
        return None
    except Exception:  # any build failure is the finding: reported, then the reference kernel runs
        return traceback.format_exc(limit=3)[-3000:]


def test_q8_jit_kernel_builds_and_is_close_to_the_reference():
    """SGLang's kernel builds here, and against `sparse_mla_q8kv8_reference` on random fp8 inputs
    it is close (same contract; not bitwise: the kernel's online softmax rescales per 64-entry
    block and its exp2 is fast-math)."""
    from helpers.sglang_gpu_harness import CUTLASS_ENV

    error = jit_build()
    print("q8 JIT kernel:", "built" if error is None else f"did not build:\n{error}")
    assert error is None, f"SGLang's q8 JIT kernel did not build (set {CUTLASS_ENV} to CUTLASS headers):\n{error}"
    from sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90 import sparse_mla_q8kv8_prefill_fwd

    from helpers.sglang_cpu_stand_ins import sparse_mla_q8kv8_reference

    g = torch.Generator("cuda").manual_seed(0)
    s_q, s_kv, topk = 96, 1000, 256
    q = (torch.randn(s_q, 64, 576, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    kv = torch.randn(s_kv + topk, 1, 576, generator=g, device="cuda")
    kv[s_kv:] = 0  # the landing pad
    kv = kv.to(torch.float8_e4m3fn)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, device="cuda", dtype=torch.int32)
    idx[::3, :, 100:] = -1  # some rows with few valid entries
    one = torch.ones(1, device="cuda")
    got, _, got_lse = sparse_mla_q8kv8_prefill_fwd(q, kv, idx, 0.04, one, one, d_v=512)
    want, _, want_lse = sparse_mla_q8kv8_reference(q, kv, idx, 0.04, one, one, d_v=512)
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    lse_diff = (got_lse - want_lse).abs().max().item()
    print(f"q8 kernel vs reference: max |diff| {diff:.4f} on outputs up to {scale:.3f}; lse {lse_diff:.2e}")
    assert torch.isfinite(got.float()).all()
    assert diff <= 0.05 * scale, f"max |diff| {diff} on outputs up to {scale}"
    assert lse_diff <= 1e-2, f"lse max |diff| {lse_diff}"


def test_prep_kernel_twins_are_bit_equal_to_sglangs_compiled_kernels():
    """The CPU test runs torch twins of q8's Triton prep kernels: equal to them here, on values past
    e4m3's range too (the interpreter's cast is not the GPU's)."""
    from helpers import sglang_gpu_harness as G

    G.install()
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import (
        gather_cast_kv_fp8_pad_paged,
        gather_dequant_requant_fp8_paged_dsa,
    )
    from sglang.kernels.ops.attention.mla_qk_prep import concat_and_cast_q_fp8_pad

    from helpers import sglang_cpu_stand_ins as S

    g = torch.Generator("cuda").manual_seed(1)

    def bf16(*shape):
        x = torch.randn(*shape, generator=g, device="cuda") * 100
        x.view(-1)[:4] = torch.tensor([1000.0, -1000.0, 448.0, 1e-3])
        return x.to(torch.bfloat16)

    def dirty(*shape):
        return torch.full(shape, 0.5, device="cuda").to(torch.float8_e4m3fn)

    def same(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    q_nope, q_rope = bf16(300, 16, 512), bf16(300, 16, 64)
    got, want = dirty(300, 64, 576), dirty(300, 64, 576)
    S.concat_and_cast_q_fp8_pad_torch(got, q_nope, q_rope, 16)
    concat_and_cast_q_fp8_pad(want, q_nope, q_rope, 16)
    assert same(got, want), "q cast"
    kv, loc = bf16(4000, 1, 576), torch.randint(0, 4000, (2500,), generator=g, device="cuda", dtype=torch.int32)
    got, want = dirty(2500 + 2048, 576), dirty(2500 + 2048, 576)
    S.gather_cast_kv_fp8_pad_paged_torch(got, kv, loc, 512)
    gather_cast_kv_fp8_pad_paged(want, kv, loc, 512)
    assert same(got, want), "bf16 prefix gather"
    nope, rope = S.quantize_k_cache_separate_torch(kv[:, 0, :512], kv[:, 0, 512:])
    pool = torch.cat([nope, rope], dim=-1).view(torch.float8_e4m3fn)  # [4000, 1, 656]
    got, want = dirty(2500 + 2048, 1, 576), dirty(2500 + 2048, 1, 576)
    S.gather_dequant_requant_fp8_paged_dsa_torch(pool, loc, extra_rows=2048, out=got)
    gather_dequant_requant_fp8_paged_dsa(pool, loc, extra_rows=2048, out=want)
    assert same(got, want), "fp8 prefix gather"


@pytest.fixture(scope="module")
def runs():
    from helpers import sglang_gpu_harness as G

    kernel = "jit" if jit_build() is None else "reference"
    path = G.write_config(tempfile.mkdtemp(prefix="glm5_attn_"), G.GLM5_ATTN)
    return kernel, {
        name: run_ranks(G.run_check, world, args=(path, mode, kv, Q8, kernel), backend="nccl", timeout_s=1200)
        for name, (world, mode, kv) in RUNS.items()
    }


@pytest.mark.parametrize("run, reference", PAIRS)
def test_shared_kv_equals_replicated_cp_under_q8_bit_for_bit(runs, run, reference):
    kernel, results = runs
    print(f"q8 attention kernel: {kernel}")
    for rank, (r, rep) in enumerate(zip(results[run], results[reference], strict=True)):
        assert r["pool"] == "PageInterleaveDSATokenToKVPool" and rep["pool"] == "DSATokenToKVPool", f"{rank=}"
        assert r["history"] == [False, True, True], f"{run}, {rank=}: {r['history']}"
        for b, (got, want) in enumerate(zip(r["logits"], rep["logits"], strict=True)):
            assert torch.isfinite(got).all(), f"{run}, {rank=}, batch {b}: non-finite logits"
            assert torch.equal(got, want), f"{run}, {rank=}, batch {b}: max diff {float((got - want).abs().max())}"
        assert r["decode_pool_digests"] == rep["decode_pool_digests"], f"{run}, {rank=}: decode pool bytes differ"
        called = [line for line in r["stand_ins"].splitlines() if line.strip().startswith("call ")]
        print(run, rank, "stand-ins called:", called)
        assert all("q8 attention" in line for line in called), f"{run}, {rank=}: {called}"
        assert bool(called) == (kernel == "reference"), f"{run}, {rank=}: kernel {kernel}, stand-ins {called}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
