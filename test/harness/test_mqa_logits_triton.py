"""GPU, ~15 s: the harness's Triton fp8 MQA-logits kernel (test/helpers/mqa_logits_triton.py) against an
fp32 reference of DeepGEMM's `fp8_mqa_logits` contract (within fp8 tensor-core accumulation) and against SGLang's own torch fallback
(`_fp8_mqa_logits_torch`, whose scores are rounded to bf16). Only columns ks <= n < ke are
compared: the kernel leaves the others unwritten, as DeepGEMM does with clean_logits=False.
Skipped without CUDA or with the Triton interpreter on."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled for the GPU (conftest.py defaults to 1)

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=23, suite="nsa-cp-test-1-gpu-h200")

from helpers.gpu_only import skip_unless_compiled_triton_on_cuda  # noqa: E402

skip_unless_compiled_triton_on_cuda()

from helpers.mqa_logits_triton import fp8_mqa_logits  # noqa: E402


def _case(m, n, heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(m, heads, 128, generator=g, device="cuda") * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(n, 128, generator=g, device="cuda") * 2).to(torch.float8_e4m3fn)
    k_scale = torch.rand(n, generator=g, device="cuda") + 0.1
    w = torch.randn(m, heads, generator=g, device="cuda")
    # causal ranges of a chunk of m queries at the end of an n-token context, plus ragged starts
    ke = torch.arange(n - m + 1, n + 1, device="cuda", dtype=torch.int32)
    ks = (torch.arange(m, device="cuda", dtype=torch.int32) * 7) % max(1, n // 3)
    return q, k, k_scale, w, ks, ke


def _fp32_reference(q, k, k_scale, w):
    scores = torch.einsum("mhd,nd->mhn", q.float(), k.float()).relu()
    return torch.einsum("mhn,mh->mn", scores, w) * k_scale[None, :]


@pytest.mark.parametrize("m,n,heads", [(1, 1, 32), (5, 300, 32), (128, 1000, 32), (257, 4099, 64), (1024, 8192, 32)])
def test_triton_mqa_logits_match_the_fp32_contract(m, n, heads):
    q, k, k_scale, w, ks, ke = _case(m, n, heads, seed=m + n)
    got = fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    want = _fp32_reference(q, k, k_scale, w)
    cols = torch.arange(n, device="cuda")[None, :]
    valid = (cols >= ks[:, None]) & (cols < ke[:, None])
    err = ((got - want).abs() * valid).max() / want.abs().max().clamp_min(1e-9)
    # Hopper's fp8 tensor cores accumulate with about 14 mantissa bits (DeepGEMM's kernel too):
    # measured up to 7.7e-4 here on an H200; a wrong head, weight, scale or range is O(1).
    assert err <= 2e-3, f"{m=}, {n=}, {heads=}: relative error {float(err):.2e}"


def test_triton_mqa_logits_agree_with_sglangs_torch_fallback():
    import importlib.util

    if importlib.util.find_spec("sgl_kernel") is None:
        pytest.skip("needs the GPU bundle (docs/gpu_bundle.md)")
    from helpers import sglang_gpu_harness as G

    G.install()  # stand-ins before the first sglang import
    from sglang.srt.layers.attention.dsa.utils import _fp8_mqa_logits_torch

    q, k, k_scale, w, ks, ke = _case(300, 5000, 32, seed=3)
    got = fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    theirs = _fp8_mqa_logits_torch(q, (k, k_scale), w, ks, ke)
    cols = torch.arange(5000, device="cuda")[None, :]
    valid = (cols >= ks[:, None]) & (cols < ke[:, None])
    err = ((got - theirs).abs() * valid).max() / theirs.abs().max()
    assert err <= 2e-2, f"relative difference {float(err):.2e} (SGLang's scores are rounded to bf16)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
