"""The one manifest structure of both PD paths: what a prefill CP rank says it sent of a request.

N = 2, a request of 6 pages whose logical page ids are 10..15::

    rank 0: PageClaims(rank=0, cp_size=2, num_pages=6, positions=(0, 2, 4), logical_pages=(10, 12, 14))
    rank 1: PageClaims(rank=1, cp_size=2, num_pages=6, positions=(1, 3, 5), logical_pages=(11, 13, 15))

The SGLang plugin (`sglang_ext/disaggregation/`) sends one per buffer kind (KV latent, index-K)
in the manifest frame of a Success status message, without checksums (the pages ride SGLang's own
transfer); the decode judges them with `commit.check_coverage`.

Every field type is bounded: msgspec refuses a decoded value past its bound (a 2e7-rank CP group,
a list of 2**30 positions) before any code iterates it.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

MAX_CP_SIZE = 1024
MAX_REQUEST_PAGES = 1 << 20  # 64M tokens at 64-token pages
MAX_TEXT = 2048  # reasons and ids on the wire; longer reasons are cut when sent

Int64 = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_CP_SIZE)]
CpSize = Annotated[int, Meta(ge=1, le=MAX_CP_SIZE)]
NumPages = Annotated[int, Meta(ge=1, le=MAX_REQUEST_PAGES)]
Pages = Annotated[tuple[Count, ...], Meta(max_length=MAX_REQUEST_PAGES)]


class PageClaims(Struct, frozen=True, forbid_unknown_fields=True):
    """The pages one CP rank sent of one request (of one buffer kind), in position order.

    positions[i] is a request page position, logical_pages[i] the prefill's logical page id there
    (so the decode can check owner == logical_pages[i] % cp_size == rank), checksums[i] a per-page
    checksum where a transport carries one (the plugin's does not: `shape_problem(False)`).
    """

    rank: Rank
    cp_size: CpSize
    num_pages: NumPages  # pages in the whole request, as this rank saw it
    positions: Pages
    logical_pages: Pages
    checksums: Pages = ()

    def shape_problem(self, with_checksums: bool) -> str | None:
        """Why the lists do not line up (None when they do); checksums are required or absent."""
        want_sums = len(self.positions) if with_checksums else 0
        if len(self.logical_pages) != len(self.positions) or len(self.checksums) != want_sums:
            return (
                f"rank {self.rank} claims {len(self.positions)} positions, {len(self.logical_pages)} pages and "
                f"{len(self.checksums)} checksums (expected {want_sums})"
            )
        if len(self.positions) > self.num_pages:
            return f"rank {self.rank} claims {len(self.positions)} positions of a request of {self.num_pages} pages"
        return None


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """`text`, at most `limit` characters: reasons built from a peer's data stay bounded."""
    return text if len(text) <= limit else text[: limit - 15] + " ... (cut)"
