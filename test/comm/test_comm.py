"""CP collectives on gloo with 2, 3 and 4 processes: all-gather-rerange with uneven counts, the
narrow tail gather, owned-row gathers, byte counters; and a failing rank is reported, not hung."""

import os
import random
import sys
import time
import types

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.comm import (
    RankFailure,
    RankPool,
    TrafficCounter,
    all_gather_rerange,
    all_gather_rows,
    gather_full_hidden,
    gather_last_token_hidden,
    run_ranks,
)
from sglang_nsa_cp.layout import plan_split

register_cpu_ci(est_time=357, suite="nsa-cp-test-cpu")

HIDDEN = 8


def _random_batches(cp_size, seed, count=6):
    rng = random.Random(seed)
    for i in range(count):
        bs = rng.randint(1, 4)
        extend = [rng.randint(1, 300) for _ in range(bs)]
        prefix = [rng.randint(0, 100) for _ in range(bs)]
        mode = ("zigzag", "page_zigzag", "interleave")[i % 3]
        yield plan_split(extend, prefix, cp_size, mode, rng.choice([1, 16, 64]))


def _logical_tensor(plan, dtype):
    """A value per flat token that every rank can compute: the token index, row-broadcast."""
    return torch.arange(plan.num_tokens).to(torch.float32)[:, None].expand(-1, HIDDEN).to(dtype).contiguous()


def _check_collectives(rank, world, group, seed):
    report = []
    for plan in _random_batches(world, seed):
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            full = _logical_tensor(plan, dtype)
            local = full[plan.token_indices(rank)]
            gathered = all_gather_rerange(local, plan, group)
            assert torch.equal(gathered.view(torch.uint8), full.view(torch.uint8)), (plan.extend_lens, dtype)

        counter = TrafficCounter()
        full = _logical_tensor(plan, torch.float32)
        local = full[plan.token_indices(rank)]
        last = gather_last_token_hidden(local, plan, rank, group, counter)
        ends = torch.cumsum(torch.tensor(plan.extend_lens), 0) - 1
        assert torch.equal(last, full[ends])
        assert torch.equal(gather_full_hidden(local, plan, group, counter), full)
        report.append(
            {
                "bs": plan.batch_size,
                "num_tokens": plan.num_tokens,
                "max_count": plan.max_count,
                "traffic": counter.as_dict(),
            }
        )

    # Owned-row gather: each rank contributes a different number of rows, padded to a bound.
    rows = torch.full((rank + 1, 3), rank, dtype=torch.uint8)
    out = all_gather_rows(rows, world, group)
    for r in range(world):
        assert torch.equal(out[r * world : r * world + r + 1], torch.full((r + 1, 3), r, dtype=torch.uint8))
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_on_gloo(world):
    reports = run_ranks(_check_collectives, world, args=(world,), timeout_s=120)
    # Byte counters: the narrow tail moves N x bs x hidden elements, the full tail
    # N x max_count x hidden (>= total_tokens x hidden).
    for report in reports[0]:
        narrow = report["traffic"]["tail_narrow"]["bytes"]
        full = report["traffic"]["tail_full"]["bytes"]
        assert narrow == world * report["bs"] * HIDDEN * 4
        assert full == world * report["max_count"] * HIDDEN * 4
        assert full >= report["num_tokens"] * HIDDEN * 4
    assert reports[0] == reports[-1]  # every rank counts the same traffic


def _fail_on_rank_one(rank, world, group):
    if rank == 1:
        raise ValueError("boom on rank one")
    torch.distributed.barrier(group)  # the survivors block here until torn down


def test_a_failing_rank_is_named_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(
        RankFailure, match=r"rank 1/3 failed:[\s\S]*boom on rank one[\s\S]*ranks \[0, 2\] of 3 were stopped"
    ):
        run_ranks(_fail_on_rank_one, 3, timeout_s=60)
    assert time.monotonic() - start < 50, "the survivors were waited for instead of stopped"


def _die_on_rank_two(rank, world, group):
    if rank == 2:
        os._exit(3)  # no traceback, no report: only the exit code tells
    torch.distributed.barrier(group)


def test_a_dead_rank_stops_the_others():
    with pytest.raises(RankFailure, match=r"rank 2/3 failed:\nprocess exited with code 3"):
        run_ranks(_die_on_rank_two, 3, timeout_s=60)


def test_ranks_that_cannot_load_their_function_are_reported():
    """A rank that cannot even load its function (here: it lives in a module only this process
    has) reports why, with its traceback, instead of hanging or tripping over its stack file."""
    module = types.ModuleType("only_in_the_parent")
    exec("def fn(rank, world, group):\n    return rank", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(
            RankFailure, match=r"rank \d/2 failed:\nTraceback[\s\S]*No module named 'only_in_the_parent'"
        ):
            run_ranks(module.fn, 2, timeout_s=60)
    finally:
        del sys.modules[module.__name__]


def _hang_on_rank_zero(rank, world, group):
    if rank == 0:
        _wait_forever_on_rank_zero()


def _wait_forever_on_rank_zero():
    time.sleep(3600)


def test_a_timeout_names_the_rank_and_dumps_its_stack():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_hang_on_rank_zero, 2, timeout_s=40)
    text = str(failure.value)
    assert "rank 0/2 failed: did not finish within 40 s" in text, text
    assert "_wait_forever_on_rank_zero" in text, f"rank 0's stack was not dumped: {text}"
    assert "rank 1/2" not in text, f"rank 1 finished and must not be blamed: {text}"


def _pid(rank, world, group):
    return os.getpid()


def _fail_on(rank, world, group, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(1.0)  # the other ranks are still working when the bad one fails
    return os.getpid()


def _sum_of_ranks(rank, world, group):
    total = torch.tensor([rank])
    torch.distributed.all_reduce(total, group=group)
    return int(total)


def test_a_pool_keeps_its_ranks_and_replaces_only_the_failed_one_without_a_group():
    with RankPool(3, backend=None, timeout_s=60) as pool:
        first = pool.run(_pid)
        assert pool.run(_pid) == first, "the same processes must serve the next call"
        with pytest.raises(RankFailure, match=r"rank 1/3 failed:\nTraceback[\s\S]*boom on rank 1"):
            pool.run(_fail_on, args=(1,))
        after = pool.run(_pid)
        assert (after[0], after[2]) == (first[0], first[2]) and after[1] != first[1], (first, after)


def test_a_pool_with_a_group_restarts_every_rank_after_a_failure():
    with RankPool(2, timeout_s=60) as pool:
        first = pool.run(_pid)
        with pytest.raises(RankFailure, match=r"rank 0/2 failed:\nTraceback[\s\S]*boom on rank 0"):
            pool.run(_fail_on, args=(0,))
        assert not set(pool.run(_pid)) & set(first), "a broken group must not be reused"
        assert pool.run(_sum_of_ranks) == [1, 1], "the fresh ranks share a working group"


def test_rows_beyond_the_bound_are_refused():
    with pytest.raises(ValueError, match="exceed rows_per_rank"):
        all_gather_rows(torch.zeros(3, 2), 2, group=None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
