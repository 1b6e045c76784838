"""CPU (real servers, ~11 processes on 2 cores): an fp8 KV cache (`--kv-cache-dtype
fp8_e4m3`, SGLang's FlashMLA rows of 656 bytes) with `--enable-nsa-prefill-cp-shared-kv` on a PD
prefill, under SGLang's own scheduler, over HTTP.

Servers (test/helpers/sglang_servers.py, the tiny DeepSeek-V3.2 checkpoint, CPU stand-ins from the
test-only plugin, docs/sglang_cpu_server.md), all with `--kv-cache-dtype fp8_e4m3`:
- fp8_shared:     PD prefill, CP=2 interleave, the flag, `--dsa-prefill-backend flashmla_sparse`;
- fp8_replicated: the same without the flag (replicated CP, every rank a full copy): the oracle;
- fp8_decode:     PD decode, CP off, for both, one request at a time (SGLang's CPU decode is not
  batch-invariant); `--dsa-decode-backend flashmla_sparse`, whose FlashMLA stand-in dequantizes the
  fp8 rows (SGLang's fp8 default, `flashmla_kv`, is a CUDA kernel with no CPU path).
Each request goes through both PDs; the greedy tokens must be equal: a prompt of 3 prefill chunks
(later chunks read their fp8 history from the shared pool), then two prompts sharing a 2-page prefix
(the second is a radix hit on both prefills).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures as futures  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_servers as S  # noqa: E402

register_cpu_ci(est_time=80, suite="nsa-cp-test-cpu")

NEW_TOKENS = 6
PREFILLS = ("fp8_shared", "fp8_replicated")
# SGLang's allocation log of each rank's pool (mem_cache/memory_pool.py `_finalize_allocation_log`)
POOL_LOG = r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), KV size: ([\d.]+) GB"
# KV bytes per stored token and layer of SGLang's fp8 DSA pool: FlashMLA's latent row (512 e4m3
# values, 4 fp32 scales, 64 bf16 rope values = 656) + the indexer's K (128 fp8 values, 1 fp32
# scale). A bf16 pool would take 1152 + 132.
FP8_TOKEN_BYTES = 512 + 4 * 4 + 64 * 2 + S.MODEL["index_head_dim"] + 4
GB = 1 << 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = S.Cluster(tmp_path_factory.mktemp("sglang_fp8_cpu"), roles=(*PREFILLS, "fp8_decode"), router=False)
    with cluster.running():
        yield cluster


def _both_pds(cluster, ids):
    """The same greedy request through the shared-KV PD and the replicated PD, concurrently.
    Returns {prefill name: (prefill meta_info, output ids)}."""
    decode = cluster.servers["fp8_decode"]
    with futures.ThreadPoolExecutor(len(PREFILLS)) as pool:
        pending = {
            name: pool.submit(S.generate_pd, cluster.servers[name], decode, ids, NEW_TOKENS) for name in PREFILLS
        }
        answers = {name: f.result() for name, f in pending.items()}
    for name, (pre, dec) in answers.items():
        assert isinstance(pre, dict) and isinstance(dec, dict), f"{name}: {pre!r} {dec!r}\n{cluster.log_tails()}"
    return {name: (pre["meta_info"], dec["output_ids"]) for name, (pre, dec) in answers.items()}


def _summary(results):
    return {name: (out, meta["cached_tokens"]) for name, (meta, out) in results.items()}


def _assert_same(where, results):
    shared, replicated = results["fp8_shared"][1], results["fp8_replicated"][1]
    assert len(shared) == NEW_TOKENS, (where, shared)
    assert shared == replicated, f"{where}: shared-KV fp8 PD {shared} != replicated fp8 PD {replicated}"


def test_servers_start_with_fp8_pools_and_the_shared_one_holds_twice_the_tokens(cluster):
    """Every pool is SGLang's fp8 one; a shared rank's pool is the replicated rank's size in the
    same KV bytes, and the shared prefill admits 2 x the logical tokens (SGLang's KV sharding)."""
    print(f"servers ready in {cluster.startup_s:.0f} s")
    pools = {name: re.findall(POOL_LOG, cluster.servers[name].log_text()) for name in (*PREFILLS, "fp8_decode")}
    for name, lines in pools.items():
        print(f"{name}: per-rank pool (dtype, #tokens, KV GB): {lines}")
    shared, replicated = pools["fp8_shared"], pools["fp8_replicated"]
    assert len(shared) == len(replicated) == S.CP and len(pools["fp8_decode"]) == 1, pools
    for name, lines in pools.items():
        assert all(dtype == "torch.float8_e4m3fn" for dtype, _, _ in lines), (name, lines)
    for (_, sh_tokens, sh_gb), (_, rep_tokens, rep_gb) in zip(shared, replicated):
        assert int(sh_tokens) == int(rep_tokens) == S.MAX_TOTAL_TOKENS and sh_gb == rep_gb, pools
    # SGLang's memory report (its finer rounding: GB, 3 decimals): a rank holds MAX_TOTAL_TOKENS fp8
    # rows per layer on either prefill
    fp8_gb = S.MAX_TOTAL_TOKENS * S.MODEL["num_hidden_layers"] * FP8_TOKEN_BYTES / GB
    info = {name: cluster.servers[name].info() for name in PREFILLS}
    for sh, rep in zip(info["fp8_shared"]["internal_states"], info["fp8_replicated"]["internal_states"]):
        sh, rep = sh["memory_usage"], rep["memory_usage"]
        print(f"per-rank kvcache GB: shared {sh['kvcache']}, replicated {rep['kvcache']}; fp8 rows: {fp8_gb:.4f}")
        assert rep["kvcache"] == pytest.approx(fp8_gb, abs=0.0006), (rep, fp8_gb)
        assert sh["kvcache"] == pytest.approx(rep["kvcache"], abs=0.0006), (sh, rep)
    shared_tokens, replicated_tokens = (S.logical_capacity(cluster.servers[name]) for name in PREFILLS)
    assert shared_tokens == S.CP * replicated_tokens, (shared_tokens, replicated_tokens)
    for rank in range(S.CP):
        pools = S.scratch_logs(cluster.servers["fp8_shared"], rank)
        assert pools and S.one_context_scratch() in pools[0], pools
    assert not S.scratch_logs(cluster.servers["fp8_replicated"], 0)


def test_prompt_of_three_chunks_reads_fp8_history(cluster):
    shared = cluster.servers["fp8_shared"]
    mark = len(shared.log_text())
    n = 2 * S.CHUNK_TOKENS + 40
    results = _both_pds(cluster, S.prompt_ids(n, seed=51))
    print(f"{n}-token prompt: {_summary(results)}")
    _assert_same(f"prompt of {n} tokens", results)
    chunks = re.findall(r"Prefill batch.*#new-token: (\d+)", shared.log_text(mark))
    assert len(chunks) >= 3, f"expected >= 3 prefill chunks on the shared prefill, got {chunks}"


def test_second_request_hits_the_radix_cache(cluster):
    prefix = S.prompt_ids(2 * S.PAGE + 5, seed=52)
    first = _both_pds(cluster, prefix + S.prompt_ids(20, seed=53))
    second = _both_pds(cluster, prefix + S.prompt_ids(30, seed=54))
    print(f"first: {_summary(first)}\nsecond: {_summary(second)}")
    _assert_same("first request", first)
    _assert_same("second request (cached prefix)", second)
    for name in PREFILLS:
        assert first[name][0]["cached_tokens"] == 0, (name, first[name][0])
        # the prefix's full pages come from the radix cache (fp8 rows read back from the pool)
        assert second[name][0]["cached_tokens"] == 2 * S.PAGE, (name, second[name][0])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
