"""Owned-page transfer: prefill CP ranks send the KV pages they own straight into decode pages.

The Mooncake layer of the original design ("send owned pages with logical positions"). With
shared KV, logical page p lives only on rank p % N (local page p // N), so no prefill rank holds a
whole request; each sends its own pages, labelled with their request positions, and the decode
commits the request only when every position arrived exactly once from its owner::

    request pages (positions)   0    1    2    3    4    5       N = 2
    logical page id            10   11   12   13   14   15
    owner rank                  0    1    0    1    0    1
    decode page (allocated)    40   41   42   43   44   45

    rank 0: local 5,6,7 -> decode 40,42,44  + manifest {positions 0,2,4, pages 10,12,14, sums}
    rank 1: local 5,6,7 -> decode 41,43,45  + manifest {positions 1,3,5, pages 11,13,15, sums}
    decode: both manifests in, 0..5 each once from page % 2, checksums match -> Committed

Modules: buffers (paged byte views of the pools), plan (owned pages, runs, batches),
checksum, protocol (typed ZMQ messages), auth (the shared secret, keyed MACs), engine (Mooncake),
sender, receiver, transfers (the decode's bookkeeping: uses, early messages, fences), commit (the
rule), allocator (decode free list). See docs/disagg.md. Needs pyzmq, msgspec and Mooncake,
imported only here.
"""

from sglang_nsa_cp.disagg.allocator import OutOfDecodePages, PageAllocator
from sglang_nsa_cp.disagg.buffers import KVBuffers, PagedBuffer
from sglang_nsa_cp.disagg.checksum import CHECKSUM_MODULUS, page_checksums
from sglang_nsa_cp.disagg.commit import CoverageReport, check_coverage, find_corrupt
from sglang_nsa_cp.disagg.engine import EngineConfig, MooncakeEngine, TransferError
from sglang_nsa_cp.disagg.plan import (
    OwnedPages,
    TransferBatch,
    build_transfer_batch,
    coalesce_runs,
    plan_owned_pages,
)
from sglang_nsa_cp.disagg.protocol import Manifest, ProtocolError, new_nonce
from sglang_nsa_cp.disagg.receiver import OwnedPageReceiver
from sglang_nsa_cp.disagg.status import Committed, Failed, Pending, RankStats, ReceiverStats
from sglang_nsa_cp.disagg.sender import OwnedPageSender, SendResult, SenderStats

__all__ = [
    "CHECKSUM_MODULUS",
    "Committed",
    "CoverageReport",
    "EngineConfig",
    "Failed",
    "KVBuffers",
    "Manifest",
    "MooncakeEngine",
    "OutOfDecodePages",
    "OwnedPageReceiver",
    "OwnedPageSender",
    "OwnedPages",
    "PageAllocator",
    "PagedBuffer",
    "Pending",
    "ProtocolError",
    "RankStats",
    "ReceiverStats",
    "SendResult",
    "SenderStats",
    "TransferBatch",
    "TransferError",
    "build_transfer_batch",
    "check_coverage",
    "coalesce_runs",
    "find_corrupt",
    "new_nonce",
    "page_checksums",
    "plan_owned_pages",
]
