"""Run SGLang 0.5.23's own prefill-CP split and gather on CPU, as a reference for our plans.

Nothing here re-implements SGLang's algorithms: every token assignment, count, padding length
and gather order comes out of SGLang's code, driven through its real entry points:

- `sglang.srt.layers.cp.base.init_cp_strategy` installs the real `ZigzagCPStrategy` /
  `InterleaveCPStrategy` singleton (for cp_size 1, which `init_cp_strategy` refuses, the
  strategy object is installed directly; see `_installed_strategy`).
- `sglang.srt.layers.cp.utils.is_cp_active` -> the strategy's `can_apply`.
- `sglang.srt.layers.cp.utils.prepare_cp_forward` -> `strategy.build_metadata(num_tokens,
  seqs_len=prefix+extend, extend_seqs_len)` then `padding.pad_logical_token_to_physical`.
- `cp_shard_hidden_states` / `cp_shard_position_ids` -> `strategy.shard_hidden_states` /
  `shard_position_ids` (zigzag: split by `split_list`, pick `zigzag_index`, pad; interleave:
  `_interleave_shard`, pad).
- `cp_gather_after_forward` -> `strategy.gather_hidden_states` (zigzag:
  `_all_gather_reorganized` + `reverse_split_len` / `cp_reverse_index`; interleave:
  `_gather_interleaved_tensor`), with a simulated CP group, see `CollectiveSim`.
- `strategy.local_q_indices` and, for interleave, `strategy.shard_per_request`.

What is not real: the process group. The runtime context is patched per simulated rank with
`get_parallel().override(attn_cp_rank=r, attn_cp_size=N, attn_cp_group=<CollectiveSim>,
enable_cp_tp_group_sharing=False)`; the forward batch is a `SimpleNamespace` carrying exactly
the fields these functions read (`forward_mode`, `input_ids`, `seq_lens_cpu`,
`extend_seq_lens_cpu`, `attn_cp_metadata`, `global_num_tokens_cpu`, `out_cache_loc`).

The all-gather is simulated faithfully in two passes: every rank first calls SGLang's gather
with a recording group that stores the exact tensor that rank hands to
`all_gather_into_tensor`; then every rank calls it again with a group whose
`all_gather_into_tensor` checks it gets the same input and writes the rank-major concatenation
of all ranks' recorded inputs, i.e. what NCCL would produce.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

from sglang.srt.layers.cp import base as cp_base  # noqa: E402
from sglang.srt.layers.cp import utils as cp_utils  # noqa: E402
from sglang.srt.layers.cp.base import init_cp_strategy  # noqa: E402
from sglang.srt.layers.cp.interleave import InterleaveCPStrategy  # noqa: E402
from sglang.srt.layers.cp.padding import pad_logical_token_to_physical  # noqa: E402
from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

STRATEGY_CLASSES = {"zigzag": ZigzagCPStrategy, "interleave": InterleaveCPStrategy}


class CollectiveSim:
    """A stand-in for SGLang's `attn_cp_group` (a GroupCoordinator) for one simulated rank.

    record mode (`inputs is None`): store the rank's all-gather input, fill the output with a
    sentinel. replay mode: check the input against the recorded one and write the rank-major
    concatenation of every rank's recorded input.
    """

    SENTINEL = -(10**9)

    def __init__(self, world_size: int, rank: int, recorded: dict, inputs=None):
        self.world_size = world_size
        self.rank_in_group = rank
        self.recorded = recorded
        self.inputs = inputs
        self.calls = 0

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor):
        self.calls += 1
        if self.inputs is None:
            self.recorded[self.rank_in_group] = input.detach().clone()
            output.fill_(self.SENTINEL)
            return output
        assert torch.equal(input, self.inputs[self.rank_in_group]), "rank input changed"
        shapes = {tuple(t.shape) for t in self.inputs.values()}
        assert len(shapes) == 1, f"all-gather inputs of unequal shapes {shapes}"
        output.copy_(torch.cat([self.inputs[r] for r in range(self.world_size)], dim=0))
        return output


@contextmanager
def _installed_strategy(mode: str, cp_size: int):
    """Install SGLang's process-wide CP strategy singleton, restoring the old one on exit.

    `init_cp_strategy` is SGLang's own installer; it refuses cp_size <= 1 (no CP at all), so
    for cp_size 1 the strategy object is put in place directly.
    """
    saved = cp_base._STRATEGY
    try:
        if cp_size > 1:
            init_cp_strategy(enable_prefill_cp=True, cp_size=cp_size, cp_strategy=mode)
        else:
            cp_base._STRATEGY = STRATEGY_CLASSES[mode](cp_size=cp_size)
        strategy = cp_base.get_cp_strategy()
        assert isinstance(strategy, STRATEGY_CLASSES[mode]) and strategy.cp_size == cp_size
        yield strategy
    finally:
        cp_base._STRATEGY = saved


@contextmanager
def _as_rank(rank: int, cp_size: int, group: CollectiveSim):
    with get_parallel().override(
        attn_cp_rank=rank,
        attn_cp_size=cp_size,
        attn_cp_group=group,
        enable_cp_tp_group_sharing=False,
    ):
        yield


def _forward_batch(extend_lens, prefix_lens):
    num_tokens = sum(extend_lens)
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.arange(num_tokens),
        seq_lens_cpu=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)]),
        extend_seq_lens_cpu=list(extend_lens),
        attn_cp_metadata=None,
        global_num_tokens_cpu=None,
        out_cache_loc=None,
    )


@dataclass
class RankResult:
    """What SGLang produced on one simulated rank."""

    metadata: object
    cp_active: bool
    shard: torch.Tensor  # shard_hidden_states(arange(1, T+1)): token+1, 0 = padding
    positions: torch.Tensor  # shard_position_ids(positions), padded
    tokens: torch.Tensor  # flat token indices, padding stripped by per_rank_logical_token
    local_q_indices: torch.Tensor | None  # None: SGLang's local_q_indices raised (see below)


@dataclass
class SGLangSplit:
    mode: str
    cp_size: int
    extend_lens: tuple
    prefix_lens: tuple
    ranks: list  # RankResult per rank

    @property
    def metadata(self):
        return [r.metadata for r in self.ranks]

    def rank_tokens(self, rank: int) -> torch.Tensor:
        return self.ranks[rank].tokens


def flat_positions(extend_lens, prefix_lens) -> torch.Tensor:
    """Absolute position of each flat-batch token (input to shard_position_ids)."""
    return torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])


def sglang_split(
    mode: str,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    cp_size: int,
    require_active: bool = True,
) -> SGLangSplit:
    """Shard a batch with SGLang's strategy on every simulated rank.

    With `require_active`, SGLang must accept the batch for CP (`is_cp_active`, i.e.
    `can_apply`) whenever cp_size > 1, and the metadata comes from `prepare_cp_forward`.
    Otherwise (cp_size 1, or a batch `can_apply` rejects) the same strategy methods are called
    directly: `build_metadata`, `pad_logical_token_to_physical`, `shard_hidden_states`.
    """
    extend_lens, prefix_lens = tuple(extend_lens), tuple(prefix_lens)
    num_tokens = sum(extend_lens)
    hidden = torch.arange(1, num_tokens + 1)
    positions = flat_positions(extend_lens, prefix_lens)
    ranks = []
    with _installed_strategy(mode, cp_size) as strategy:
        for rank in range(cp_size):
            with _as_rank(rank, cp_size, CollectiveSim(cp_size, rank, {})):
                fb = _forward_batch(extend_lens, prefix_lens)
                active = cp_size > 1 and cp_utils.is_cp_active(fb)
                if require_active and cp_size > 1:
                    assert active, f"SGLang {mode} rejects batch {extend_lens} at cp={cp_size}"
                if active:
                    cp_utils.prepare_cp_forward(fb)
                    shard = cp_utils.cp_shard_hidden_states(hidden, fb)
                    pos = cp_utils.cp_shard_position_ids(positions, fb)
                else:
                    fb.attn_cp_metadata = strategy.build_metadata(
                        num_tokens=num_tokens,
                        seqs_len=[p + e for p, e in zip(prefix_lens, extend_lens)],
                        extend_seqs_len=list(extend_lens),
                    )
                    pad_logical_token_to_physical(fb.attn_cp_metadata)
                    shard = strategy.shard_hidden_states(hidden, fb)
                    pos = strategy.shard_position_ids(positions, fb)
                meta = fb.attn_cp_metadata
                logical = meta.per_rank_logical_token[rank]
                physical = meta.per_rank_actual_token[rank]
                assert shard.shape[0] == physical, (shard.shape, physical)
                assert torch.all(shard[logical:] == 0), "padding rows are not zero"
                try:
                    q_idx = strategy.local_q_indices(num_tokens, fb)
                except RuntimeError:
                    # interleave's torch.arange(rank, T, N) raises for rank > T, which only a
                    # batch with fewer tokens than ranks (rejected by can_apply) reaches
                    if active:
                        raise
                    q_idx = None
                ranks.append(
                    RankResult(
                        metadata=meta,
                        cp_active=active,
                        shard=shard,
                        positions=pos,
                        tokens=shard[:logical] - 1,
                        local_q_indices=q_idx,
                    )
                )
    return SGLangSplit(mode, cp_size, extend_lens, prefix_lens, ranks)


def sglang_gather(split: SGLangSplit, local_rows: Sequence[torch.Tensor]):
    """Run SGLang's gather (`cp_gather_after_forward`) over simulated ranks.

    `local_rows[r]` is the tensor rank r hands to the gather (its local shard, padded to the
    physical length as `shard_hidden_states` leaves it). Returns `(outputs, gathered)`: each
    rank's gathered result in flat order, and the raw rank-major all-gather buffer.
    """
    n = split.cp_size
    recorded: dict = {}
    outputs = []
    with _installed_strategy(split.mode, n) as strategy:

        def gather(rank, group):
            with _as_rank(rank, n, group):
                fb = _forward_batch(split.extend_lens, split.prefix_lens)
                fb.attn_cp_metadata = split.ranks[rank].metadata
                if split.ranks[rank].cp_active:
                    return cp_utils.cp_gather_after_forward(local_rows[rank], fb)
                return strategy.gather_hidden_states(local_rows[rank], fb)

        for rank in range(n):  # pass 1: record each rank's all-gather input
            group = CollectiveSim(n, rank, recorded)
            gather(rank, group)
            assert group.calls == 1
        assert sorted(recorded) == list(range(n))
        for rank in range(n):  # pass 2: the collective's real output
            group = CollectiveSim(n, rank, recorded, inputs=recorded)
            outputs.append(gather(rank, group))
            assert group.calls == 1
    gathered = torch.cat([recorded[r] for r in range(n)], dim=0)
    return outputs, gathered


def sglang_interleave_q_lens(cp_size: int, rank: int, extend_lens: Sequence[int]):
    """`InterleaveCPStrategy.shard_per_request` on one rank: (q_lens_cpu, bs_idx_cpu, q_lens,
    bs_idx); the last two come from SGLang's triton kernel (interpreted on CPU)."""
    strategy = InterleaveCPStrategy(cp_size=cp_size)
    with _as_rank(rank, cp_size, CollectiveSim(cp_size, rank, {})):
        return strategy.shard_per_request(list(extend_lens), torch.tensor(list(extend_lens), dtype=torch.int32))
