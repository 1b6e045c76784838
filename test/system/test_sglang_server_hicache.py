"""CPU (real servers, ~12 processes on 2 cores): HiCache (`--enable-hierarchical-cache`,
host tier) on a PD prefill with `--enable-nsa-prefill-cp-shared-kv`, under SGLang's own scheduler,
over HTTP.

Servers (test/helpers/sglang_servers.py, the tiny DeepSeek-V3.2 checkpoint, CPU stand-ins from the
test-only plugin; with HiCache on it also stands in for the `sgl_kernel.kvcacheio` row copies):
- hicache_shared:     PD prefill, CP=2 interleave, the flag, HiCache, a device pool of a few pages;
- hicache_replicated: the same without the flag (replicated CP, every rank a full copy), the same
  logical device capacity;
- decode:             PD decode, CP off, for both (the flag runs only on a PD prefill); the PD
  file's decode, started once for both (helpers/shared_servers.py).
Prompt A, then other prompts that push A's pages out of each prefill's device pool (HiCache keeps
them on host), then A again: each prefill serves the second A from host (its log and the
prefill's `cached_tokens_details`), and its greedy tokens equal the first A's and the other prefill's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_servers as S  # noqa: E402

register_cpu_ci(est_time=130, suite="nsa-cp-test-cpu")

NEW_TOKENS = 6
PREFILLS = ("hicache_shared", "hicache_replicated")
PROMPT_A = S.prompt_ids(4 * S.PAGE + 20, seed=41)  # 4 full pages: what the radix tree caches
# Each as long as A, together more than the device pool holds: A's pages go to host to make room.
OTHERS = [S.prompt_ids(4 * S.PAGE + 20, seed=42 + i) for i in range(S.HICACHE_DEVICE_TOKENS // (4 * S.PAGE) + 1)]


SHARED_SERVER_ROLES = (*PREFILLS, "decode")  # the decode is the PD file's (helpers/shared_servers.py)


@pytest.fixture(scope="module")
def cluster(shared_servers):
    return shared_servers


def _logged_ints(server, pattern, mark=0):
    return [int(m) for m in re.findall(pattern, server.log_text(mark))]


def _generate(cluster, prefill, ids):
    """Greedy through one prefill and the decode; returns (prefill meta_info, output ids)."""
    pre, dec = S.generate_pd(cluster.servers[prefill], cluster.servers["decode"], ids, NEW_TOKENS)
    assert isinstance(pre, dict) and isinstance(dec, dict), f"{prefill}: {pre!r} {dec!r}\n{cluster.log_tails()}"
    return pre["meta_info"], dec["output_ids"]


def test_servers_start_with_the_same_logical_capacity_and_a_1_in_n_host_pool(cluster):
    """Both prefills admit HICACHE_DEVICE_TOKENS logical device tokens, a shared rank holding 1/N of
    them; a shared rank's host pool is 1/N of a replicated rank's (SGLang adds one padding page to
    each)."""
    print(f"servers ready in {cluster.startup_s:.0f} s")
    shared, replicated = (cluster.servers[n] for n in PREFILLS)
    for server, per_rank in ((shared, S.HICACHE_DEVICE_TOKENS // S.CP), (replicated, S.HICACHE_DEVICE_TOKENS)):
        device = _logged_ints(server, r"KV Cache is allocated\. .*#tokens: (\d+)")
        assert device == [per_rank] * S.CP, (server.name, device)  # a rank's pool
        assert S.logical_capacity(server) == S.HICACHE_DEVICE_TOKENS, server.name  # what the scheduler admits
    host = {
        s.name: _logged_ints(s, r"Allocating kv hierarchical KV host pool: (\d+) tokens") for s in (shared, replicated)
    }
    print("latent host pool per rank (tokens):", host)
    (rep,) = set(host[replicated.name])
    assert len(host[replicated.name]) == S.CP and rep == 2 * S.HICACHE_DEVICE_TOKENS + S.PAGE, host
    assert host[shared.name] == [(rep - S.PAGE) // S.CP + S.PAGE] * S.CP, host


def test_prefix_evicted_to_host_is_loaded_back_with_the_same_tokens(cluster):
    first = {name: _generate(cluster, name, PROMPT_A) for name in PREFILLS}
    for ids in OTHERS:
        for name in PREFILLS:
            _generate(cluster, name, ids)
    marks = {name: len(cluster.servers[name].log_text()) for name in PREFILLS}
    second = {name: _generate(cluster, name, PROMPT_A) for name in PREFILLS}
    cached = 4 * S.PAGE  # A's full pages
    for name in PREFILLS:
        (meta1, out1), (meta2, out2) = first[name], second[name]
        print(f"{name}: first A {out1} cached {meta1['cached_tokens']}; second A {out2} cached "
              f"{meta2['cached_tokens']} {meta2.get('cached_tokens_details')}")  # fmt: skip
        assert meta1["cached_tokens"] == 0, (name, meta1)
        # all of A's cached pages came from host: the others pushed them out of the device pool
        assert meta2["cached_tokens_details"] == {"device": 0, "host": cached}, (name, meta2)
        hits = _logged_ints(cluster.servers[name], r"Prefill batch.*#cached-token: (\d+)", marks[name])
        assert hits == [cached], (name, hits)
        assert out2 == out1, f"{name}: A loaded back from host {out2} != A prefilled {out1}"
    assert second["hicache_shared"][1] == second["hicache_replicated"][1], (
        f"shared KV {second['hicache_shared'][1]} != replicated {second['hicache_replicated'][1]}"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
