"""Temporary re-export: the rank launcher is test/helpers/distributed.py (needs test/ on sys.path).

Kept only for test files outside this change that still import `sglang_nsa_cp.comm.launch`;
delete once they import `helpers.distributed`.
"""

from helpers.distributed import RankFailure, RankPool, free_port, run_ranks

__all__ = ["RankFailure", "RankPool", "free_port", "run_ranks"]
