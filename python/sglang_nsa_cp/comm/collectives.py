"""The narrow tail gather over a torch.distributed group: the same code on gloo (CPU) and NCCL (GPU).

`gather_last_token_hidden` (the original `cp_collect_last_token_hidden`) moves N x bs x hidden
elements instead of total_tokens x hidden, placed by a `tail.TailPlan`. float8 tensors travel as
uint8 views (gloo has no float8).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_nsa_cp.comm.tail import TailPlan

_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def _all_gather_single(*args, **kwargs):
    # torch 2.13 renamed all_gather_into_tensor; the GPU nodes' torch may predate the new name.
    # Looked up per call, so a test can wrap torch.distributed's functions to record collectives.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `local` rows (the same count on every rank), rank-major: rank r's row j is at
    r * len(local) + j."""
    local = local.contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    _all_gather_single(_wire_view(out), _wire_view(local), group=group)
    return out


def gather_last_token_hidden(local_hidden: torch.Tensor, plan: TailPlan, rank: int, group) -> torch.Tensor:
    """Each request's last-token hidden state, in request order [bs, hidden], on every rank.

    Every rank contributes one row per request (its own last-token row where it computed that
    token, an arbitrary row elsewhere); the owner's row is picked after the gather.
    """
    device = local_hidden.device
    rows = plan.device_tensor("last_token_local_rows", device, rank).clamp_min(0)
    if local_hidden.shape[0] == 0:  # a rank with no tokens still joins the collective
        local_hidden = local_hidden.new_zeros((1, *local_hidden.shape[1:]))
    gathered = all_gather_rows(local_hidden.index_select(0, rows), group)
    return gathered.index_select(0, plan.device_tensor("last_token_gather_index", device))
