"""Owned-page transfer, the rules of the SGLang plugin's PD path: prefill CP ranks send the KV pages they own
straight into decode pages, and the decode commits a request only when its pages are all there.

The Mooncake layer of the original design ("send owned pages with logical positions"). With
shared KV, logical page p lives only on rank p % N (local page p // N), so no prefill rank holds a
whole request; each sends its own pages, labelled with their request positions, and the decode
commits the request only when every position arrived exactly once from its owner::

    request pages (positions)   0    1    2    3    4    5       N = 2
    logical page id            10   11   12   13   14   15
    owner rank                  0    1    0    1    0    1
    decode page (allocated)    40   41   42   43   44   45

    rank 0: local 5,6,7 -> decode 40,42,44  + claims {positions 0,2,4, pages 10,12,14}
    rank 1: local 5,6,7 -> decode 41,43,45  + claims {positions 1,3,5, pages 11,13,15}
    decode: both claims in, 0..5 each once from page % 2 -> commit

Modules: manifest (`PageClaims`, the one manifest structure, with its bounded wire types), commit
(the coverage rule over positions and pages), auth (the shared secret, keyed MACs). The SGLang
plugin rides SGLang's own Mooncake transfer with them (`sglang_ext/disaggregation/`). See
docs/disagg.md. Needs msgspec; no torch, socket, thread or Mooncake import.
"""

from sglang_nsa_cp.disagg.commit import CoverageReport, check_coverage
from sglang_nsa_cp.disagg.manifest import PageClaims

__all__ = ["CoverageReport", "PageClaims", "check_coverage"]
