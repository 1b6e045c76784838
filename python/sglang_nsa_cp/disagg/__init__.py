"""Owned-page transfer, the core both PD paths share: prefill CP ranks send the KV pages they own
straight into decode pages, and the decode commits a request only when its pages are all there.

The Mooncake layer of the original design ("send owned pages with logical positions"). With
shared KV, logical page p lives only on rank p % N (local page p // N), so no prefill rank holds a
whole request; each sends its own pages, labelled with their request positions, and the decode
commits the request only when every position arrived exactly once from its owner::

    request pages (positions)   0    1    2    3    4    5       N = 2
    logical page id            10   11   12   13   14   15
    owner rank                  0    1    0    1    0    1
    decode page (allocated)    40   41   42   43   44   45

    rank 0: local 5,6,7 -> decode 40,42,44  + claims {positions 0,2,4, pages 10,12,14, sums}
    rank 1: local 5,6,7 -> decode 41,43,45  + claims {positions 1,3,5, pages 11,13,15, sums}
    decode: both claims in, 0..5 each once from page % 2, checksums match -> commit

Modules: plan (owned pages, coalesced runs), manifest (`PageClaims`, the one manifest structure,
with its bounded wire types), commit (the coverage rule over positions and pages, checksums
compared), buffers + checksum (a pool as paged bytes; per-page checksums computed where the pages
live), auth (the shared secret, keyed MACs). Two transports use them: the SGLang plugin rides
SGLang's own Mooncake transfer (`sglang_ext/disaggregation/`), and the standalone ZMQ + Mooncake
transport of `demo --pd` lives with the demo (`sglang_nsa_cp.pd`). See docs/disagg.md.
Needs torch and msgspec; no socket, thread or Mooncake import.
"""

from sglang_nsa_cp.disagg.buffers import KVBuffers, PagedBuffer
from sglang_nsa_cp.disagg.checksum import CHECKSUM_MODULUS, page_checksums
from sglang_nsa_cp.disagg.commit import CoverageReport, check_coverage, find_corrupt
from sglang_nsa_cp.disagg.manifest import PageClaims
from sglang_nsa_cp.disagg.plan import OwnedPages, coalesce_runs, plan_owned_pages

__all__ = [
    "CHECKSUM_MODULUS",
    "CoverageReport",
    "KVBuffers",
    "OwnedPages",
    "PageClaims",
    "PagedBuffer",
    "check_coverage",
    "coalesce_runs",
    "find_corrupt",
    "page_checksums",
    "plan_owned_pages",
]
