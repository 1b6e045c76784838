"""The narrow tail gather: where each request's last token sits under SGLang's interleave split
(`tail`) and its collective (`collectives`)."""

from sglang_nsa_cp.comm.collectives import all_gather_rows, gather_last_token_hidden
from sglang_nsa_cp.comm.tail import TailPlan, plan_tail

__all__ = ["TailPlan", "all_gather_rows", "gather_last_token_hidden", "plan_tail"]
