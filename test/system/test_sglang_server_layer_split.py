"""CPU (real servers, ~14 processes on 2 cores): SGLang's own layer split (`--enable-dsa-cache-layer-split`) beside the
flag, in SGLang's real servers, at the same KV rows per rank, with every forward's collectives counted.

Servers (test/helpers/sglang_servers.py, docs/sglang_cpu_server.md):
- shared:      PD prefill, CP=2 interleave, `--enable-nsa-prefill-cp-shared-kv`;
- layer_split: PD prefill, CP=2 interleave, `--enable-dsa-cache-layer-split` (each rank keeps its
               layers' KV; the owner broadcasts a layer's whole buffer into the others' scratch);
- decode:      PD decode serving both; single: the oracle.
shared, decode and single are the PD file's servers, started once for both (helpers/shared_servers.py).
Both prefills get `--max-total-tokens 512` per rank (the demo's pool). Every scheduler counts its
collectives per forward (test/helpers/collective_counter.py), and the bytes are compared with
benchmark/traffic.py's formulas for that forward.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import collective_counter as C  # noqa: E402
from helpers import demo  # noqa: E402
from helpers import sglang_servers as S  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import traffic  # noqa: E402

register_cpu_ci(est_time=135, suite="nsa-cp-test-cpu")

NEW_TOKENS = 6
RANK_TOKENS = demo.PREFILL_RANK_TOKENS  # --max-total-tokens of both prefills (512)
LONG_PROMPT = 640  # > one rank's pool, < the shared N x 512 and the context (1024)
PREFILLS = ("shared", "layer_split")
ARM = {"shared": "shared", "layer_split": "layer_split"}  # benchmark/traffic.py's arm of each prefill
# the SGLang code that issues each kind of collective (collective_counter's `site`, module part)
SITES = {
    "layer split's owner broadcast": "sglang.srt.mem_cache.dsa_cache_layer_split",
    "the flag's history gather": "sglang.srt.mem_cache.page_interleave_pool",
    "CP's chunk all-gathers": "sglang.srt.layers.dp_attention:attn_cp_all_gather_into_tensor",  # from interleave
    "the narrow tail gather": "sglang_nsa_cp.comm",
}
REFUSAL = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")


# the shared prefill, decode and oracle are the PD file's (helpers/shared_servers.py: the demo's
# PREFILL_RANK_TOKENS rows a rank, layer split's the same), every server's collectives counted
SHARED_SERVER_ROLES = ("shared", "layer_split", "decode", "single")


@pytest.fixture(scope="module")
def cluster(shared_servers):
    return shared_servers


@pytest.fixture(scope="module")
def forwards_before(cluster) -> dict[str, list[int]]:
    """Per prefill and CP rank, the extend forwards counted before this file's requests (the
    servers may have served other files' first)."""
    return {prefill: [len(f) for f in _all_forwards(cluster, prefill)] for prefill in PREFILLS}


def _pd(cluster, prefill: str, ids: list[int]) -> list[int]:
    """Output ids of `ids` through the prefill `prefill` and the decode (the router's way)."""
    _, answer = S.generate_pd(cluster.servers[prefill], cluster.servers["decode"], ids, NEW_TOKENS)
    if isinstance(answer, Exception):
        raise AssertionError(f"{prefill}: prompt of {len(ids)} tokens: {answer!r}\n{cluster.log_tails()}")
    return answer["output_ids"]


def _oracle(cluster, ids):
    return S.generate(cluster.servers["single"].url, ids, NEW_TOKENS)["output_ids"]


def _all_forwards(cluster, prefill: str) -> list[list[dict]]:
    """Per CP rank, every extend forward the prefill's scheduler counted."""
    reports = C.read_reports(cluster.workdir / "collectives", cluster.servers[prefill].ports[0])
    assert [r["attn_cp_rank"] for r in reports] == list(range(S.CP)), f"{prefill}: reports {reports}"
    return [[f for f in r["forwards"] if f.get("mode") == "EXTEND"] for r in reports]


def _forwards(cluster, prefill: str, before: list[int]) -> list[list[dict]]:
    """Per CP rank, the extend forwards counted since `before` (forwards_before's counts)."""
    return [forwards[n:] for forwards, n in zip(_all_forwards(cluster, prefill), before)]


CHUNK_ROW_BYTES = traffic.CHUNK_LATENT_BYTES + traffic.CHUNK_INDEX_KEY_BYTES


def _bytes(forward: dict, op: str, site: str) -> int:
    return sum(c["bytes"] for c in forward["calls"] if c["op"] == op and c["site"].startswith(site))


def test_capacity_and_kv_bytes_per_rank(cluster):
    """Layer split keeps a rank's logical capacity (its pool rows); the flag's is N x. SGLang logs
    the layer split rank's owned layers only (1 of 2 here); its one-layer scratch comes on top."""
    print(f"servers ready in {cluster.startup_s:.0f} s")
    assert S.logical_capacity(cluster.servers["layer_split"]) == RANK_TOKENS
    assert S.logical_capacity(cluster.servers["shared"]) == S.CP * RANK_TOKENS
    log = cluster.servers["layer_split"].log_text()
    plans = re.findall(r"ATTN_CP(\d) [^\]]*\] Layer shard plan \(continuous\): layer_num=2, shard_size=2, "
                       r"rank=\d, local=\[(\d),(\d)\)", log)  # fmt: skip
    assert sorted(plans) == [("0", "0", "1"), ("1", "1", "2")], plans
    pools = re.findall(r"ATTN_CP(\d) [^\]]*\] KV Cache is allocated\. dtype: \S+, #tokens: (\d+)", log)
    assert sorted(pools) == [("0", str(RANK_TOKENS)), ("1", str(RANK_TOKENS))], pools


@pytest.mark.parametrize("prefill", PREFILLS)
def test_tokens_equal_the_oracle(cluster, prefill, forwards_before):
    """One page, a prompt of 3 chunks, and a radix hit of 2 pages, one after the other."""
    shared_prefix = S.prompt_ids(133, seed=7)
    cases = {"one page": S.prompt_ids(40, seed=1), "3 chunks": S.prompt_ids(296, seed=2),
             "radix miss": shared_prefix + S.prompt_ids(20, seed=3),
             "radix hit": shared_prefix + S.prompt_ids(30, seed=4)}  # fmt: skip
    server = cluster.servers[prefill]
    mark = len(server.log_text())
    for name, ids in cases.items():
        assert _pd(cluster, prefill, ids) == _oracle(cluster, ids), f"{prefill}: {name} ({len(ids)} tokens)"
    hits = [int(m) for m in re.findall(r"#cached-token: (\d+)", server.log_text(mark))]
    assert max(hits) == 2 * S.PAGE, f"{prefill}: no radix hit of 2 pages: {hits}"


@pytest.mark.parametrize("prefill", PREFILLS)
def test_counted_bytes_per_forward_equal_the_formula(cluster, prefill, forwards_before):
    """Every extend forward the prefill ran (test_tokens_equal_the_oracle's requests), on every CP
    rank: the bytes its collectives moved, by site, against benchmark/traffic.py's terms for that
    forward's batch (new and cached tokens per request, the pool's rows). traffic.py's bus bytes are
    (N-1)/N of an all-gather's output, the counter counts the output: compared as output bytes."""
    forwards = _forwards(cluster, prefill, forwards_before[prefill])
    assert forwards[0] and len(forwards[0]) == len(forwards[1]), [len(f) for f in forwards]
    layers, ring = S.MODEL["num_hidden_layers"], (S.CP - 1) / S.CP
    seen_history, tails = 0, []
    for rank, rank_forwards in enumerate(forwards):
        for forward in rank_forwards:
            batch = traffic.Batch(tuple(zip(forward["extend_lens"], forward["prefix_lens"])))
            terms = {t.name: t for t in traffic.kv_terms(ARM[prefill], S.CP, "bf16", layers, batch, RANK_TOKENS)}
            where = f"{prefill} rank {rank}, batch {batch.requests}"
            broadcast = _bytes(forward, "broadcast", SITES["layer split's owner broadcast"])
            gather = _bytes(forward, "all_gather", SITES["the flag's history gather"])
            if prefill == "layer_split":
                expected = sum(t.forward_bus_bytes for n, t in terms.items() if n.startswith("owner broadcast"))
                assert broadcast == expected, f"{where}: broadcast {broadcast} B, formula {expected} B"
                assert gather == 0, where
            else:
                history = terms.get("history all-gather (latent + index K)")
                expected = round(history.forward_bus_bytes / ring) if history else 0
                assert gather == expected, f"{where}: history gather {gather} B, formula {expected} B"
                assert broadcast == 0, where
                seen_history += gather
            # CP's own all-gathers (interleave): 2 a layer (the chunk's latent and indexer key), then
            # the hidden states for the logits, none when SGLang runs the batch without CP (T < N)
            cp_gathers = [c for c in forward["calls"] if c["op"] == "all_gather"
                          and c["site"].startswith((SITES["CP's chunk all-gathers"], SITES["the narrow tail gather"]))]  # fmt: skip
            cp_calls = [c["bytes"] for c in cp_gathers]
            if batch.new < S.CP:
                assert not cp_calls, f"{where}: SGLang's interleave CP does not apply below N tokens: {cp_calls}"
                continue
            assert len(cp_calls) == 2 * layers + 1, f"{where}: {cp_calls}"
            formula = round(sum(t.forward_bus_bytes for n, t in terms.items() if n.startswith("chunk")) / ring)
            rows = traffic.physical_rows(batch.new, S.CP)
            assert sum(cp_calls[:-1]) == rows * layers * CHUNK_ROW_BYTES == formula, f"{where}: {cp_calls}, {formula}"
            # the tail: the flag's narrow gather (N x requests rows) unless the plugin names why not
            hidden = S.MODEL["hidden_size"] * traffic.HIDDEN_BYTES
            because = (forward.get("every_token_tail_because", "the plugin's tail hook did not run")
                       if prefill == "shared" else "SGLang's own gather")  # fmt: skip
            expected = rows * hidden if because else S.CP * len(batch.requests) * hidden
            tails.append((batch.requests, cp_calls[-1], because))
            assert cp_calls[-1] == expected, f"{where}: tail gather {cp_calls[-1]} B, expected {expected} B ({because})"
            print(f"{where}: chunk all-gathers {sum(cp_calls[:-1])} B = traffic.py's ({rows} rows); tail gather "
                  f"{cp_calls[-1]} B (every token because: {because})")  # fmt: skip
    if prefill == "shared":
        assert seen_history > 0, "the 3-chunk prompt and the radix hit must gather history"
        assert any(because is None for *_, because in tails), f"the narrow tail gather never ran: {tails}"
    print(f"{prefill}: tail gathers (batch, counted B, every token because): {tails}")


def test_long_prompt(cluster):
    """A prompt longer than one rank's pool: layer split refuses it as replicated CP does (its logical
    capacity is a rank's rows); the flag serves it with the oracle's tokens."""
    ids = S.prompt_ids(LONG_PROMPT, seed=11)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.servers["layer_split"].bootstrap_port,
            "bootstrap_room": 1}  # fmt: skip
    with pytest.raises(requests.HTTPError) as refused:
        S.generate(cluster.servers["layer_split"].url, ids, NEW_TOKENS, 60, **boot)
    assert refused.value.response.status_code == 400
    message = refused.value.response.json()["error"]["message"]
    assert REFUSAL.search(message).groups() == (str(LONG_PROMPT), str(RANK_TOKENS - 6)), message
    t = time.monotonic()
    assert _pd(cluster, "shared", ids) == _oracle(cluster, ids)
    print(
        f"{LONG_PROMPT} tokens: layer split refused ({message}); the flag served them in {time.monotonic() - t:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
