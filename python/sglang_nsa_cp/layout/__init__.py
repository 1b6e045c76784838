"""Split plans, ownership and the owner-classed allocator. Torch only."""

from sglang_nsa_cp.layout.split import SPLIT_MODES, SplitError, SplitPlan, plan_split

__all__ = ["SPLIT_MODES", "SplitError", "SplitPlan", "plan_split"]
