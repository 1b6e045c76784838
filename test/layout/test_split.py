"""Split plans: every token computed exactly once, positions and causal lengths right, rerange
inverts the rank-major gather, page-aligned zigzag cuts only at page boundaries, load balanced."""

import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.layout import SplitError, plan_split

register_cpu_ci(est_time=98, suite="nsa-cp-test-cpu")


@st.composite
def batches(draw, max_len=3000):
    cp_size = draw(st.integers(1, 8))
    bs = draw(st.integers(1, 6))
    extend = draw(st.lists(st.integers(1, max_len), min_size=bs, max_size=bs))
    prefix = draw(st.lists(st.integers(0, 2 * max_len), min_size=bs, max_size=bs))
    page_size = draw(st.sampled_from([1, 16, 64]))
    mode = draw(st.sampled_from(["zigzag", "page_zigzag", "interleave"]))
    return extend, prefix, cp_size, mode, page_size


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_token_is_computed_exactly_once_and_rerange_restores_order(batch):
    extend, prefix, cp_size, mode, page_size = batch
    plan = plan_split(extend, prefix, cp_size, mode, page_size)
    all_tokens = torch.cat([plan.token_indices(r) for r in range(cp_size)])
    assert torch.equal(all_tokens.sort().values, torch.arange(sum(extend)))

    # Simulate the padded rank-major all-gather of each rank's token ids, then rerange.
    gathered = torch.full((cp_size * plan.max_count,), -1, dtype=torch.long)
    for r in range(cp_size):
        tokens = plan.token_indices(r)
        gathered[r * plan.max_count : r * plan.max_count + tokens.numel()] = tokens
    assert torch.equal(gathered[plan.rerange_index], torch.arange(sum(extend)))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_positions_requests_and_causal_lengths(batch):
    extend, prefix, cp_size, mode, page_size = batch
    plan = plan_split(extend, prefix, cp_size, mode, page_size)
    starts = [sum(extend[:i]) for i in range(len(extend))]
    for r in range(cp_size):
        for t, pos, req, kv in zip(
            plan.token_indices(r).tolist(),
            plan.positions(r).tolist(),
            plan.request_ids(r).tolist(),
            plan.kv_lens(r).tolist(),
        ):
            assert starts[req] <= t < starts[req] + extend[req]
            assert pos == prefix[req] + t - starts[req]
            assert kv == pos + 1


@settings(max_examples=200, deadline=None)
@given(batches())
def test_page_zigzag_gives_each_new_page_one_computing_rank(batch):
    extend, prefix, cp_size, _, page_size = batch
    plan = plan_split(extend, prefix, cp_size, "page_zigzag", page_size)
    enough_pages = all((p + e - 1) // page_size - p // page_size + 1 >= 2 * cp_size for p, e in zip(prefix, extend))
    assert plan.page_aligned == enough_pages
    if not plan.page_aligned:
        return
    computing = {}
    for r in range(cp_size):
        for pos, req in zip(plan.positions(r).tolist(), plan.request_ids(r).tolist()):
            computing.setdefault((req, pos // page_size), set()).add(r)
    assert all(len(ranks) == 1 for ranks in computing.values())


def test_partial_first_page_goes_to_its_existing_owner():
    # Prefix of 70 tokens at page size 16: page 4 already holds positions 64..69.
    plan = plan_split([500], [70], cp_size=4, mode="page_zigzag", page_size=16, first_page_owners=[2])
    assert plan.page_aligned
    owner_of_first_page = {int(plan.token_rank[t]) for t in range(16 - 70 % 16)}
    assert owner_of_first_page == {2}
    # Rank 2 computes that page before anything else of the request (logical order).
    assert plan.positions(2)[: 16 - 70 % 16].tolist() == list(range(70, 80))


def test_zigzag_matches_sglang_worked_example():
    # From SGLang 0.5.23's zigzag strategy: lens [37, 20], cp=4, rank 0.
    plan = plan_split([37, 20], [0, 0], cp_size=4, mode="zigzag", page_size=1)
    expected = [*range(0, 5), *range(37, 40), *range(33, 37), 55, 56]
    assert plan.token_indices(0).tolist() == expected


def test_interleave_is_round_robin_over_the_flat_batch():
    plan = plan_split([5, 6], [3, 0], cp_size=3, mode="interleave")
    assert plan.token_indices(1).tolist() == [1, 4, 7, 10]


def test_short_requests_leave_some_ranks_empty_without_losing_tokens():
    plan = plan_split([3], [0], cp_size=4, mode="zigzag", page_size=16)
    assert sorted(plan.counts) == [0, 1, 1, 1]
    assert plan.last_token_rank.tolist() == [int(plan.token_rank[2])]


def test_balance_over_long_random_batches():
    rng = random.Random(0)
    ratios = {}
    for mode in ("zigzag", "page_zigzag", "interleave"):
        worst = 1.0
        for _ in range(50):
            cp_size = rng.choice([2, 4, 8])
            bs = rng.randint(1, 4)
            extend = [rng.randint(16 * 1024, 64 * 1024) for _ in range(bs)]
            prefix = [rng.choice([0, rng.randint(0, 32 * 1024)]) for _ in range(bs)]
            plan = plan_split(extend, prefix, cp_size, mode, 64)
            worst = max(worst, plan.balance_ratio())
        ratios[mode] = worst
    print("worst max/mean attention work:", ratios)
    assert ratios["zigzag"] < 1.01
    assert ratios["page_zigzag"] < 1.02
    assert ratios["interleave"] < 1.01


@pytest.mark.parametrize(
    "args, message",
    [
        (([4], [0, 0], 2, "zigzag"), "prefix_lens has 2"),
        (([0], [0], 2, "zigzag"), "no new tokens"),
        (([4], [-1], 2, "zigzag"), "negative prefix"),
        (([4], [0], 0, "zigzag"), "cp_size"),
        (([4], [0], 2, "round-robin"), "not one of"),
        (([], [], 2, "zigzag"), "at least one request"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(args, message):
    with pytest.raises(SplitError, match=message):
        plan_split(*args)


def test_first_page_owner_must_be_a_rank():
    with pytest.raises(SplitError, match="not ranks"):
        plan_split([100], [10], 2, "page_zigzag", 16, first_page_owners=[5])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
