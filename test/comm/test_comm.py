"""The narrow tail gather on gloo with 2, 3 and 4 processes: each request's last-token hidden
state, in request order, on every rank; the bytes it moves (N x bs x hidden); row gathers of
bf16 and fp8 (which travels as bytes)."""

import random
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from helpers.distributed import run_ranks
from sglang_nsa_cp.comm import all_gather_rows, collectives, gather_last_token_hidden, plan_tail

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")

HIDDEN = 8


def _random_plans(cp_size, seed, count=6):
    rng = random.Random(seed)
    for _ in range(count):
        yield plan_tail([rng.randint(1, 300) for _ in range(rng.randint(1, 4))], cp_size)


def _check_collectives(rank, world, group, seed):
    report, gathered = [], []
    inner = collectives._all_gather_single

    def recorded(out, *args, **kwargs):  # the bytes every gather brings to this rank
        gathered.append(out.numel() * out.element_size())
        return inner(out, *args, **kwargs)

    collectives._all_gather_single = recorded
    for plan in _random_plans(world, seed):
        num_tokens = sum(plan.extend_lens)
        # A value per flat token that every rank can compute: the token index, row-broadcast.
        full = torch.arange(num_tokens, dtype=torch.float32)[:, None].expand(-1, HIDDEN).contiguous()
        local = full[rank::world]  # SGLang's interleave split: flat token i on rank i % N
        gathered.clear()
        last = gather_last_token_hidden(local, plan, rank, group)
        assert torch.equal(last, full[plan.last_tokens]), f"{world=}, {rank=}, lens={plan.extend_lens}"
        report.append({"bs": plan.batch_size, "gathered_bytes": list(gathered)})

    for dtype in (torch.uint8, torch.bfloat16, torch.float8_e4m3fn):
        out = all_gather_rows(torch.full((2, 3), rank).to(dtype), group)
        want = torch.arange(world).repeat_interleave(2)[:, None].expand(-1, 3).to(dtype)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), dtype
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tail_gather_on_gloo(world):
    reports = run_ranks(_check_collectives, world, args=(world,), timeout_s=120)
    for report in reports[0]:  # the narrow tail is one gather of N x bs x hidden elements
        assert report["gathered_bytes"] == [world * report["bs"] * HIDDEN * 4], report
    assert reports[0] == reports[-1], "every rank moves the same bytes"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
