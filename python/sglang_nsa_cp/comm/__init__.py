"""The narrow tail gather of the SGLang plugin's `layers/cp/utils.py` hook: its plan (`tail`) and
its collective (`collectives`), with a byte counter for tests."""

from sglang_nsa_cp.comm.collectives import TrafficCounter, all_gather_rows, gather_last_token_hidden
from sglang_nsa_cp.comm.tail import TailPlan, plan_tail

__all__ = ["TailPlan", "TrafficCounter", "all_gather_rows", "gather_last_token_hidden", "plan_tail"]
