"""A Triton fp8 MQA-logits kernel: the GPU harness's stand-in for DeepGEMM's `fp8_mqa_logits`,
whose compiled library cannot load on the GPU machine's torch (it is built against another
torch's C++ ABI).

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h, :] . k[n, :])

q fp8 e4m3 [M, H, 128], k fp8 e4m3 [N, 128], k_scale fp32 [N], weights fp32 [M, H]; the result is
fp32 [M, N] (a view of rows padded to a multiple of 4, as SGLang's torch fallback returns). Only
columns ks[m] <= n < ke[m] are defined: like DeepGEMM with `clean_logits=False`, blocks outside
every row's range are skipped and left unwritten, and the top-k that follows masks them.
SGLang's own torch fallback (`_fp8_mqa_logits_torch`) is the reference in the GPU test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mqa_logits_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N, stride_out,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=2147483647)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    if pid_n * BLOCK_N >= tl.max(ke, 0) or (pid_n + 1) * BLOCK_N <= tl.min(ks, 0):
        return  # no row of this block reads these columns
    dims = tl.arange(0, D)
    col_ok = cols < N
    k = tl.load(k_ptr + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_ptr + rows[:, None] * (H * D) + h * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rows * H + h, mask=row_ok, other=0.0)
        score = tl.dot(q, tl.trans(k))
        acc += tl.maximum(score, 0.0) * w[:, None]
    k_scale = tl.load(k_scale_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * k_scale[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def fp8_mqa_logits(q_fp8, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
    """DeepGEMM's `fp8_mqa_logits` signature; see the module docstring."""
    if clean_logits:
        raise NotImplementedError("the Triton MQA-logits stand-in implements clean_logits=False only")
    k_fp8, k_scale = kv
    m, heads, dim = q_fp8.shape
    n = k_fp8.shape[0]
    for name, t in (("q_fp8", q_fp8), ("k_fp8", k_fp8), ("weights", weights), ("ks", ks), ("ke", ke)):
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"fp8_mqa_logits: {name} must be a contiguous CUDA tensor")
    if k_fp8.reshape(n, -1).shape[1] != dim or tuple(weights.shape) != (m, heads):
        raise ValueError(
            f"fp8_mqa_logits: q {tuple(q_fp8.shape)}, k {tuple(k_fp8.shape)}, weights {tuple(weights.shape)}"
        )
    storage = torch.empty((m, (n + 3) // 4 * 4), dtype=torch.float32, device=q_fp8.device)
    if m and n:
        grid = (triton.cdiv(m, 128), triton.cdiv(n, 128))
        _mqa_logits_kernel[grid](
            q_fp8, k_fp8.reshape(n, dim), k_scale.reshape(n).float().contiguous(), weights.float().contiguous(),
            ks.int().contiguous(), ke.int().contiguous(), storage, m, n, storage.stride(0),
            H=heads, D=dim, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2,
        )  # fmt: skip
    return storage[:, :n]
