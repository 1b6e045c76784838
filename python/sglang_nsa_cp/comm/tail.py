"""The narrow tail gather's plan: where each request's last token sits under SGLang's interleave split.

SGLang's interleave CP split gives flat token i of a prefill batch to rank i % N, at local row
i // N (test/comm/test_tail.py checks this against SGLang's own metadata). Only each request's
last token feeds the logits, so the tail gathers one row per request per rank instead of every
token's hidden state::

    N = 2, extend_lens = [3, 4]: flat tokens 0 1 2 | 3 4 5 6, last tokens 2 and 6
    rank 0 computes 0 2 4 6 (local rows 0 1 2 3)  rank 1 computes 1 3 5
    last_token_rank         = [0, 0]
    last_token_local_rows(0) = [1, 3]     last_token_local_rows(1) = [-1, -1]
    gathered rows (rank-major, bs per rank): [r0 req0, r0 req1, r1 req0, r1 req1]
    last_token_gather_index = [0, 1]

Every rank builds the same plan from the same lengths; nothing in it is rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host-built tensor to `device` without stalling the host: a copy from pageable
    memory waits for the device stream to drain, one from pinned memory is queued like a kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class TailPlan:
    """Each request's last new token under the interleave split of one batch over `cp_size` ranks."""

    cp_size: int
    extend_lens: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @cached_property
    def last_tokens(self) -> torch.Tensor:
        """Flat-batch index of each request's last new token, [bs] int64."""
        return torch.cumsum(torch.tensor(self.extend_lens, dtype=torch.long), 0) - 1

    @cached_property
    def last_token_rank(self) -> torch.Tensor:
        """The rank that computes each request's last new token, [bs] int64."""
        return self.last_tokens % self.cp_size

    @cached_property
    def last_token_gather_index(self) -> torch.Tensor:
        """Row of each request's last token in the narrow tail gather ([N * bs] rank-major)."""
        return self.last_token_rank * self.batch_size + torch.arange(self.batch_size)

    def last_token_local_rows(self, rank: int) -> torch.Tensor:
        """For each request, the local row of its last token on `rank`, or -1 elsewhere; [bs] int64."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is outside the CP group of size {self.cp_size}")
        rows = self.last_tokens // self.cp_size
        return torch.where(self.last_token_rank == rank, rows, torch.full_like(rows, -1))

    def device_tensor(self, name: str, device: torch.device | str, *args: int) -> torch.Tensor:
        """A plan tensor (a property, or a per-rank method called with `args`) on `device`, copied
        once per plan and device."""
        key = (name, str(device), args)
        if key not in self._device_cache:
            value = getattr(self, name)
            self._device_cache[key] = host_to_device(value(*args) if args else value, device)
        return self._device_cache[key]

    @cached_property
    def _device_cache(self) -> dict:
        return {}


def plan_tail(extend_lens: Sequence[int], cp_size: int) -> TailPlan:
    """The tail plan of a batch with `extend_lens[i]` new tokens in request i, split over `cp_size` ranks."""
    extend_lens = tuple(int(n) for n in extend_lens)
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    if not extend_lens:
        raise ValueError("a batch needs at least one request")
    bad = [i for i, n in enumerate(extend_lens) if n < 1]
    if bad:
        raise ValueError(f"requests {bad} have no new tokens; every extend length must be >= 1")
    return TailPlan(cp_size=cp_size, extend_lens=extend_lens)
