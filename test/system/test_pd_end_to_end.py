"""PD disaggregation end to end with the reference model (sglang_nsa_cp.pd.demo), CPU only.

Shared-KV CP prefill ranks (spawned, gloo) send the pages they own of each finished request over
Mooncake TCP to a decode pool in this process, which decodes greedily from it. Checked against
the single-rank oracle: identical decoded tokens, decode KV equal to the single-rank KV at every
position, transferred pages equal to the owners' shard pages byte for byte. About 70 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.layout import OwnerClassedAllocator
from sglang_nsa_cp.oracle import Scenario
from sglang_nsa_cp.pd.demo import DecodeKV, run_pd
from sglang_nsa_cp.shared_kv import KVStore

register_cpu_ci(est_time=231, suite="nsa-cp-test-cpu")

pytestmark = pytest.mark.timeout(240)


def check_pd(report: dict) -> None:
    assert report["committed"], report.get("failures")
    assert report["transfer_exact"], "a decode page differs from its owner's shard page"
    mismatched = {
        k: (r["tokens"], r["single_tokens"]) for k, r in report["requests"].items() if r["tokens"] != r["single_tokens"]
    }
    assert report["decoded_tokens_match"] and not mismatched, mismatched
    for part, kv in report["kv"].items():  # transferred positions, then the decoded ones
        assert kv["rows"] > 0
        assert kv["max_rel_latent_err"] <= 1e-5, (part, kv)
        assert kv["index_key_mismatched_bytes"] == 0, (part, kv)
        assert kv["max_rel_index_scale_err"] <= 1e-5, (part, kv)
    assert report["max_rel_prefill_logit_err"] <= 1e-5
    assert report["decode_pages_free_after_release"]
    assert report["ok"]
    # Every page crossed once, from its owner: the ranks' bytes add up to rank 0 sending all.
    assert sum(report["bytes_per_rank"]) == report["rank0_sends_all"]["bytes"]
    assert sum(report["pages_per_rank"]) == sum(len(r["logical_pages"]) for r in report["requests"].values())
    for rank, nbytes in enumerate(report["bytes_per_rank"]):
        assert report["received_per_rank"][rank]["nbytes"] == nbytes


def test_decode_kv_takes_new_pages_from_the_decode_allocator():
    store = KVStore.replicated(num_layers=1, num_pages=8, page_size=16, latent_dim=8, latent_dtype=torch.float32)
    allocator = OwnerClassedAllocator(8, cp_size=1)  # the decode's: one owner class
    transferred = allocator.alloc([0, 0])  # what the receiver's expect() hands out
    ctx = DecodeKV(store, allocator)
    ctx.adopt("a", transferred, 20)  # 20 tokens: page 0 full, page 1 holds 4
    positions, request_ids = ctx.begin_batch(["a"], [13])  # 33 tokens: one more page
    assert positions.tolist() == list(range(20, 33)) and request_ids.tolist() == [0] * 13
    assert ctx.table.pages["a"][:2] == transferred and allocator.free_pages() == 5
    slots = ctx.slots_of("a")
    assert slots[:20].tolist() == [transferred[p // 16] * 16 + p % 16 for p in range(20)]
    assert torch.equal(ctx.batch.out_cache_loc, slots[20:])
    ctx.release("a")  # frees the page decode took; the transferred ones are the receiver's
    assert allocator.free_pages() == 6
    with pytest.raises(ValueError, match="need 2 pages"):
        ctx.adopt("b", [5], 17)
    with pytest.raises(ValueError, match="need KVStore.replicated and a cp_size 1 allocator"):
        DecodeKV(store, OwnerClassedAllocator(8, cp_size=2))


def test_two_prefill_ranks_to_one_decode():
    # The demo's requests: one continues a cached prefix that ends mid-page (two chunks, sent
    # after the second), and a 5-token request makes the second chunk fall back to a token split.
    report = run_pd(Scenario.from_lens([200, 57, 5, 120], [0, 150, 0, 0], cp_size=2), decode_steps=4, timeout_s=180)
    check_pd(report)
    assert all(len(r["tokens"]) == 5 for r in report["requests"].values())


def test_four_prefill_ranks_to_one_decode():
    # Every batch page-aligned (direct writes), a cached prefix ending mid-page, and a pool so
    # tight that the owner-classed allocator borrows a page across classes in the second chunk.
    report = run_pd(Scenario.from_lens([200, 160, 130], [0, 150, 0], cp_size=4), decode_steps=3, timeout_s=180)
    check_pd(report)
    total = report["rank0_sends_all"]["bytes"]
    assert max(report["bytes_per_rank"]) <= total / 4 + report["bytes_per_page"]  # about 1/N each


def test_demo_with_pd_writes_the_pd_check(tmp_path):
    out = tmp_path / "demo.json"
    cmd = [
        sys.executable,
        "-m",
        "sglang_nsa_cp",
        "demo",
        "--cp",
        "2",
        "--extend-lens",
        "40,9",
        "--prefix-lens",
        "21,0",
        "--pd",
        "--decode-steps",
        "2",
        "--json",
        str(out),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["oracle_ok"] is True
    pd = report["pd"]
    assert pd["decoded_tokens_match"] is True and pd["ok"] is True
    assert len(pd["bytes_per_rank"]) == len(pd["transfers_per_rank"]) == 2
    assert sum(pd["bytes_per_rank"]) == pd["rank0_sends_all"]["bytes"]
    assert "pd: ok" in proc.stdout and "oracle: ok" in proc.stdout
    assert pd["keyed"] is True and "messages keyed with HMAC-SHA256" in proc.stdout  # on in the demo
    # Mooncake logs warnings and errors only by default (glog lines start with the level letter).
    mooncake_info = [line for line in proc.stderr.splitlines() if re.match(r"I\d{4} ", line)]
    assert not mooncake_info, mooncake_info


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
