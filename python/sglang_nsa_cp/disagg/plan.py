"""Which pages a prefill rank sends for one request, and the runs that carry them.

Example, N = 4, a request of 6 pages whose logical page ids came from compute-owner allocation
(positions 0-2 computed by rank 1, 3-5 by rank 2), decode destination pages 40..45::

    position k        0    1    2    3    4    5
    logical page     13   17   21   14   18   22      owner = page % 4, local page = page // 4
    owner             1    1    1    2    2    2
    local page        3    4    5    3    4    5
    decode page      40   41   42   43   44   45

    rank 1 sends positions 0-2: one run, local pages 3..5 -> decode pages 40..42
    rank 2 sends positions 3-5: one run, local pages 3..5 -> decode pages 43..45
    ranks 0 and 3 send nothing (their manifests are empty)

A run is a maximal stretch of the rank's positions whose local pages and decode pages both go up
by one; per layer and kind it is one (src, dst, length) entry of a batched write (the standalone
transport's `pd.engine.build_transfer_batch`; SGLang's `group_concurrent_contiguous` does the same). Interleave
ownership (owners rotate 0,1,2,3,...) gives single-page runs; that is still 1/N of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sglang_nsa_cp.disagg.manifest import PageClaims
from sglang_nsa_cp.layout.ownership import local_page, page_owner


@dataclass(frozen=True)
class OwnedPages:
    """The pages `rank` of a CP group of `cp_size` persists for one request, in position order."""

    rank: int
    cp_size: int
    num_pages: int  # pages in the whole request
    positions: tuple[int, ...]  # request page positions k, ascending
    logical_pages: tuple[int, ...]  # logical page id at each of those positions
    local_pages: tuple[int, ...]  # page in this rank's shard: logical // cp_size

    def claims(self, checksums: Sequence[int] = ()) -> PageClaims:
        """What this rank tells the decode it sent (the manifest), with a checksum per page or none."""
        return PageClaims(self.rank, self.cp_size, self.num_pages, self.positions, self.logical_pages, tuple(checksums))


def plan_owned_pages(logical_pages: Sequence[int], rank: int, cp_size: int) -> OwnedPages:
    """Select the positions k with logical_pages[k] % cp_size == rank."""
    if cp_size < 1 or not 0 <= rank < cp_size:
        raise ValueError(f"need 0 <= rank < cp_size, got rank={rank}, cp_size={cp_size}")
    pages = [int(p) for p in logical_pages]
    if any(p < 0 for p in pages):
        raise ValueError(f"logical page ids must be >= 0, got {min(pages)}")
    if len(set(pages)) != len(pages):
        raise ValueError("a request's logical page ids must be distinct (one page per position)")
    positions = tuple(k for k, p in enumerate(pages) if page_owner(p, cp_size) == rank)
    owned = tuple(pages[k] for k in positions)
    return OwnedPages(
        rank=rank,
        cp_size=cp_size,
        num_pages=len(pages),
        positions=positions,
        logical_pages=owned,
        local_pages=tuple(local_page(p, cp_size) for p in owned),
    )


def coalesce_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src_start, dst_start, num_pages) where src and dst both step by +1."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[list[int]] = []
    for src, dst in zip(src_pages, dst_pages):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(run) for run in runs]
