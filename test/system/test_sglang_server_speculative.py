"""CPU (real servers, 6 scheduler processes on 2 cores): speculative decoding
(EAGLE over GLM-5's NextN / MTP layer) through PD with `--enable-nsa-prefill-cp-shared-kv`, on
SGLang 0.5.23's real servers, checked against a non-speculative oracle.

Servers (test/helpers/sglang_servers.py, with the speculative stand-ins of
helpers/sglang_spec_stand_ins.py; the checkpoint is helpers/sglang_spec_model.py: a tiny
`GlmMoeDsaForCausalLM` whose NextN layer is built from the target's weights, so the draft is
accepted often):
- shared:     PD prefill, CP=2 interleave, the flag, EAGLE (target and draft pools sharded);
- replicated: PD prefill, CP=2 interleave, no flag, EAGLE (SGLang's replicated CP);
- decode:     PD decode, CP off, EAGLE, serving both prefills over Mooncake (one request at a time);
- single:     an ordinary non-PD, non-CP, non-speculative server (the oracle).
EAGLE: top-k 1, 2 steps, 3 draft tokens (helpers/sglang_gpu_servers.py SPEC_ARGS, as the GPU check). Each prefill runs the draft
extend over the prompt and sends the draft's KV pages with the target's and the draft's proposal
in its metadata; the decode drafts from them. For the same requests, greedy tokens of both PD
paths must equal the oracle's, and SGLang's own `meta_info` speculative counters
(`spec_accept_length`, `spec_verify_ct`, the accepted-drafts histogram) must be equal between the
shared and the replicated prefill; the mean accept length must be above 1 (drafts accepted). The
prompts include one prefilled in several chunks and a radix hit.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_gpu_servers as GS  # noqa: E402
from helpers import sglang_servers as S  # noqa: E402
from helpers import sglang_spec_model as M  # noqa: E402
from helpers import sglang_spec_stand_ins  # noqa: E402

register_cpu_ci(est_time=115, suite="nsa-cp-test-cpu")

NEW_TOKENS = 12
# EAGLE as the GPU check runs it (top-k 1, the draft's torch top-k), and no CUDA graphs for the draft
# worker (SGLang decides that one apart from the target's, which --device cpu turns off)
SPEC_ARGS = GS.SPEC_ARGS + ["--disable-cuda-graph"]
# the decode's test-only dump of what it received, and the one room whose draft KV it corrupts
CORRUPT_ROOM = 4242424242
ENV = {sglang_spec_stand_ins.ENV: "1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600",
       sglang_spec_stand_ins.CORRUPT_ENV: str(CORRUPT_ROOM)}  # fmt: skip
DUMPED = ("latent", "index_k", "index_scale", "topk_p", "topk_index", "hidden_states")


class SpecCluster(S.Cluster):
    def write_model(self, path: str) -> str:
        return M.write_model(path, self.cp)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang_spec_cpu")
    (workdir / "dump").mkdir()
    env = {**ENV, sglang_spec_stand_ins.DUMP_ENV: str(workdir / "dump")}
    extra = {role: SPEC_ARGS for role in GS.SPEC_ROLES}
    with SpecCluster(workdir, router=False, extra_args=extra, env=env).running(timeout_s=600) as cluster:
        yield cluster


ACCEPT_LENGTHS: list[float] = []  # every PD request's spec_accept_length, for the last test


def _pd(cluster, prefill, ids, room):
    """A PD request through `prefill` and the decode under bootstrap room `room`; the decode's answer."""
    answer = S.generate_pd(cluster.servers[prefill], cluster.servers["decode"], ids, NEW_TOKENS, timeout_s=600,
                           bootstrap_room=room)[1]  # fmt: skip
    if isinstance(answer, Exception):
        raise answer
    return dict(answer, room=room)


def _paths(cluster, ids):
    """The same greedy request at once through the shared PD, the replicated PD and the oracle;
    returns each path's whole answer (a PD path's with its bootstrap room)."""
    rooms = {path: random.getrandbits(62) for path in ("shared", "replicated")}
    calls = {
        "shared": lambda: _pd(cluster, "shared", ids, rooms["shared"]),
        "replicated": lambda: _pd(cluster, "replicated", ids, rooms["replicated"]),
        "oracle": lambda: S.generate(cluster.servers["single"].url, ids, NEW_TOKENS, timeout_s=600),
    }
    return S.answers_of(cluster, calls, len(ids))


def _assert_paths(cluster, where, answers):
    oracle = answers["oracle"]["output_ids"]
    assert len(oracle) == NEW_TOKENS, where
    assert "spec_verify_ct" not in answers["oracle"]["meta_info"], f"{where}: the oracle ran speculative decoding"
    for path in ("shared", "replicated"):
        assert answers[path]["output_ids"] == oracle, f"{where}: {path} PD {answers[path]['output_ids']} != {oracle}"
    spec = {path: {k: answers[path]["meta_info"].get(k) for k in GS.SPEC_FIELDS} for path in ("shared", "replicated")}
    print(f"{where}: {oracle} {spec['shared']}")
    assert spec["shared"]["spec_verify_ct"], f"{where}: the decode verified no draft: {spec['shared']}"
    assert spec["shared"] == spec["replicated"], f"{where}: speculative counters differ: {spec}"
    ACCEPT_LENGTHS.append(spec["shared"]["spec_accept_length"])
    got, want = (_received(cluster, answers[path]["room"]) for path in ("shared", "replicated"))
    prompt = answers["oracle"]["meta_info"]["prompt_tokens"]
    assert got["slots"].numel() == want["slots"].numel() == prompt, where  # every prompt token's draft row
    for key in DUMPED:
        assert got[key].shape == want[key].shape and got[key].any(), f"{where}: draft {key}: nothing received"
        assert torch.equal(got[key], want[key]), (
            f"{where}: the decode received another draft {key} from the shared prefill"
        )


def _received(cluster, room):
    """What the decode's test-only dump holds for `room` (sglang_spec_stand_ins.dump_received_draft)."""
    path = cluster.workdir / "dump" / f"{room}.pt"
    assert path.exists(), f"the decode dumped nothing for room {room}\n{cluster.log_tails()}"
    return torch.load(path)


def test_both_prefills_serve_eagle_and_only_the_flag_shards_its_pools(cluster):
    """Every speculative server runs EAGLE; the shared prefill builds SGLang's sharded pool twice
    per CP rank (the target's and the MTP draft's, `_build_mtp_kv_shard_pool`), the replicated one
    none; the oracle is not speculative."""
    print(f"servers ready in {cluster.startup_s:.0f} s")
    for role in GS.SPEC_ROLES:
        info = cluster.servers[role].info()
        assert info["speculative_algorithm"] == "EAGLE", (role, info["speculative_algorithm"])
        assert info["speculative_num_steps"] == GS.SPEC_STEPS and info["speculative_eagle_topk"] == 1, role
    assert cluster.servers["single"].info()["speculative_algorithm"] is None
    for rank in range(S.CP):
        pools = S.scratch_logs(cluster.servers["shared"], rank)
        assert len(pools) == 2, f"rank {rank}: {pools}"  # target, then draft
    assert not S.scratch_logs(cluster.servers["replicated"], 0)


def test_short_and_chunked_prompts_decode_the_oracles_tokens_with_equal_accept_counts(cluster):
    """One prompt within a chunk and one of several chunks (the draft extend of each chunk over the
    draft's history, gathered from the owners under the flag)."""
    for n in (40, 3 * S.CHUNK_TOKENS + 40):
        _assert_paths(cluster, f"prompt of {n} tokens", _paths(cluster, S.prompt_ids(n, seed=n)))


def test_radix_hit_decodes_the_oracles_tokens_with_equal_accept_counts(cluster):
    """A second request over a cached two-page prefix: both prefills extend only the tail, the
    draft over its cached history."""
    prefix = S.prompt_ids(2 * S.PAGE + 5, seed=11)
    _assert_paths(cluster, "first request", _paths(cluster, prefix + S.prompt_ids(20, seed=12)))
    marks = {name: len(cluster.servers[name].log_text()) for name in ("shared", "replicated")}
    _assert_paths(cluster, "second request (cached prefix)", _paths(cluster, prefix + S.prompt_ids(30, seed=13)))
    for name, mark in marks.items():
        hits = [int(h) for h in re.findall(r"#cached-token: (\d+)", cluster.servers[name].log_text(mark))]
        assert hits and max(hits) >= 2 * S.PAGE, f"{name}: no radix hit of >= {2 * S.PAGE} tokens: {hits}"


def test_the_draft_is_accepted(cluster):
    """SGLang's accept length counts the verified token too: 1 means no draft accepted. Above 1,
    the equal counters above compare drafts that mattered."""
    assert len(ACCEPT_LENGTHS) == 4, ACCEPT_LENGTHS  # the requests of the tests above, in order
    mean = sum(ACCEPT_LENGTHS) / len(ACCEPT_LENGTHS)
    print(f"mean accept length {mean:.2f} of {GS.SPEC_DRAFT_TOKENS}: {ACCEPT_LENGTHS}")
    assert mean > 1, ACCEPT_LENGTHS


def test_a_corrupted_draft_page_is_committed_and_only_the_accept_length_drops(cluster):
    """The decode's received draft KV overwritten after its commit (the test-only corruption of
    room CORRUPT_ROOM): the plugin's commit checks which pages arrive from which owner, not their
    bytes, so nothing refuses the request; the target's verification keeps every token the
    oracle's, and the draft, reading garbage history, is accepted less."""
    ids = S.prompt_ids(2 * S.CHUNK_TOKENS + 20, seed=51)
    oracle = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS, timeout_s=600)["output_ids"]
    clean = _pd(cluster, "shared", ids, random.getrandbits(62))
    corrupt = _pd(cluster, "shared", ids, CORRUPT_ROOM)
    lengths = [a["meta_info"]["spec_accept_length"] for a in (clean, corrupt)]
    print(f"accept length clean {lengths[0]:.2f}, corrupted draft KV {lengths[1]:.2f}")
    assert clean["output_ids"] == corrupt["output_ids"] == oracle
    assert torch.equal(_received(cluster, clean["room"])["latent"], _received(cluster, CORRUPT_ROOM)["latent"])
    assert lengths[1] < lengths[0], lengths


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
