"""CPU (four spawns of 2 gloo ranks): `--dsa-prefill-backend flashmla_sparse_q8`, SGLang
0.5.23's SM90 fp8 prefill (q and KV cast to e4m3 per call), through SGLang's own DSA forward over
its page-interleaved pool with the plugin's subclass (the tiny DeepSeek-V3.2 of
sglang_model_harness.py, the batches of test_page_interleave_pool.py: new requests, a second
chunk over cached pages, a radix hit; the gather scratch NaN as each batch begins).

q8's prefix batches read the pool through `get_key_buffer` (the sharded pool's scratch) at
`page_table_1_flattened` (rows the pool translated to scratch rows), gathered and cast to e4m3 by
`gather_cast_kv_fp8_pad_paged` (bf16 pool) or `gather_dequant_requant_fp8_paged_dsa` (fp8 pool);
batches without history cast the chunk's own k. On CPU the JIT attention kernel is
`sglang_cpu_stand_ins.sparse_mla_q8kv8_reference` and the prep kernels are torch twins, checked
here bit for bit against SGLang's Triton kernels (the interpreter). Shared KV must equal
replicated CP under the same backend bit for bit, bf16 and fp8 KV; the GPU check is
test_sglang_q8_gpu_forward.py.

The replicated-CP baseline runs come from helpers/baseline_cache.py: reused from an earlier
run while everything they depend on is unchanged (docs/testing.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_cpu_stand_ins as S  # noqa: E402
from helpers import sglang_model_harness as H  # noqa: E402
from helpers.baseline_cache import cached_run_ranks  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=25, suite="nsa-cp-test-cpu")

Q8 = "flashmla_sparse_q8"
PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool"
# (run name, mode, ranks, --kv-cache-dtype, --dsa-prefill-backend)
RUNS = (
    ("replicated", "replicated", 2, "bfloat16", Q8),
    ("sharded", "sharded", 2, "bfloat16", Q8),
    ("fp8-replicated", "replicated", 2, "fp8_e4m3", Q8),
    ("fp8-sharded", "sharded", 2, "fp8_e4m3", Q8),
)
STEPS = [f"prefill batch {b}" for b in range(len(H.ROTATED_BATCHES))] + ["decode step"]


# ---- the torch twins of q8's prep kernels, against SGLang's Triton kernels -------------------------


def _exact(*shape, seed):
    """bf16 values e4m3 holds exactly (halves in [-8, 8]): the interpreter's fp8 cast rounds
    wrongly (it gave -16 for -31.125 and 22 for 21; CUDA's cvt.rn gives -32 and 20), so here the
    twins are checked on which rows and bytes move; test_sglang_q8_gpu_forward.py checks the
    rounding against the compiled kernels."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g) / 2).to(torch.bfloat16)


def _fp8_pool(rows: int, seed: int) -> torch.Tensor:
    """[rows, 1, 656] FlashMLA rows: e4m3 codes (halves), power-of-two scales (so code x scale is
    exact in e4m3), bf16 rope."""
    g = torch.Generator().manual_seed(seed)
    codes = _exact(rows, 512, seed=seed).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = (2.0 ** torch.randint(-2, 3, (rows, 4), generator=g).float()).view(torch.uint8)
    rope = _exact(rows, 64, seed=seed + 1).view(torch.uint8)
    return torch.cat([codes, scale, rope], dim=1).view(torch.float8_e4m3fn).unsqueeze(1)


def _dirty(*shape):
    return torch.full(shape, 0.5).to(torch.float8_e4m3fn)


LOC = torch.tensor([7, 0, 19, 7, 3], dtype=torch.int32)  # a repeat and the first and last rows


def test_q_cast_twin_moves_the_bytes_sglangs_kernel_does():
    from sglang.kernels.ops.attention.mla_qk_prep import concat_and_cast_q_fp8_pad

    q_nope, q_rope = _exact(3, 2, 512, seed=1), _exact(3, 2, 64, seed=2)
    got, want = _dirty(3, 64, 576), _dirty(3, 64, 576)  # the pad heads must stay as they are
    S.concat_and_cast_q_fp8_pad_torch(got, q_nope, q_rope, 2)
    concat_and_cast_q_fp8_pad(want, q_nope, q_rope, 2)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "q cast differs from SGLang's kernel"


def test_bf16_prefix_gather_twin_moves_the_bytes_sglangs_kernel_does():
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import gather_cast_kv_fp8_pad_paged

    kv = _exact(20, 1, 576, seed=3)
    got, want = _dirty(5 + 128, 576), _dirty(5 + 128, 576)  # a dirty landing pad
    S.gather_cast_kv_fp8_pad_paged_torch(got, kv, LOC, 512)
    gather_cast_kv_fp8_pad_paged(want, kv, LOC, 512)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "bf16 prefix gather differs"
    assert not want[5:].view(torch.uint8).any(), "the landing pad is not zero"


def test_fp8_prefix_gather_twin_moves_the_bytes_sglangs_kernel_does():
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import gather_dequant_requant_fp8_paged_dsa

    pool = _fp8_pool(20, seed=4)
    got, want = _dirty(5 + 128, 1, 576), _dirty(5 + 128, 1, 576)
    S.gather_dequant_requant_fp8_paged_dsa_torch(pool, LOC, extra_rows=128, out=got)
    gather_dequant_requant_fp8_paged_dsa(pool, LOC, extra_rows=128, out=want)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "fp8 prefix gather differs"
    assert want[:5].view(torch.uint8).any() and not want[5:].view(torch.uint8).any()


def test_q8_kernel_stand_in_masks_unused_entries():
    """-1 entries read nothing: the same output whatever the rows they would name hold."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(4, 64, 576, generator=g) * 0.1).to(torch.float8_e4m3fn)
    kv = torch.randn(10 + 128, 1, 576, generator=g).to(torch.float8_e4m3fn)
    idx = torch.full((4, 1, 128), -1, dtype=torch.int32)
    idx[:, 0, :3] = torch.tensor([0, 4, 9], dtype=torch.int32)
    scale = torch.ones(1)
    o, _, lse = S.sparse_mla_q8kv8_reference(q, kv, idx, 0.04, scale, scale)
    kv[10:] = torch.full((128, 1, 576), 3.0).to(torch.float8_e4m3fn)  # the landing pad, dirtied
    o2, _, lse2 = S.sparse_mla_q8kv8_reference(q, kv, idx, 0.04, scale, scale)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert o.shape == (4, 64, 512) and o.dtype == torch.bfloat16 and torch.isfinite(lse).all()


# ---- SGLang's forward: shared KV against replicated CP under q8 ------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = H.write_checkpoint(str(tmp_path_factory.mktemp("tiny_v32")), H.TINY_V32)
    # the replicated baselines come from helpers/baseline_cache.py while their inputs stand
    return {
        name: (run_ranks if mode == "sharded" else cached_run_ranks)(
            H.run_rotated_scenario, world, args=(path, mode, kv, True, backend), timeout_s=900
        )
        for name, mode, world, kv, backend in RUNS
    }


@pytest.mark.parametrize("sharded, replicated", [("sharded", "replicated"), ("fp8-sharded", "fp8-replicated")])
def test_shared_kv_equals_replicated_cp_under_q8_bit_for_bit(runs, sharded, replicated):
    layers, batches = H.TINY_V32["num_hidden_layers"], len(H.ROTATED_BATCHES)
    for rank, (r, rep) in enumerate(zip(runs[sharded], runs[replicated], strict=True)):
        assert r["pool_module"] == PLUGIN_POOL, f"{sharded}, {rank=}: {r['pool_module']}.{r['pool']}"
        assert [t["history"] for t in r["trace"][:3]] == [False, True, True], f"{sharded}, {rank=}"
        for run in (r, rep):  # every prefill layer call ran q8's kernel, none FlashMLA's bf16 one
            assert run["prefill_kernel_calls"] == {"flashmla_sparse": 0, Q8: layers * batches}, (
                f"{rank=}: {run['prefill_kernel_calls']}"
            )
        for step, got, want in zip(STEPS, r["logits"], rep["logits"], strict=True):
            assert torch.isfinite(got).all(), f"{sharded}, {rank=}, {step}: non-finite logits"
            assert torch.equal(got, want), f"{sharded}, {rank=}, {step}: max |diff| {(got - want).abs().max().item()}"
        for layer, (got, want) in enumerate(zip(r["decode_pool_latent"], rep["decode_pool_latent"], strict=True)):
            assert torch.equal(got, want), f"{sharded}, {rank=}, {layer=}: decode pool bytes differ from replicated"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
