"""One GLM-5 DSA layer's per-rank work at GLM-5's shapes, each part timed alone on one GPU (~3 min, 1 x H200).

    # on the GPU machine (docs/gpu_bundle.md), or `bash scripts/gpu_run.sh layer`:
    source scripts/gpu_unpack.sh /tmp/site && python3 benchmark/bench_glm5_layer.py [--quick] [--out DIR]
    # on CPU, toy shapes and torch references (what test_bench_glm5_layer.py runs):
    TRITON_INTERPRET=1 python benchmark/bench_glm5_layer.py --device cpu --out /tmp/layer

One process, one GPU, CUDA events around each part; no collective anywhere (a CP rank's gathers
are counted elsewhere). A rank's chunk holds `new` query tokens (q) after `history` cached tokens:

- attention: FlashMLA's sparse prefill through SGLang 0.5.23's wrapper (`flash_mla_sparse_fwd`,
  legacy SM90 kernel) as `DeepseekSparseAttnBackend.forward_extend` calls it with
  `--dsa-prefill-backend flashmla_sparse`: q [q, 64, 576] bf16, top-k indices [q, 1, 2048] (all
  keys where a query sees fewer than 2048, -1 after them; `topk_length` = min(pos + 1, 2048)).
  bf16 KV: the pool's rows read in place. fp8 KV with history: SGLang's RAGGED path,
  `dequantize_k_cache_paged_dsa` of the request's history + q rows, then the same kernel; fp8 KV
  without history: the chunk's bf16 k and k_rope concatenated, then the kernel.
- indexer: the logits of q queries x (history + q) keys x 32 heads x 128 (causal) and the top-2048
  of each row. Stand-ins: DeepGEMM's `fp8_mqa_logits` does not load on the GPU machine, so
  test/helpers/mqa_logits_triton.py's Triton kernel computes them, in row blocks of <= 2 GiB of
  logits, and `torch.topk` replaces sgl_kernel's fused top-k. Index K is fp8 in both KV dtypes:
  one measurement serves both.
- gemms: the layer's dense projections of q tokens through `torch._scaled_mm` (fp8, the first
  scaling that runs and matches a reference at its shape: 1x128 x 128x128 blocks, rowwise,
  tensorwise, else bf16): fused q_a + kv_a, q_b, o_proj, the indexer's wq_b, wk (fp8) and
  weights_proj (bf16, as SGLang keeps it); w_kc / w_vc absorption as bf16 `torch.bmm`.
- moe: the router (bf16, all 256 experts' logits) and the experts of q tokens, fp8. GLM-5 has 256
  routed experts (8 active) + 1 shared; the run holds a reduced set (32) with balanced routing
  (each expert gets q x 8 / 32 rows), so the time is that of q tokens x 8 active experts + the
  shared one, which is a GLM-5 token's MoE work: `torch._scaled_grouped_mm` (rowwise fp8), else
  `torch._grouped_mm` (bf16), else one GEMM per expert.
- scratch_fill: the shared pool's send block, `torch.index_select` of `rows` latent rows (1152 B
  bf16, 656 B fp8) and their indexer pages (8448 B a 64-token page) from the shard, as SGLang's
  `PageInterleaveDSATokenToKVPool._prefetch_layer` packs it before its all-gather.
- fused_store: a chunk of `tokens` rows stored to the scratch and rank 0 of CP 8's owned rows.
  fp8: the plugin's kernel (`store_mla_fp8_owned_and_scratch_triton`); bf16: SGLang's pool path,
  timed as torch `index_copy_` of the same rows (SGLang's Triton row store moves the same bytes).

Not timed: norms, RoPE, activation quantization and elementwise glue, the indexer's K store.
A point is the median of 3 timed calls after 1 warm-up (1 call when the warm-up took > 1 s),
L2 flushed before each. Each kernel is first checked against a torch reference at a small shape.
Output: DIR/bench_glm5_layer_1xh200.json (default benchmark/results/; `--device cpu`:
bench_glm5_layer_cpu_toy.json), read by benchmark/layer_terms.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test"))
sys.path.insert(0, os.path.join(REPO, "python"))

from provenance import provenance  # noqa: E402
from tables import format_table  # noqa: E402

from sglang_nsa_cp.kernels.formats import MLA_DIM, MLA_FP8_ROW_BYTES, MLA_NOPE_DIM, MLA_ROPE_DIM  # noqa: E402

MODEL_JSON = os.path.join(REPO, "benchmark", "data", "models", "glm5_fp8.json")
RESULT_NAMES = {"cuda": "bench_glm5_layer_1xh200.json", "cpu": "bench_glm5_layer_cpu_toy.json"}
PAGE = 64
CP_FOR_STORE = 8  # the fused store persists rank 0 of CP 8's owned rows (1/8 of the chunk)
INDEX_PAGE_BYTES = PAGE * (128 + 4)  # 64 fp8 index keys + their fp32 scales: 8448 B
LOGITS_BLOCK_BYTES = 2 << 30
SLOW_CALL_S = 1.0
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
KV_DTYPES = ("bf16", "fp8")

GRIDS = {  # (query tokens per rank, history tokens, scratch-fill rows, store tokens)
    "full": ([256, 1024, 2048, 4096, 8192, 16384], [0, 8192, 32768, 131072, 524288, 1048576],
             [8192, 32768, 131072, 524288, 1048576], [256, 1024, 4096, 16384, 65536, 131072]),
    "quick": ([256, 2048, 8192], [0, 32768, 524288], [32768, 524288], [1024, 16384, 131072]),
    "cpu": ([8, 16, 32], [0, 24, 64], [64, 256, 1024], [8, 16, 32]),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The layer's sizes. `experts` is the run's routed-expert count (reduced from `model_experts`)."""

    hidden: int
    heads: int
    q_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    index_heads: int
    index_dim: int
    topk: int
    model_experts: int
    experts: int
    active: int
    shared: int
    moe_inter: int


def glm5_shapes(experts: int = 32) -> Shapes:
    """GLM-5's shapes from benchmark/data/models/glm5_fp8.json, `experts` routed experts held."""
    with open(MODEL_JSON) as f:
        c = json.load(f)
    if c["kv_lora_rank"] != MLA_NOPE_DIM or c["qk_rope_head_dim"] != MLA_ROPE_DIM:
        raise ValueError(f"{MODEL_JSON}: the kernels take {MLA_NOPE_DIM} + {MLA_ROPE_DIM} latent rows")
    return Shapes(hidden=c["hidden_size"], heads=c["num_attention_heads"], q_lora=c["q_lora_rank"],
                  qk_nope=c["qk_nope_head_dim"], qk_rope=c["qk_rope_head_dim"], v_head=c["v_head_dim"],
                  index_heads=c["index_n_heads"], index_dim=c["index_head_dim"], topk=c["index_topk"],
                  model_experts=c["n_routed_experts"], experts=experts, active=c["num_experts_per_tok"],
                  shared=c["n_shared_experts"], moe_inter=c["moe_intermediate_size"])  # fmt: skip


TOY = Shapes(hidden=256, heads=4, q_lora=128, qk_nope=64, qk_rope=64, v_head=64, index_heads=4, index_dim=64,
             topk=16, model_experts=8, experts=4, active=2, shared=1, moe_inter=128)  # fmt: skip


# ---- timing ---------------------------------------------------------------------------------------


class Timer:
    """Median time of `reps` calls after one warm-up (one call when a call takes > 1 s).
    CUDA: events, L2 flushed (read) before each call; CPU: wall time."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.flush = torch.ones(64 << 20, dtype=torch.int64, device=device) if device.type == "cuda" else None

    def _once(self, fn: Callable[[], object]) -> float:
        if self.flush is None:
            t0 = time.perf_counter()
            fn()
            return 1000.0 * (time.perf_counter() - t0)
        self.flush.amax()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def time(self, fn: Callable[[], object]) -> dict:
        warm = self._once(fn)
        runs = []
        if warm > 1000.0 * SLOW_CALL_S:  # a first call may compile (Triton): slow only if the second is too
            runs.append(self._once(fn))
        reps = 1 if runs and runs[0] > 1000.0 * SLOW_CALL_S else self.reps
        runs += [self._once(fn) for _ in range(reps - len(runs))]
        return {"ms": statistics.median(runs), "ms_reps": runs, "reps": reps, "warmup_ms": warm}


# ---- fp8 helpers ----------------------------------------------------------------------------------


def quant_blocks(x: torch.Tensor, bm: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scales [ceil(M/bm), ceil(K/bk)]): x ~ codes x scale per
    bm x bk block (bm = M or bk = K: one scale per row or column, or per tensor)."""
    m, k = x.shape
    pm, pk = -m % bm, -k % bk
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm))
    blocks = xp.view((m + pm) // bm, bm, (k + pk) // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).to(FP8).view(m + pm, k + pk)[:m, :k]
    return codes.contiguous(), scale


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


# ---- dense GEMMs ----------------------------------------------------------------------------------


def _scaled_mm_modes(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """For x [M, K] bf16 and w [N, K] bf16: each fp8 scaling's call of torch._scaled_mm on the
    quantized operands (mode -> a call), and "bf16". b is w's transpose, column-major, as
    _scaled_mm wants; 1x128 activation scales are laid out outer-dim-major."""
    modes = {}
    xa, sa = quant_blocks(x, 1, 128)
    wb, sb = quant_blocks(w, 128, 128)
    sa_t = sa.t().contiguous().t()
    modes["block 1x128 x 128x128"] = lambda: torch._scaled_mm(xa, wb.t(), sa_t, sb.t(), out_dtype=torch.bfloat16)
    xr, sr = quant_blocks(x, 1, x.shape[1])
    wr, swr = quant_blocks(w, 1, w.shape[1])
    modes["rowwise"] = lambda: torch._scaled_mm(xr, wr.t(), sr, swr.t().contiguous(), out_dtype=torch.bfloat16)
    xt, st = quant_blocks(x, x.shape[0], x.shape[1])
    wt, swt = quant_blocks(w, w.shape[0], w.shape[1])
    modes["tensorwise"] = lambda: torch._scaled_mm(xt, wt.t(), st.view(()), swt.view(()), out_dtype=torch.bfloat16)
    modes["bf16"] = lambda: x @ w.t()
    return modes


def pick_gemm(m: int, k: int, n: int, device: torch.device, errors: list[str]) -> str:
    """The first scaling that runs at this shape (M = 128 rows) and is within 8 % of the bf16
    product; what failed goes to `errors`."""
    x = torch.randn(min(m, 128), k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16)
    want = x.float() @ w.float().t()
    for mode, call in _scaled_mm_modes(x, w).items():
        try:
            err = _rel_err(call(), want)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            errors.append(f"{k}x{n} {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        if err < 0.08:
            return mode
        errors.append(f"{k}x{n} {mode}: relative error {err:.3f} against bf16 (layout not as assumed)")
    raise AssertionError("bf16 matmul must always pass")


def dense_gemms(s: Shapes) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, fp8 in SGLang) of the layer's dense projections, one token's row each."""
    return [
        ("q_a + kv_a (fused_qkv_a_proj_with_mqa)", s.hidden, s.q_lora + MLA_DIM, True),
        ("q_b", s.q_lora, s.heads * (s.qk_nope + s.qk_rope), True),
        ("o_proj", s.heads * s.v_head, s.hidden, True),
        ("indexer wq_b", s.q_lora, s.index_heads * s.index_dim, True),
        ("indexer wk", s.hidden, s.index_dim, True),
        ("indexer weights_proj (bf16)", s.hidden, s.index_heads, False),
    ]


def gemm_call(q: int, k: int, n: int, mode: str, device: torch.device) -> Callable[[], torch.Tensor]:
    x = torch.randn(q, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16)
    return _scaled_mm_modes(x, w)[mode]


def gemms_case(q: int, s: Shapes, modes: dict[str, str], device: torch.device) -> Callable[[], None]:
    calls = [gemm_call(q, k, n, modes[name], device) for name, k, n, _ in dense_gemms(s)]
    bf = torch.bfloat16
    q_nope = torch.randn(s.heads, q, s.qk_nope, device=device, dtype=bf)
    w_kc = torch.randn(s.heads, s.qk_nope, MLA_NOPE_DIM, device=device, dtype=bf) * 0.05
    attn_out = torch.randn(s.heads, q, MLA_NOPE_DIM, device=device, dtype=bf)
    w_vc = torch.randn(s.heads, MLA_NOPE_DIM, s.v_head, device=device, dtype=bf) * 0.05

    def run():
        for call in calls:
            call()
        torch.bmm(q_nope, w_kc)
        torch.bmm(attn_out, w_vc)

    return run


# ---- MoE ------------------------------------------------------------------------------------------


def _grouped_modes(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """x [R, K] bf16 rows grouped by expert (offs: int32 cumulative ends), w [E, N, K] bf16."""
    e, n, k = w.shape
    xr, sx = quant_blocks(x, 1, k)
    wq = torch.empty(e, n, k, dtype=FP8, device=w.device)
    sw = torch.empty(e, n, device=w.device)
    for i in range(e):
        codes, scale = quant_blocks(w[i], 1, k)
        wq[i], sw[i] = codes, scale[:, 0]
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return {
        "fp8 rowwise torch._scaled_grouped_mm": lambda: torch._scaled_grouped_mm(
            xr, wq.transpose(-2, -1), sx[:, 0].contiguous(), sw, offs=offs, out_dtype=torch.bfloat16
        ),
        "bf16 torch._grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "bf16, one GEMM per expert": lambda: torch.cat([x[a:b] @ w[i].t() for i, (a, b) in enumerate(zip(starts, ends))]),
    }  # fmt: skip


def routed_offsets(q: int, s: Shapes, device: torch.device) -> torch.Tensor:
    """Balanced routing: q x active rows dealt equally to the experts (multiples of 16 rows)."""
    per = -(-q * s.active // s.experts)
    per += -per % 16
    return torch.arange(1, s.experts + 1, device=device, dtype=torch.int32) * per


def pick_grouped(s: Shapes, device: torch.device, errors: list[str]) -> str:
    offs = routed_offsets(64, s, device)
    x = torch.randn(int(offs[-1]), s.hidden, device=device, dtype=torch.bfloat16)
    w = (torch.randn(s.experts, 2 * s.moe_inter, s.hidden, device=device) * s.hidden**-0.5).to(torch.bfloat16)
    ends = offs.tolist()
    want = torch.cat([x[a:b].float() @ w[i].float().t() for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    for mode, call in _grouped_modes(x, w, offs).items():
        try:
            err = _rel_err(call(), want)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
            errors.append(f"grouped {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        if err < 0.08:
            return mode
        errors.append(f"grouped {mode}: relative error {err:.3f}")
    raise AssertionError("the per-expert loop must always pass")


def moe_case(q: int, s: Shapes, grouped: str, dense_mode: str, device: torch.device) -> Callable[[], None]:
    offs = routed_offsets(q, s, device)
    rows, bf = int(offs[-1]), torch.bfloat16
    gate_up = _grouped_modes(
        torch.randn(rows, s.hidden, device=device, dtype=bf),
        (torch.randn(s.experts, 2 * s.moe_inter, s.hidden, device=device) * 0.02).to(bf), offs)[grouped]  # fmt: skip
    down = _grouped_modes(
        torch.randn(rows, s.moe_inter, device=device, dtype=bf),
        (torch.randn(s.experts, s.hidden, s.moe_inter, device=device) * 0.02).to(bf), offs)[grouped]  # fmt: skip
    shared = [gemm_call(q, s.hidden, 2 * s.moe_inter * s.shared, dense_mode, device),
              gemm_call(q, s.moe_inter * s.shared, s.hidden, dense_mode, device)]  # fmt: skip
    x = torch.randn(q, s.hidden, device=device, dtype=bf)
    router = torch.randn(s.model_experts, s.hidden, device=device, dtype=bf)

    def run():
        x @ router.t()
        gate_up()
        down()
        for call in shared:
            call()

    return run


# ---- attention ------------------------------------------------------------------------------------


def topk_indices(q: int, history: int, topk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([q, 1, topk] int32, topk_length [q] int32) for queries at positions history .. history + q - 1:
    every key 0..pos where pos + 1 <= topk (-1 after), else topk random keys in [0, pos]."""
    pos = history + torch.arange(q, device=device)
    j = torch.arange(topk, device=device)
    dense = torch.where(j[None, :] <= pos[:, None], j[None, :], -1)
    sampled = (torch.rand(q, topk, device=device) * (pos[:, None] + 1)).long().clamp(max=pos[:, None])
    idx = torch.where((pos[:, None] + 1) <= topk, dense, sampled).to(torch.int32)
    return idx.unsqueeze(1).contiguous(), (pos + 1).clamp(max=topk).to(torch.int32)


def fp8_rows(n: int, device: torch.device) -> torch.Tensor:
    """n FlashMLA fp8 rows [n, 1, 656] (viewed as float8_e4m3fn, as SGLang's pool hands them over)."""
    codes = (torch.randn(n, MLA_NOPE_DIM, device=device) * 64).to(FP8).view(torch.uint8)
    scales = torch.full((n, MLA_NOPE_DIM // 128), 1 / 256, device=device).view(torch.uint8)
    rope = torch.randn(n, MLA_ROPE_DIM, device=device, dtype=torch.bfloat16).view(torch.uint8)
    return torch.cat([codes, scales, rope], dim=1).view(FP8).unsqueeze(1)


class Kernels:
    """The kernels a run calls: CUDA, SGLang's and FlashMLA's; CPU, the torch references (marked)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            from bench_kernels import install_gpu_stand_ins

            install_gpu_stand_ins()
            from helpers.mqa_logits_triton import fp8_mqa_logits
            from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache_paged_dsa
            from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

            self.sparse_fwd, self.dequant, self.mqa_logits = (
                flash_mla_sparse_fwd,
                dequantize_k_cache_paged_dsa,
                fp8_mqa_logits,
            )
            self.names = {"attention": "FlashMLA flash_mla_sparse_fwd (sgl-flash-mla, legacy SM90) via SGLang 0.5.23's wrapper",
                          "dequant": "SGLang's dequantize_k_cache_paged_dsa (Triton)",
                          "indexer_logits": "test/helpers/mqa_logits_triton.py (stand-in for DeepGEMM's fp8_mqa_logits)",
                          "indexer_topk": "torch.topk (stand-in for sgl_kernel's fused top-k)",
                          "fused_store_fp8": "store_mla_fp8_owned_and_scratch_triton (the plugin's kernel)"}  # fmt: skip
        else:
            from helpers.sglang_cpu_stand_ins import dequantize_k_cache_paged_torch, sparse_mla_reference

            self.sparse_fwd, self.dequant, self.mqa_logits = (
                sparse_mla_reference,
                dequantize_k_cache_paged_torch,
                mqa_logits_torch,
            )
            self.names = {"attention": "torch reference (test/helpers/sglang_cpu_stand_ins.py), CPU toy",
                          "dequant": "torch reference of SGLang's dequantize_k_cache_paged_dsa, CPU toy",
                          "indexer_logits": "torch reference of fp8_mqa_logits, CPU toy",
                          "indexer_topk": "torch.topk",
                          "fused_store_fp8": "store_mla_fp8_owned_and_scratch_triton under TRITON_INTERPRET=1, CPU toy"}  # fmt: skip
        self.names["fused_store_bf16"] = "torch index_copy_ (SGLang's bf16 pool path: scratch rows + owned rows)"


def mqa_logits_torch(q_fp8, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
    """logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n]) (fp32, every column)."""
    k_fp8, k_scale = kv
    score = torch.einsum("mhd,nd->mhn", q_fp8.float(), k_fp8.float()).clamp(min=0)
    return (score * weights[:, :, None]).sum(1) * k_scale.reshape(1, -1)


def attention_case(kv: str, q: int, history: int, s: Shapes, kernels: Kernels) -> Callable[[], object]:
    device, bf = kernels.device, torch.bfloat16
    rows = history + q
    d_qk = MLA_DIM
    qt = torch.randn(q, s.heads, d_qk, device=device, dtype=bf)
    idx, topk_length = topk_indices(q, history, s.topk, device)
    scale = (s.qk_nope + s.qk_rope) ** -0.5

    def sparse(kv_bf16):
        return kernels.sparse_fwd(qt, kv_bf16, idx, scale, MLA_NOPE_DIM, topk_length=topk_length)

    if kv == "bf16":
        pool = torch.randn(rows, 1, d_qk, device=device, dtype=bf)
        return lambda: sparse(pool)
    if history == 0:  # SGLang: no prefix -> the chunk's fresh bf16 k and k_rope, concatenated
        k = torch.randn(q, 1, MLA_NOPE_DIM, device=device, dtype=bf)
        k_rope = torch.randn(q, 1, MLA_ROPE_DIM, device=device, dtype=bf)
        return lambda: sparse(torch.cat([k, k_rope], dim=-1))
    pool = fp8_rows(rows, device)
    flat = torch.arange(rows, device=device, dtype=torch.int32)  # the request's slots, prefix then chunk
    return lambda: sparse(kernels.dequant(pool, flat))


def check_attention(s: Shapes, kernels: Kernels) -> dict:
    """The kernels a run times against the torch references, at a small shape (CUDA only)."""
    if kernels.device.type != "cuda":
        return {"skipped": "CPU: the torch references are what runs"}
    from helpers.sglang_cpu_stand_ins import dequantize_k_cache_paged_torch, sparse_mla_reference

    return {"attention": _check_sparse(s, kernels, sparse_mla_reference, dequantize_k_cache_paged_torch),
            "indexer_logits": _check_logits(s, kernels, mqa_logits_torch)}  # fmt: skip


def _check_sparse(s: Shapes, kernels: Kernels, reference, dequant_ref) -> float:
    device, q, history = kernels.device, 128, 3000
    qt = torch.randn(q, s.heads, MLA_DIM, device=device, dtype=torch.bfloat16)
    idx, length = topk_indices(q, history, s.topk, device)
    pool = fp8_rows(history + q, device)
    flat = torch.arange(history + q, device=device, dtype=torch.int32)
    kv = kernels.dequant(pool, flat)
    deq_err = _rel_err(kv, dequant_ref(pool, flat))
    scale = (s.qk_nope + s.qk_rope) ** -0.5
    got = kernels.sparse_fwd(qt, kv, idx, scale, MLA_NOPE_DIM, topk_length=length)[0]
    want = reference(qt.cpu(), kv.cpu(), idx.cpu(), scale, MLA_NOPE_DIM, topk_length=length.cpu())[0]
    return max(deq_err, _rel_err(got.cpu(), want))


def _check_logits(s: Shapes, kernels: Kernels, reference) -> float:
    device, q, history = kernels.device, 256, 1000
    n = history + q
    qf = torch.randn(q, s.index_heads, s.index_dim, device=device).to(FP8)
    kf = torch.randn(n, s.index_dim, device=device).to(FP8)
    k_scale, weights = torch.rand(n, device=device), torch.randn(q, s.index_heads, device=device)
    ks = torch.zeros(q, dtype=torch.int32, device=device)
    ke = (history + torch.arange(q, device=device) + 1).to(torch.int32)
    got = kernels.mqa_logits(qf, (kf, k_scale), weights, ks, ke)
    want = reference(qf, (kf, k_scale), weights, ks, ke)
    valid = torch.arange(n, device=device)[None, :] < ke[:, None]
    return _rel_err(got[valid], want[valid])


# ---- indexer --------------------------------------------------------------------------------------


def indexer_case(q: int, history: int, s: Shapes, kernels: Kernels) -> tuple[Callable[[], None], int]:
    """(the logits and top-k of q queries over history + q keys in row blocks, rows per block)."""
    device, n = kernels.device, history + q
    qf = torch.randn(q, s.index_heads, s.index_dim, device=device).to(FP8)
    kf = torch.randn(n, s.index_dim, device=device).to(FP8)
    k_scale = torch.rand(n, device=device)
    weights = torch.randn(q, s.index_heads, device=device)
    ks = torch.zeros(q, dtype=torch.int32, device=device)
    ke = (history + torch.arange(q, device=device) + 1).to(torch.int32)
    block = max(1, LOGITS_BLOCK_BYTES // (4 * ((n + 3) // 4 * 4)))  # the logits' rows are padded to 4 columns
    block = min(q, block - block % 128 if block >= 128 else block)

    def run():
        for m0 in range(0, q, block):
            m1 = min(q, m0 + block)
            cols = history + m1
            logits = kernels.mqa_logits(qf[m0:m1], (kf[:cols], k_scale[:cols]), weights[m0:m1], ks[m0:m1], ke[m0:m1])
            torch.topk(logits, min(s.topk, cols), dim=1)

    return run, block


# ---- scratch fill and fused store -----------------------------------------------------------------


def fill_case(kv: str, rows: int, device: torch.device) -> Callable[[], None]:
    """rows latent rows and their index pages, from a shard twice that size, into a send block."""
    pages = -(-rows // PAGE)
    own = torch.sort(torch.randperm(2 * pages, device=device)[:pages]).values
    send_rows = (own[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)
    if kv == "bf16":
        shard = torch.randn(2 * pages * PAGE, 1, MLA_DIM, device=device, dtype=torch.bfloat16)
    else:
        shard = torch.randint(0, 255, (2 * pages * PAGE, 1, MLA_FP8_ROW_BYTES), device=device, dtype=torch.uint8)
    send = torch.empty((pages * PAGE, *shard.shape[1:]), dtype=shard.dtype, device=device)
    index_shard = torch.randint(0, 255, (2 * pages, INDEX_PAGE_BYTES), device=device, dtype=torch.uint8)
    index_send = torch.empty(pages, INDEX_PAGE_BYTES, device=device, dtype=torch.uint8)

    def run():
        torch.index_select(shard, 0, send_rows, out=send)
        torch.index_select(index_shard, 0, own, out=index_send)

    return run


def store_case(kv: str, tokens: int, device: torch.device) -> Callable[[], None]:
    """A chunk of `tokens` rows (pages in random order) into the scratch and rank 0's shard (CP 8)."""
    n = CP_FOR_STORE
    pages = -(-tokens // PAGE)
    order = torch.randperm(pages, device=device) + n
    slots = (order[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)[:tokens].contiguous()
    scratch_rows = torch.arange(PAGE, PAGE + tokens, device=device)
    latent = torch.randn(tokens, 1, MLA_DIM, device=device).to(torch.bfloat16)
    k_nope, k_rope = latent[..., :MLA_NOPE_DIM].contiguous(), latent[..., MLA_NOPE_DIM:]
    shard_rows = ((pages + n) // n + 1) * PAGE
    if kv == "fp8":
        from sglang_nsa_cp.kernels.mla_fp8_owned_and_scratch import store_mla_fp8_owned_and_scratch_triton as store

        scratch = torch.zeros(PAGE + tokens, MLA_FP8_ROW_BYTES, device=device, dtype=torch.uint8)
        shard = torch.zeros(shard_rows, MLA_FP8_ROW_BYTES, device=device, dtype=torch.uint8)
        return lambda: store(scratch, scratch_rows, shard, slots, k_nope, k_rope, 0, n, PAGE)
    scratch = torch.zeros(PAGE + tokens, MLA_DIM, device=device, dtype=torch.bfloat16)
    shard = torch.zeros(shard_rows, MLA_DIM, device=device, dtype=torch.bfloat16)
    page = slots // PAGE
    owned = torch.nonzero(page % n == 0).reshape(-1)  # SGLang's write plan, once per batch
    local = (page[owned] // n) * PAGE + slots[owned] % PAGE
    rows2d = latent.view(tokens, MLA_DIM)

    def run():
        scratch.index_copy_(0, scratch_rows, rows2d)
        shard.index_copy_(0, local, rows2d.index_select(0, owned))

    return run


# ---- the run --------------------------------------------------------------------------------------


def points_plan(grid: str) -> list[dict]:
    qs, hs, fill_rows, store_tokens = GRIDS[grid]
    plan = [{"part": p, "kv": None, "new": q} for p in ("gemms", "moe") for q in qs]
    plan += [{"part": "indexer", "kv": None, "new": q, "history": h} for q in qs for h in hs]
    plan += [{"part": "attention", "kv": kv, "new": q, "history": h} for kv in KV_DTYPES for q in qs for h in hs]
    plan += [{"part": "scratch_fill", "kv": kv, "rows": r} for kv in KV_DTYPES for r in fill_rows]
    plan += [{"part": "fused_store", "kv": kv, "tokens": t} for kv in KV_DTYPES for t in store_tokens]
    return plan


def run_point(point: dict, s: Shapes, kernels: Kernels, modes: dict, timer: Timer) -> dict:
    device, part = kernels.device, point["part"]
    extra = {}
    if part == "gemms":
        fn = gemms_case(point["new"], s, modes["gemms"], device)
    elif part == "moe":
        fn = moe_case(point["new"], s, modes["moe"], modes["moe_dense"], device)
    elif part == "indexer":
        fn, block = indexer_case(point["new"], point["history"], s, kernels)
        extra["logits_block_rows"] = block
    elif part == "attention":
        fn = attention_case(point["kv"], point["new"], point["history"], s, kernels)
    elif part == "scratch_fill":
        fn = fill_case(point["kv"], point["rows"], device)
    else:
        fn = store_case(point["kv"], point["tokens"], device)
    result = {**point, **timer.time(fn), **extra}
    del fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def pick_modes(s: Shapes, device: torch.device) -> tuple[dict, list[str]]:
    errors: list[str] = []
    gemms = {name: pick_gemm(128, k, n, device, errors) if fp8 else "bf16" for name, k, n, fp8 in dense_gemms(s)}
    dense = pick_gemm(128, s.hidden, 2 * s.moe_inter, device, errors)
    return {"gemms": gemms, "moe": pick_grouped(s, device, errors), "moe_dense": dense}, errors


def print_table(points: list[dict]) -> None:
    head = ["part", "kv", "new", "history", "rows/tokens", "ms", "reps"]
    body = [[p["part"], p["kv"] or "-", p.get("new", "-"), p.get("history", "-"), p.get("rows", p.get("tokens", "-")),
             f"{p['ms']:.3f}", p["reps"]] for p in points]  # fmt: skip
    print(format_table([head, *body], align="llrrrrr", header_rule=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: toy shapes, torch references")
    parser.add_argument("--quick", action="store_true", help="a small grid (3 x 3)")
    parser.add_argument("--experts", type=int, default=32, help="routed experts held (GLM-5 has 256; 8 active)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per point after one warm-up")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmark", "results"))
    args = parser.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_glm5_layer.py times CUDA kernels: run it on a GPU, or --device cpu for the toy run")
        if interpret:
            sys.exit("unset TRITON_INTERPRET: the benchmark times compiled kernels")
    elif not interpret:
        sys.exit("--device cpu runs the fused store under Triton's interpreter: set TRITON_INTERPRET=1")
    device = torch.device(args.device)
    s = glm5_shapes(args.experts) if args.device == "cuda" else TOY
    grid = "cpu" if args.device == "cpu" else "quick" if args.quick else "full"
    torch.manual_seed(0)
    t0 = time.monotonic()
    kernels = Kernels(device)
    checks = check_attention(s, kernels)
    modes, mode_errors = pick_modes(s, device)
    print(json.dumps({"checks": checks, "modes": modes, "mode_errors": mode_errors}, indent=1), flush=True)
    timer = Timer(device, args.reps)
    points = []
    for i, point in enumerate(points_plan(grid)):
        points.append(run_point(point, s, kernels, modes, timer))
        print(f"[{i + 1}] {json.dumps({k: v for k, v in points[-1].items() if k != 'ms_reps'})}", flush=True)
    print_table(points)
    stand_ins = [kernels.names["indexer_logits"], kernels.names["indexer_topk"], kernels.names["fused_store_bf16"],
                 f"MoE: {s.experts} of {s.model_experts} routed experts held, balanced routing; per-token cost is "
                 f"{s.active} active + {s.shared} shared expert(s)"]  # fmt: skip
    if args.device == "cpu":
        stand_ins += [kernels.names["attention"], kernels.names["dequant"], "CPU toy shapes, wall-clock times"]
    model = {"name": "GLM-5 (benchmark/data/models/glm5_fp8.json)" if args.device == "cuda" else "toy",
             "shapes": dataclasses.asdict(s), "kv_row_bytes": {"bf16": 2 * MLA_DIM, "fp8": MLA_FP8_ROW_BYTES},
             "index_page_bytes": INDEX_PAGE_BYTES, "page_size": PAGE, "store_cp": CP_FOR_STORE}  # fmt: skip
    out = {
        "provenance": provenance(model, stand_ins),
        "grid": dict(zip(("new", "history", "fill_rows", "store_tokens"), GRIDS[grid]), name=grid),
        "kernels": kernels.names,
        "checks_rel_err": checks,
        "modes": modes,
        "mode_errors": mode_errors,
        "timing": {
            "warmup": 1,
            "reps": args.reps,
            "reps_when_slow": 1,
            "slow_call_s": SLOW_CALL_S,
            "clock": "CUDA events, L2 flushed" if args.device == "cuda" else "perf_counter",
        },  # fmt: skip
        "points": points,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, RESULT_NAMES[args.device])
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path} ({out['wall_s']} s)")
    bad = [k for k, v in checks.items() if isinstance(v, float) and not v < 0.05]
    if bad:
        print(f"FAILED checks against the torch references: {bad} ({checks})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
