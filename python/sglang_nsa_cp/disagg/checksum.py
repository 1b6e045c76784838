"""Per-page checksums a GPU computes where the pages live, with no page copied to the host.

For one buffer, page q is M int32 words w[0..M-1] (M <= 2**16, checked in buffers.py)::

    s_b(q) = sum_i (i + 1) * w[i]          exact in int64: |s| <= 2**31 * M * (M + 1) / 2 < 2**63
    d_b(q) = s_b(q) mod P,  P = 2**31 - 1  (torch.remainder: always in [0, P))

and over the buffers b = 0 .. 2L-1 in KVBuffers.flat() order (kv[0], index[0], kv[1], ...)::

    c(q)   = sum_b (b + 1) * d_b(q) mod P  one int per request page position

Every step is an elementwise int64 op or a row sum, so on a GPU it is a gather of the request's
pages plus a reduction per buffer, and only the [num_pages] result crosses to the host (once per
request, for the manifest). The (i + 1) weight makes the sum sensitive to word order (a shifted or
swapped page body changes it); the (b + 1) weight makes a page that landed in the wrong layer or
buffer visible. It catches transport and bookkeeping errors, not a deliberate forger.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_nsa_cp.disagg.buffers import KVBuffers

CHECKSUM_MODULUS = (1 << 31) - 1
# Bound on the int64 scratch of one chunk of pages (pages x words x 8 B).
_CHUNK_BYTES = 32 << 20


def page_checksums(buffers: KVBuffers, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """c(q) for each page q in `pages` (local page ids of `buffers`), in the given order.

    Returns [len(pages)] int64 on the buffers' device, each value in [0, 2**31 - 1).
    """
    device = buffers.device
    pages = torch.as_tensor(pages, dtype=torch.int64, device=device).reshape(-1)
    total = torch.zeros(pages.numel(), dtype=torch.int64, device=device)
    if pages.numel() == 0:
        return total
    for b, buf in enumerate(buffers.flat()):
        words = buf.page_words()
        weight = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=device)
        chunk = max(1, _CHUNK_BYTES // (8 * words.shape[1]))
        for start in range(0, pages.numel(), chunk):
            rows = words.index_select(0, pages[start : start + chunk]).to(torch.int64)
            digest = torch.remainder((rows * weight).sum(dim=1), CHECKSUM_MODULUS)
            part = total[start : start + chunk]
            part.copy_(torch.remainder(part + digest * (b + 1), CHECKSUM_MODULUS))
    return total
