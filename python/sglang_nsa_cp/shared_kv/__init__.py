"""The shared KV cache of a CP group: sharded store, per-batch dense plan, materialize and
one-layer-ahead prefetch, current reuse. The same code runs under the SGLang plugin's pool and
under the reference CP path.

The original design called this `cp_shared_kv_runtime`.
"""

from sglang_nsa_cp.shared_kv.materialize import add_current_index, add_current_latent, gather_history_pages
from sglang_nsa_cp.shared_kv.plan import DensePlan, PlanError, build_dense_plan
from sglang_nsa_cp.shared_kv.prefetch import HistoryPrefetcher, LayerView
from sglang_nsa_cp.shared_kv.store import KVStore, KVStoreError

__all__ = [
    "DensePlan",
    "HistoryPrefetcher",
    "KVStore",
    "KVStoreError",
    "LayerView",
    "PlanError",
    "add_current_index",
    "add_current_latent",
    "build_dense_plan",
    "gather_history_pages",
]
