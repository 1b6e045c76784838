"""The narrow tail gather on gloo with 2, 3 and 4 processes: each request's last-token hidden
state, in request order, on every rank; the bytes it moves (N x bs x hidden); padded row gathers."""

import random
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from helpers.distributed import run_ranks
from sglang_nsa_cp.comm import TrafficCounter, all_gather_rows, gather_last_token_hidden, plan_tail

register_cpu_ci(est_time=60, suite="nsa-cp-test-cpu")

HIDDEN = 8


def _random_plans(cp_size, seed, count=6):
    rng = random.Random(seed)
    for _ in range(count):
        yield plan_tail([rng.randint(1, 300) for _ in range(rng.randint(1, 4))], cp_size)


def _check_collectives(rank, world, group, seed):
    report = []
    for plan in _random_plans(world, seed):
        num_tokens = sum(plan.extend_lens)
        # A value per flat token that every rank can compute: the token index, row-broadcast.
        full = torch.arange(num_tokens, dtype=torch.float32)[:, None].expand(-1, HIDDEN).contiguous()
        local = full[rank::world]  # SGLang's interleave split: flat token i on rank i % N
        counter = TrafficCounter()
        last = gather_last_token_hidden(local, plan, rank, group, counter)
        assert torch.equal(last, full[plan.last_tokens]), f"{world=}, {rank=}, lens={plan.extend_lens}"
        report.append({"bs": plan.batch_size, "traffic": counter.as_dict()})

    # Each rank contributes a different number of rows (fp8 too), padded to a bound.
    for dtype in (torch.uint8, torch.bfloat16, torch.float8_e4m3fn):
        rows = torch.full((rank + 1, 3), rank).to(dtype)
        out = all_gather_rows(rows, world, group)
        for r in range(world):
            want = torch.full((r + 1, 3), r).to(dtype)
            assert torch.equal(out[r * world : r * world + r + 1].view(torch.uint8), want.view(torch.uint8)), dtype
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tail_gather_on_gloo(world):
    reports = run_ranks(_check_collectives, world, args=(world,), timeout_s=120)
    for report in reports[0]:  # the narrow tail moves N x bs x hidden elements
        assert report["traffic"]["tail_narrow"]["bytes"] == world * report["bs"] * HIDDEN * 4, report
    assert reports[0] == reports[-1], "every rank counts the same traffic"


def test_rows_beyond_the_bound_are_refused():
    with pytest.raises(ValueError, match="exceed rows_per_rank"):
        all_gather_rows(torch.zeros(3, 2), 2, group=None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
