"""The shared KV cache of a CP group: sharded store, direct write, materialize, current reuse.

The original design called this `cp_shared_kv_runtime`.
"""

from sglang_nsa_cp.shared_kv.materialize import DenseLayout, build_dense_layout, materialize_index, materialize_latent
from sglang_nsa_cp.shared_kv.prefetch import HistoryPrefetcher
from sglang_nsa_cp.shared_kv.store import KVStore, KVStoreError

__all__ = [
    "DenseLayout",
    "HistoryPrefetcher",
    "KVStore",
    "KVStoreError",
    "build_dense_layout",
    "materialize_index",
    "materialize_latent",
]
