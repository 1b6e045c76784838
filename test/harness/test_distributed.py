"""The rank launcher (helpers/distributed.py) on gloo: a failing, dead, unloadable or hung rank is
named, with its traceback or stack, and the others are stopped; a pool keeps its ranks across calls."""

import os
import sys
import time
import types

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from helpers.distributed import RankFailure, RankPool, run_ranks

register_cpu_ci(est_time=65, suite="nsa-cp-test-cpu")


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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
