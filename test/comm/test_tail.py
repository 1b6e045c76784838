"""The narrow tail gather's plan names each request's last token where SGLang 0.5.23 puts it.

`comm.plan_tail` assumes SGLang's interleave split: flat token i on rank i % N at local row i // N.
The reference is SGLang's own code on CPU (`helpers.sglang_cp_reference.sglang_split`: its
`prepare_cp_forward` + `cp_shard_hidden_states` on every simulated rank); a brute-force per-token
loop pins the plan for every N in 1..8 and short batches. One process, no group: the gather is
simulated by stacking the ranks' narrow rows rank-major, as `all_gather_rows` lays them out.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.sglang_cp_reference import sglang_split  # noqa: E402
from sglang_nsa_cp.comm import plan_tail  # noqa: E402

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

EDGE_BATCHES = [
    ([37, 20], 4),
    ([1, 1, 1], 3),  # exactly N tokens, one per request
    ([5], 5),
    ([3, 4], 7),
    ([7, 1, 1, 1, 1, 1], 8),
    ([4000] * 6, 8),
    ([4001, 3, 2], 6),
]


def _random_batches(count: int, seed: int):
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        cp_size = 2 + len(out) % 7  # 2..8, odd ones included
        extend = [rng.choice([rng.randint(1, 40), rng.randint(1, 3000)]) for _ in range(rng.randint(1, 6))]
        if sum(extend) >= cp_size:  # SGLang's interleave can_apply
            out.append((extend, cp_size))
    return out


def _narrow_gather(plan, local_rows):
    """What `gather_last_token_hidden` returns, with the all-gather done by concatenation."""
    narrow = []
    for rank, local in enumerate(local_rows):
        rows = plan.last_token_local_rows(rank).clamp_min(0)
        local = local if local.numel() else local.new_zeros(1)  # a rank with no tokens still sends
        narrow.append(local.index_select(0, rows))
    return torch.cat(narrow).index_select(0, plan.last_token_gather_index)


@pytest.mark.parametrize("batch", EDGE_BATCHES + _random_batches(40, seed=30), ids=str)
def test_the_plan_picks_each_last_token_from_sglang_interleave_shards(batch):
    extend, cp_size = batch
    plan = plan_tail(extend, cp_size)
    ref = sglang_split("interleave", extend, [0] * len(extend), cp_size)
    last = torch.cumsum(torch.tensor(extend), 0) - 1
    shards = [ref.rank_tokens(r).to(torch.long) for r in range(cp_size)]  # flat token ids, local order
    for r, tokens in enumerate(shards):
        want = torch.tensor([int((tokens == t).nonzero()[0]) if (tokens == t).any() else -1 for t in last])
        got = plan.last_token_local_rows(r)
        assert torch.equal(got, want), f"{extend=}, {cp_size=}, rank={r}: {got.tolist()} vs SGLang {want.tolist()}"
    assert torch.equal(_narrow_gather(plan, shards), last), f"{extend=}, {cp_size=}"


@pytest.mark.parametrize("cp_size", range(1, 9))
def test_the_plan_matches_a_per_token_loop(cp_size):
    for extend in itertools.chain(itertools.product(range(1, 5), repeat=2), [[1], [9], [1, 1, 1, 1, 1]]):
        plan = plan_tail(extend, cp_size)
        flat = 0
        for i, n in enumerate(extend):
            flat += n
            owner, row = (flat - 1) % cp_size, (flat - 1) // cp_size
            where = f"n={cp_size}, lens={list(extend)}, request={i}"
            assert int(plan.last_token_rank[i]) == owner, where
            for r in range(cp_size):
                assert int(plan.last_token_local_rows(r)[i]) == (row if r == owner else -1), f"{where}, rank={r}"
            assert int(plan.last_token_gather_index[i]) == owner * len(extend) + i, where


@pytest.mark.parametrize(
    "args, message",
    [(([], 2), "at least one request"), (([3, 0], 2), r"requests \[1\] have no new tokens"), (([3], 0), "cp_size")],
)
def test_bad_input_is_rejected_with_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        plan_tail(*args)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 is outside the CP group of size 2"):
        plan_tail([3], 2).last_token_local_rows(2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
