"""Split plans, ownership and the owner-classed allocator. Torch only."""

from sglang_nsa_cp.layout.ownership import (
    ExtendBatch,
    OutOfPages,
    OwnerClassedAllocator,
    RequestPageTable,
    local_page,
    page_owner,
)
from sglang_nsa_cp.layout.split import SPLIT_MODES, SplitError, SplitPlan, host_to_device, plan_split

__all__ = [
    "SPLIT_MODES",
    "ExtendBatch",
    "OutOfPages",
    "OwnerClassedAllocator",
    "RequestPageTable",
    "SplitError",
    "SplitPlan",
    "host_to_device",
    "local_page",
    "page_owner",
    "plan_split",
]
