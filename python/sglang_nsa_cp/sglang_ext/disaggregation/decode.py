"""Decode side: allocate a shared-KV request's pages grouped by prefill owner. Mirrors
`sglang/srt/disaggregation/decode.py`.

Target: `DecodePreallocQueue._alloc_for_decode_prealloc` (AROUND), which `_pre_alloc` calls to
take a request's token slots from the allocator before it writes them into `req_to_token` and
sends their pages to the prefill (`send_metadata`). When the request's prefill advertises
owner-sharded pages (`enable_kv_cache_sharding` in its bootstrap info: SGLang's KV sharding, which
the plugin's flag turns on) with CP size N > 1, the same pages are re-dealt so that positions k = c (mod N) sit on
consecutive pages (`owner_grouped_pages`): each prefill rank's owned positions become one run.
Everything downstream reads the regrouped slots: `req_to_token` (attention, the radix cache,
decode steps continuing the last page), the KV destination list and the index-K (DSA state)
destination list, both derived from `req_to_token`. Only on a decode started with the flag (its
opt-in); any other decode keeps SGLang's request order.

Left in request order: requests with a decode-side cached prefix (positions start after it),
SWA-tail and HiSparse allocation, page size 1, a prefill that is not owner-sharded or has CP 1.
"""

from __future__ import annotations

import logging

from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import regroup_token_slots

logger = logging.getLogger(__name__)
_logged_cp_sizes: set[int] = set()


def prefill_owner_cp_size(queue, req) -> int:
    """N when `req`'s prefill shards pages by owner across N > 1 CP ranks, else 1: read from the
    bootstrap info its receiver fetched (`prefill_info_table`, before pre-allocation). Every
    SGLang name read here is in the ledger's `relies_on` (a rename refuses at start-up)."""
    decode_req = next((d for d in queue.queue if d.req is req), None)
    if decode_req is None:
        return 1
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

    receiver = decode_req.kv_receiver
    if isinstance(receiver, FakeKVReceiver):  # SGLang's warm-up request: no prefill behind it
        return 1
    info = vars(receiver).get("prefill_info")  # set by the receiver's `init()`
    if info is None:
        info = queue.kv_manager.prefill_info_table.get(receiver.bootstrap_addr)
    if info is None or not info.enable_kv_cache_sharding:
        return 1
    return max(1, int(info.attn_cp_size))


def allocate_grouped_by_owner(original, self, allocator, **kwargs):
    """AROUND `DecodePreallocQueue._alloc_for_decode_prealloc`."""
    from sglang_nsa_cp.sglang_ext.server_args import decode_opted_in

    kv_loc = original(self, allocator, **kwargs)
    if (
        not decode_opted_in()
        or kv_loc is None
        or allocator.page_size <= 1
        or kwargs.get("prefix_len")
        or kwargs.get("total_prefix_len")
        or kwargs.get("uses_swa_tail")
    ):
        return kv_loc
    cp_size = prefill_owner_cp_size(self, kwargs.get("req"))
    if cp_size > 1 and cp_size not in _logged_cp_sizes:
        _logged_cp_sizes.add(cp_size)
        logger.info(
            "Owned-page PD transfer: decode pages of requests from an owner-sharded CP %d prefill "
            "are allocated grouped by owner (one Mooncake run per prefill rank)",
            cp_size,
        )
    return regroup_token_slots(kv_loc, allocator.page_size, cp_size)
