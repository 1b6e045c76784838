"""Our `zigzag` and `interleave` split plans assign exactly SGLang 0.5.23's tokens, in its order.

The reference is SGLang's own code, run on CPU through its real entry points (see
`sglang_cp_reference`): `init_cp_strategy`, `is_cp_active` (`can_apply`), `prepare_cp_forward`
(`build_metadata(num_tokens, seqs_len=prefix+extend, extend_seqs_len)` +
`pad_logical_token_to_physical`), `cp_shard_hidden_states` / `cp_shard_position_ids`,
`local_q_indices`, `cp_gather_after_forward` (the strategies' all-gather + reorder, with a
simulated CP group) and, for interleave, `shard_per_request` (incl. its triton kernel, run by
the triton interpreter). Only the process group and the forward-batch object are stand-ins.

For every batch and every rank r we check:
- `plan.token_indices(r)` equals the flat tokens SGLang's `shard_hidden_states` gives rank r
  (fed `arange(1, T+1)`, padding stripped with `per_rank_logical_token[r]`), same order;
- `plan.counts` equals `per_rank_logical_token`; padding rows are zero;
- `plan.positions(r)` equals SGLang's `shard_position_ids` of the absolute positions;
- `local_q_indices` (what SGLang's DSA path uses to pick local queries) equals our tokens;
- zigzag: our per-request causal KV lengths agree with SGLang's attention metadata
  (`actual_seq_q_{prev,next}_list`, `kv_len_{prev,next}_list`), prefix included;
- interleave: SGLang's `shard_per_request` per-request q lengths / request ids agree with ours;
- gather: SGLang's gather, fed OUR local shards (padded to SGLang's physical length), returns
  the flat batch in order on every rank; the raw all-gather buffer SGLang builds equals our
  padded rank-major gather (zigzag: stride `plan.max_count`; interleave: SGLang strides by its
  physical length, so compared row-wise per rank) and `plan.rerange_index` puts it back in order.

Batch generation respects SGLang's preconditions (asserted via `is_cp_active`):
- zigzag `can_apply` needs cp_size > 1 and every extend length >= 2 * cp_size;
- interleave `can_apply` needs cp_size > 1 and total tokens >= cp_size.
cp_size 1 (SGLang runs no CP) and batches outside `can_apply` are still compared, by calling
the same strategy methods directly (`build_metadata`, `pad_logical_token_to_physical`,
`shard_hidden_states`, `gather_hidden_states`); those tests say so in their names.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers.sglang_cp_reference import (  # noqa: E402
    flat_positions,
    sglang_gather,
    sglang_interleave_q_lens,
    sglang_split,
)
from sglang_nsa_cp.layout.split import plan_split  # noqa: E402

register_cpu_ci(est_time=168, suite="nsa-cp-test-cpu")

NUM_RANDOM_BATCHES = 250  # per mode
MAX_LEN = 4000
MAX_PREFIX = 6000


# ---- batch generation ------------------------------------------------------------------------
def _random_extend(rng: random.Random, low: int) -> int:
    """Mix tiny lengths (remainder corner cases near the minimum) with long ones."""
    kind = rng.random()
    if kind < 0.35:
        return rng.randint(low, low + 40)
    if kind < 0.5:
        return low * rng.randint(1, 50)  # exact multiples of the chunk count
    return rng.randint(low, MAX_LEN)


def _random_prefix(rng: random.Random) -> int:
    return 0 if rng.random() < 0.3 else rng.randint(1, MAX_PREFIX)


def random_batches(mode: str, count: int, seed: int):
    """`count` batches (extend_lens, prefix_lens, cp_size) SGLang's `can_apply` accepts
    (cp_size 1 aside, which SGLang never runs through CP)."""
    rng = random.Random(seed)
    out = []
    cp_sizes = list(range(1, 9))
    while len(out) < count:
        cp_size = cp_sizes[len(out) % len(cp_sizes)]  # every N in 1..8, odd ones included
        bs = rng.randint(1, 6)
        low = 2 * cp_size if mode == "zigzag" else 1
        extend = [_random_extend(rng, low) for _ in range(bs)]
        if mode == "interleave" and sum(extend) < cp_size:
            continue
        prefix = [_random_prefix(rng) for _ in range(bs)]
        out.append((extend, prefix, cp_size))
    return out


EDGE_BATCHES = {
    "zigzag": [
        ([37, 20], [0, 0], 4),  # the internals doc's worked example
        ([8], [0], 4),  # exactly 2N: one token per chunk
        ([6, 6, 6], [3, 0, 64], 3),
        ([16, 17, 31], [0, 1, 2], 8),
        ([2], [0], 1),
        ([1], [0], 1),
        ([4000] * 6, [6000] * 6, 7),
        ([14, 4000, 14], [0, 100, 5], 7),
    ],
    "interleave": [
        ([37, 20], [0, 0], 4),
        ([1, 1, 1], [0, 5, 9], 3),  # exactly N tokens, one per request
        ([5], [0], 5),
        ([3, 4], [10, 0], 7),
        ([1], [0], 1),
        ([7, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], 8),
        ([4000] * 6, [6000] * 6, 8),
        ([4001, 3, 2], [0, 77, 1], 6),
    ],
}


# ---- the comparison --------------------------------------------------------------------------
def assert_plan_matches_sglang(plan, ref, check_gather: bool = True) -> None:
    n = plan.cp_size
    assert ref.cp_size == n
    where = f"{plan.mode} extend={list(plan.extend_lens)} prefix={list(plan.prefix_lens)} N={n}"
    num_tokens = plan.num_tokens
    logical = ref.metadata[0].per_rank_logical_token
    for meta in ref.metadata:
        assert meta.per_rank_logical_token == logical
        assert meta.total_seq_lens == num_tokens and meta.bs == plan.batch_size
    assert list(plan.counts) == list(logical), f"{where}: counts {plan.counts} vs {logical}"

    for r in range(n):
        ours = plan.token_indices(r)
        theirs = ref.rank_tokens(r)
        assert ours.dtype == torch.long
        assert torch.equal(ours, theirs.to(torch.long)), (
            f"{where}: rank {r} tokens differ; first mismatch at local row "
            f"{_first_mismatch(ours, theirs)}\nours  ={ours.tolist()[:40]}\n"
            f"sglang={theirs.tolist()[:40]}"
        )
        rank = ref.ranks[r]
        count = plan.counts[r]
        assert torch.equal(plan.positions(r), rank.positions[:count]), f"{where}: rank {r} positions"
        assert torch.all(rank.positions[count:] == 0)
        if rank.local_q_indices is not None or rank.cp_active:
            assert torch.equal(ours, rank.local_q_indices), f"{where}: rank {r} local_q_indices"
        if plan.mode == "zigzag":
            _assert_zigzag_attention_meta(plan, rank.metadata, r, where)

    if check_gather:
        _assert_gather_matches(plan, ref, where)


def _first_mismatch(a: torch.Tensor, b: torch.Tensor):
    m = min(a.numel(), b.numel())
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0]) if diff.numel() else f"(length {a.numel()} vs {b.numel()})"


def _assert_zigzag_attention_meta(plan, meta, r, where):
    """Per request, rank r's tokens are SGLang's front chunk then back chunk, and their causal
    KV lengths end where SGLang's `kv_len_prev` / `kv_len_next` (prefix included) say."""
    kv = plan.kv_lens(r)
    req = plan.request_ids(r)
    pos = plan.positions(r)
    for i in range(plan.batch_size):
        sel = (req == i).nonzero().flatten()
        q_prev = meta.actual_seq_q_prev_list[i]
        q_next = meta.actual_seq_q_next_list[i]
        assert sel.numel() == q_prev + q_next, f"{where}: rank {r} req {i} query count"
        for part, kv_len in (
            (sel[:q_prev], meta.kv_len_prev_list[i]),
            (sel[q_prev:], meta.kv_len_next_list[i]),
        ):
            if part.numel() == 0:
                continue
            # one contiguous run of the local order, of consecutive positions
            assert torch.equal(part, torch.arange(int(part[0]), int(part[0]) + part.numel()))
            p = pos[part]
            assert torch.equal(p, torch.arange(int(p[0]), int(p[0]) + p.numel())), where
            assert int(kv[part].max()) == kv_len, (
                f"{where}: rank {r} req {i} kv_len {int(kv[part].max())} vs sglang {kv_len}"
            )


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    assert x.shape[0] <= rows
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _assert_gather_matches(plan, ref, where):
    n = plan.cp_size
    expected = torch.arange(1, plan.num_tokens + 1)
    physical = [m.per_rank_actual_token[r] for r, m in enumerate(ref.metadata)]

    # SGLang's gather over OUR local shards (token+1, zero padded as shard_hidden_states pads).
    ours_local = [_padded(plan.token_indices(r) + 1, physical[r]) for r in range(n)]
    outputs, gathered = sglang_gather(ref, ours_local)
    for r, out in enumerate(outputs):
        assert torch.equal(out, expected), f"{where}: SGLang gather on rank {r} of our shards"

    # Our padded rank-major gather, and our rerange_index, against SGLang's raw buffer.
    ours_gathered = torch.cat([_padded(plan.token_indices(r) + 1, plan.max_count) for r in range(n)])
    assert torch.equal(ours_gathered.index_select(0, plan.rerange_index), expected), where
    stride = gathered.shape[0] // n
    assert stride * n == gathered.shape[0] and stride >= plan.max_count
    if plan.mode == "zigzag":
        # zigzag all-gathers at max(logical) rows per rank: exactly our layout
        assert stride == plan.max_count, f"{where}: stride {stride} vs {plan.max_count}"
        assert torch.equal(gathered, ours_gathered), f"{where}: raw all-gather buffer"
        assert torch.equal(gathered.index_select(0, plan.rerange_index), expected), where
    else:
        # interleave all-gathers at the physical (padded) length: same rows, wider stride
        rows = gathered.view(n, stride)
        assert torch.all(rows[:, plan.max_count :] == 0)
        assert torch.equal(rows[:, : plan.max_count].reshape(-1), ours_gathered), where
        rank, row = plan.rerange_index // plan.max_count, plan.rerange_index % plan.max_count
        assert torch.equal(gathered.index_select(0, rank * stride + row), expected), where


def _check(mode, extend, prefix, cp_size, require_active=True, check_gather=True):
    plan = plan_split(extend, prefix, cp_size, mode)
    ref = sglang_split(mode, extend, prefix, cp_size, require_active=require_active)
    assert_plan_matches_sglang(plan, ref, check_gather=check_gather)
    return plan, ref


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["zigzag", "interleave"])
def test_random_batches_match_sglang(mode):
    batches = random_batches(mode, NUM_RANDOM_BATCHES, seed=20260523 + len(mode))
    seen_n = set()
    active = 0
    for extend, prefix, cp_size in batches:
        _, ref = _check(mode, extend, prefix, cp_size)
        seen_n.add(cp_size)
        active += ref.ranks[0].cp_active
    assert seen_n == set(range(1, 9))
    # both branches of SGLang's `_interleave_shard` (T % N == 0: view; else arange) are hit
    divisible = {sum(e) % n == 0 for e, _, n in batches if n > 2}
    assert divisible == {True, False}
    assert active == sum(1 for b in batches if b[2] > 1)  # SGLang really ran CP on all N > 1


@pytest.mark.parametrize(
    "mode,extend,prefix,cp_size",
    [(m, *b) for m, bs in EDGE_BATCHES.items() for b in bs],
)
def test_edge_batches_match_sglang(mode, extend, prefix, cp_size):
    _check(mode, extend, prefix, cp_size)


def test_zigzag_worked_example_from_internals_doc():
    plan, _ = _check("zigzag", [37, 20], [0, 0], 4)
    expected = list(range(0, 5)) + [37, 38, 39] + list(range(33, 37)) + [55, 56]
    assert plan.token_indices(0).tolist() == expected


def test_zigzag_outside_can_apply_still_matches_sglang_build_metadata():
    """SGLang refuses zigzag CP when some extend length is < 2N (`can_apply` False, asserted
    here). Our plan still splits such batches; compare with SGLang's strategy methods called
    directly (empty chunks allowed)."""
    rng = random.Random(7)
    for _ in range(60):
        cp_size = rng.randint(2, 8)
        bs = rng.randint(1, 6)
        extend = [rng.randint(1, 2 * cp_size + 5) for _ in range(bs)]
        extend[rng.randrange(bs)] = rng.randint(1, 2 * cp_size - 1)
        prefix = [_random_prefix(rng) for _ in range(bs)]
        _, ref = _check("zigzag", extend, prefix, cp_size, require_active=False)
        assert not ref.ranks[0].cp_active
    _, ref = _check("zigzag", [15, 16, 17], [0, 1, 2], 8, require_active=False)
    assert not ref.ranks[0].cp_active


def test_interleave_outside_can_apply_still_matches_sglang_build_metadata():
    """SGLang refuses interleave CP when the batch has fewer tokens than ranks."""
    for cp_size in range(2, 9):
        for total in range(1, cp_size):
            extend = [1] * total
            _, ref = _check("interleave", extend, [0] * total, cp_size, require_active=False)
            assert not ref.ranks[0].cp_active


def test_interleave_per_request_q_lens_match_sglang_shard_per_request():
    """`shard_per_request` (CPU loop and its triton kernel) gives each rank's per-request query
    counts over the non-empty requests; they must equal our plan's."""
    for extend, prefix, cp_size in random_batches("interleave", 40, seed=11) + [
        ([1, 1, 1, 5, 2], [0] * 5, 4),
        ([3, 4], [0, 0], 7),
    ]:
        plan = plan_split(extend, prefix, cp_size, "interleave")
        for r in range(cp_size):
            counts = torch.bincount(plan.request_ids(r), minlength=len(extend))
            ids = counts.nonzero().flatten()
            q_cpu, q_dev, bs_cpu, bs_dev = sglang_interleave_q_lens(cp_size, r, extend)
            where = f"extend={extend} N={cp_size} rank={r}"
            assert q_cpu == counts[ids].tolist(), where
            assert bs_cpu == ids.tolist(), where
            assert q_dev.tolist() == q_cpu and bs_dev.tolist() == bs_cpu, where


def test_sglang_harness_round_trip():
    """The harness itself: SGLang's gather of SGLang's own shards gives the flat batch."""
    for mode, (extend, prefix, cp_size) in [
        ("zigzag", ([37, 20, 100], [3, 0, 9], 5)),
        ("interleave", ([37, 20, 100], [3, 0, 9], 5)),
    ]:
        ref = sglang_split(mode, extend, prefix, cp_size)
        outputs, _ = sglang_gather(ref, [r.shard for r in ref.ranks])
        for out in outputs:
            assert torch.equal(out, torch.arange(1, sum(extend) + 1))
        pos = flat_positions(extend, prefix)
        for r in ref.ranks:
            assert torch.equal(r.positions[: r.tokens.numel()], pos[r.tokens])


# ---- the comparison can fail -----------------------------------------------------------------
def _tampered(plan, rank_tokens):
    return dataclasses.replace(plan, rank_tokens=tuple(rank_tokens))


def _tamperings(plan):
    n = plan.cp_size
    ranks = list(plan.rank_tokens)
    yield "rotated ranks (each rank gets another rank's tokens)", ranks[1:] + ranks[:1]
    bad = list(ranks)
    bad[0] = bad[0].flip(0)
    yield "rank 0 in reversed local order", bad
    bad = list(ranks)
    bad[n - 1] = torch.cat([bad[n - 1][1:], bad[n - 1][:1]])
    yield "last rank's local order rotated by one", bad
    bad = [t.clone() for t in ranks]
    bad[0][-1], bad[1][0] = int(ranks[1][0]), int(ranks[0][-1])
    yield "one token swapped between ranks 0 and 1", bad


@pytest.mark.parametrize("mode", ["zigzag", "interleave"])
def test_wrong_plans_are_rejected(mode):
    extend, prefix, cp_size = [37, 20, 64], [0, 5, 130], 4
    plan = plan_split(extend, prefix, cp_size, mode)
    ref = sglang_split(mode, extend, prefix, cp_size)
    assert_plan_matches_sglang(plan, ref)
    for label, ranks in _tamperings(plan):
        with pytest.raises(AssertionError):
            assert_plan_matches_sglang(_tampered(plan, ranks), ref)
        # even with the token comparison skipped, SGLang's gather exposes it
        with pytest.raises(AssertionError):
            _assert_gather_matches(_tampered(plan, ranks), ref, label)
    other = "interleave" if mode == "zigzag" else "zigzag"
    with pytest.raises(AssertionError):
        assert_plan_matches_sglang(plan_split(extend, prefix, cp_size, other), ref)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
