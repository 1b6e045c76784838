"""Reference DSA model in plain torch: the correctness oracle, demo model and GPU workload.

``DSAModel.forward(input_ids, positions, request_ids, kv)`` calls ``kv.begin_layer(...)`` and
``kv.finish_layer(...)`` once per layer; that KV seam is where the single-rank cache (:class:`SlotKVCache`), replicated CP and
shared-KV CP plug in.
"""

from .config import CONFIGS, DSAConfig, get_config
from .model import (
    DenseKV,
    DSAModel,
    KVContext,
    SynchronousKV,
    apply_rope,
    dequantize_index_key,
    index_scores,
    quantize_index_key,
    select_topk,
    sparse_mla,
)
from .single import SlotBatch, SlotKVCache, decode_step, prefill_single

__all__ = [
    "CONFIGS",
    "DSAConfig",
    "DSAModel",
    "DenseKV",
    "KVContext",
    "SlotBatch",
    "SlotKVCache",
    "SynchronousKV",
    "apply_rope",
    "decode_step",
    "dequantize_index_key",
    "get_config",
    "index_scores",
    "prefill_single",
    "quantize_index_key",
    "select_topk",
    "sparse_mla",
]
