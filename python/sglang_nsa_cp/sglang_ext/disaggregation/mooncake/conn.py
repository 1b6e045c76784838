"""Owned-page PD transfer: the Mooncake manager's queue and its index-K (DSA state) send. Mirrors
`sglang/srt/disaggregation/mooncake/conn.py`; see `../common/conn.py` for the whole picture.

Targets (act only on a shared-KV prefill manager, `ledger_of(mgr)` not None):

- `MooncakeKVManager.add_transfer_request` (AROUND): records the KV pages handed to the transfer
  queue (request positions, local page ids) for the rank's self-check and manifest, and fails the
  room with a reason, instead of queueing, when a decode destination list is shorter than the
  positions it must hold (SGLang's worker would index past its end and stop the transfer thread).
- `MooncakeKVManager.maybe_send_extra` (AROUND): records the index-K pages this rank owns, which
  SGLang's sharded send (`_prepare_sharded_dsa_indices`) then ships from its local pages p // N to
  the decode pages at their positions, and fails the room with a reason when the decode's list
  does not pair with the prefill's (SGLang would raise in its transfer thread).
"""

from __future__ import annotations

import logging

import numpy as np

from sglang_nsa_cp.sglang_ext.disaggregation.common.conn import ledger_of

logger = logging.getLogger(__name__)


def _positions(index_slice) -> np.ndarray:
    if isinstance(index_slice, slice):
        return np.arange(index_slice.start or 0, index_slice.stop, dtype=np.int64)
    return np.asarray(index_slice, dtype=np.int64)


def queue_owned_kv_pages(original, self, bootstrap_room, kv_indices, index_slice, is_last_chunk, *args, **kwargs):
    """AROUND `MooncakeKVManager.add_transfer_request` (prefill)."""
    ledger = ledger_of(self)
    if ledger is None:
        return original(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, *args, **kwargs)
    from sglang.srt.disaggregation.base.conn import KVPoll, StateType

    live = (
        bootstrap_room in self.request_status
        and self.check_status(bootstrap_room) != KVPoll.Failed
        and bootstrap_room in self.transfer_infos
    )
    if live:
        positions = _positions(index_slice)
        local = kv_indices.numpy() if hasattr(kv_indices, "numpy") else np.asarray(kv_indices)
        if positions.size:
            need = int(positions.max()) + 1
            for info in list(self.transfer_infos[bootstrap_room].values()):
                if not info.is_dummy and len(info.dst_kv_indices) < need:
                    self.conclude_failure(
                        bootstrap_room=bootstrap_room,
                        failure_reason=(
                            f"owned-page transfer of room {bootstrap_room}: decode {info.endpoint}:{info.dst_port} "
                            f"sent {len(info.dst_kv_indices)} destination pages, CP rank {ledger.rank} must "
                            f"write position {need - 1}"
                        ),
                    )
                    return None
        ledger.queue_kv(bootstrap_room, positions, local)
        state_indices = kwargs.get("state_indices", args[1] if len(args) > 1 else None)
        if is_last_chunk and state_indices:
            types = getattr(self.kv_args, "state_types", [])
            dsa = [i for i, st in enumerate(types) if st == StateType.DSA]
            if any(i < len(state_indices) and state_indices[i] is not None for i in dsa):
                ledger.expect_index(bootstrap_room)
    return original(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, *args, **kwargs)


def send_owned_index_pages(original, self, req, prefill_state_indices, executor, *args, **kwargs):
    """AROUND `MooncakeKVManager.maybe_send_extra` (prefill, last chunk, per decode destination)."""
    ledger = ledger_of(self)
    if ledger is None:
        return original(self, req, prefill_state_indices, executor, *args, **kwargs)
    from sglang.srt.disaggregation.base.conn import StateType

    types = list(getattr(self.kv_args, "state_types", []))
    indices = list(prefill_state_indices)
    dst_lists = list(req.dst_state_indices)
    for i, st in enumerate(types):
        if i >= len(indices) or indices[i] is None:
            continue
        if st != StateType.DSA:
            self.conclude_failure(
                bootstrap_room=req.room,
                failure_reason=f"owned-page transfer: state {st.value} is not supported with shared KV",
            )
            return -1
        full = np.asarray(indices[i], dtype=np.int64)
        dst = np.asarray(dst_lists[i] if i < len(dst_lists) else [], dtype=np.int64)
        if len(full) != len(dst):
            self.conclude_failure(
                bootstrap_room=req.room,
                failure_reason=(
                    f"owned-page transfer of room {req.room}: {len(full)} index-K pages on the prefill, "
                    f"{len(dst)} destination pages from decode {req.endpoint}:{req.dst_port}"
                ),
            )
            return -1
        mine = ledger.owned(full)
        ledger.record_index(req.room, len(full), np.nonzero(mine)[0], full[mine])
    return original(self, req, prefill_state_indices, executor, *args, **kwargs)
