"""The narrow tail gather over a torch.distributed group: the same code on gloo (CPU) and NCCL (GPU).

- `all_gather_rows`: equal-size all-gather of each rank's rows, padded to a common count.
- `gather_last_token_hidden`: the narrow tail gather (the original `cp_collect_last_token_hidden`):
  N x bs x hidden elements instead of total_tokens x hidden, placed by a `tail.TailPlan`.

Every call adds the bytes it gathers (the full gathered result, i.e. N times one rank's
contribution) to an optional `TrafficCounter` under a kind name, so tests can state traffic
exactly. float8 tensors travel as uint8 views (gloo has no float8).
"""

from __future__ import annotations

from collections import defaultdict
import torch
import torch.distributed as dist

from sglang_nsa_cp.comm.tail import TailPlan


def _all_gather_single(*args, **kwargs):
    # torch 2.13 renamed all_gather_into_tensor; the GPU nodes' torch may predate the new name.
    # Looked up per call, so a test can wrap torch.distributed's functions to record collectives.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


class TrafficCounter:
    """Bytes gathered and calls issued, per collective kind; `events` keeps every call in order."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: list[tuple[str, int]] = []  # (kind, bytes) in issue order

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.events.append((kind, nbytes))

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"bytes": self.bytes[k], "calls": self.calls[k]} for k in sorted(self.bytes)}


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _launch_all_gather(local, rows_per_rank, group, counter, kind, out, async_op):
    if local.shape[0] > rows_per_rank:
        raise ValueError(f"{local.shape[0]} local rows exceed rows_per_rank={rows_per_rank}")
    world = dist.get_world_size(group)
    send = local
    if local.shape[0] != rows_per_rank or not local.is_contiguous():
        send = local.new_empty((rows_per_rank, *local.shape[1:]))
        send[: local.shape[0]] = local
    if out is None:
        out = local.new_empty((world * rows_per_rank, *local.shape[1:]))
    work = _all_gather_single(_wire_view(out), _wire_view(send), group=group, async_op=async_op)
    if counter is not None:
        counter.add(kind, out.numel() * out.element_size())
    return out, work


def all_gather_rows(
    local: torch.Tensor,
    rows_per_rank: int,
    group: dist.ProcessGroup,
    counter: TrafficCounter | None = None,
    kind: str = "rows",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather every rank's `local` rows, each padded to `rows_per_rank`, rank-major.

    Returns (or fills `out`, which must be contiguous) [world * rows_per_rank, ...]; rank r's row
    j is at r * rows_per_rank + j. Padding rows hold unspecified values.
    """
    return _launch_all_gather(local, rows_per_rank, group, counter, kind, out, async_op=False)[0]


def gather_last_token_hidden(
    local_hidden: torch.Tensor,
    plan: TailPlan,
    rank: int,
    group: dist.ProcessGroup,
    counter: TrafficCounter | None = None,
) -> torch.Tensor:
    """Each request's last-token hidden state, in request order [bs, hidden], on every rank.

    Every rank contributes one row per request (its own last-token row where it computed that
    token, an arbitrary row elsewhere); the owner's row is picked after the gather.
    """
    device = local_hidden.device
    rows = plan.device_tensor("last_token_local_rows", device, rank).clamp_min(0)
    if local_hidden.shape[0] == 0:  # a rank with no tokens still joins the collective
        local_hidden = local_hidden.new_zeros((1, *local_hidden.shape[1:]))
    narrow = local_hidden.index_select(0, rows)
    gathered = all_gather_rows(narrow, plan.batch_size, group, counter, "tail_narrow")
    return gathered.index_select(0, plan.device_tensor("last_token_gather_index", device))
