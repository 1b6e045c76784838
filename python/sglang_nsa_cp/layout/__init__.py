"""Temporary re-export: the split plans are gone; the plugin's tail gather needs only where each
request's last token sits under SGLang's interleave split, which is `comm.tail`.

Kept only because `sglang_ext/layers/cp/utils.py` still calls `plan_split(..., "interleave")`;
delete once it calls `sglang_nsa_cp.comm.plan_tail(extend_lens, cp_size)`.
"""

from __future__ import annotations

from typing import Sequence

from sglang_nsa_cp.comm.tail import TailPlan, plan_tail


def plan_split(extend_lens: Sequence[int], prefix_lens: Sequence[int], cp_size: int, mode: str) -> TailPlan:
    """`comm.plan_tail(extend_lens, cp_size)`; only the interleave split exists."""
    if mode != "interleave":
        raise ValueError(f"split mode {mode!r}: only 'interleave' (SGLang's) is planned here, by comm.plan_tail")
    if len(prefix_lens) != len(extend_lens):
        raise ValueError(f"extend_lens has {len(extend_lens)} requests but prefix_lens has {len(prefix_lens)}")
    return plan_tail(extend_lens, cp_size)


__all__ = ["plan_split"]
