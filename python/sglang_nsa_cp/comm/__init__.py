"""The narrow tail gather of the SGLang plugin's `layers/cp/utils.py` hook: its plan (`tail`) and
its collective (`collectives`), with a byte counter for tests."""

from sglang_nsa_cp.comm.collectives import TrafficCounter, all_gather_rows, gather_last_token_hidden
from sglang_nsa_cp.comm.tail import TailPlan, plan_tail

__all__ = ["TailPlan", "TrafficCounter", "all_gather_rows", "gather_last_token_hidden", "plan_tail"]

# Temporary: test files outside this change still import the rank launcher from here; it lives in
# test/helpers/distributed.py (needs test/ on sys.path). Remove once they import helpers.distributed.
_MOVED_TO_TEST_HELPERS = {"RankFailure", "RankPool", "free_port", "run_ranks"}


def __getattr__(name: str):
    if name in _MOVED_TO_TEST_HELPERS:
        from helpers import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'sglang_nsa_cp.comm' has no attribute {name!r}")
