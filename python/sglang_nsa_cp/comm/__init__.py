"""CP collectives over a torch.distributed group, byte counters, and a local rank launcher."""

from sglang_nsa_cp.comm.collectives import (
    TrafficCounter,
    all_gather_rerange,
    all_gather_rows,
    gather_full_hidden,
    gather_last_token_hidden,
    start_all_gather_rerange,
)
from sglang_nsa_cp.comm.launch import RankFailure, RankPool, run_ranks

__all__ = [
    "RankFailure",
    "RankPool",
    "TrafficCounter",
    "all_gather_rerange",
    "all_gather_rows",
    "gather_full_hidden",
    "gather_last_token_hidden",
    "run_ranks",
    "start_all_gather_rerange",
]
