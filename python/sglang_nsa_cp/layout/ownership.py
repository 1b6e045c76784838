"""Page ownership and the owner-classed page allocator.

A logical page id encodes its owner: page p is persisted by rank p % N, at local page p // N of
that rank's shard. The allocator keeps one free list per owner class and hands out pages of the
class asked for, so the split can choose owners:

- page-aligned zigzag: each new page is owned by the rank that computes its tokens
  ("compute-owner allocation"), so that rank writes it without any exchange;
- interleave (or zigzag that fell back to token cuts): pages mix tokens of all ranks, so owners
  rotate across a request's pages and every rank holds within one page of its share.

Every decision is a pure function of data all ranks share (the plan, the request table), so the
allocator is SPMD: all ranks make the same choices and agree on every page's owner.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from sglang_nsa_cp.layout.split import SplitPlan, plan_split


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs."""


def page_owner(page, cp_size: int):
    return page % cp_size


def local_page(page, cp_size: int):
    return page // cp_size


class OwnerClassedAllocator:
    """Free lists of logical pages, one per owner class, lowest page ids first.

    The one page allocator of the package: a prefill CP group's (N classes, mirrored on every
    rank) and, with cp_size 1, a decode instance's (one free list, shared by the owned-page
    receiver, which takes a request's destination pages, and the decode steps, which take the
    pages new tokens need). Lowest first keeps a request's pages mostly consecutive, so the runs
    a prefill rank sends into them are long. Thread-safe: a decode's receiver threads free pages
    while its decode loop allocates.
    """

    def __init__(self, num_pages: int, cp_size: int):
        if cp_size < 1 or num_pages < cp_size:
            raise ValueError(f"a pool of {num_pages} pages cannot give each of {cp_size} ranks a page")
        self.num_pages = num_pages
        self.cp_size = cp_size
        # One min-heap per class (an ascending range already is one): lowest page ids first,
        # deterministic on every rank, O(log n) per page freed or taken.
        self._free = [list(range(r, num_pages, cp_size)) for r in range(cp_size)]
        self._allocated: set[int] = set()
        self._lock = threading.Lock()

    def free_pages(self, owner: int | None = None) -> int:
        with self._lock:
            if owner is None:
                return sum(len(f) for f in self._free)
            return len(self._free[owner])

    def alloc(self, owners: Sequence[int]) -> list[int]:
        """One page per entry of `owners`, of that owner class when it has a free page.

        An exhausted class borrows from the class with the most free pages (lowest rank on a
        tie): correctness never depends on the owner, only write locality does.
        """
        bad = [o for o in owners if not 0 <= o < self.cp_size]
        if bad:
            raise ValueError(f"owner {bad[0]} is not a rank of the CP group of size {self.cp_size}")
        with self._lock:
            num_free = sum(len(f) for f in self._free)
            if len(owners) > num_free:
                raise OutOfPages(f"asked for {len(owners)} pages but only {num_free} are free")
            pages = []
            for owner in owners:
                if not self._free[owner]:
                    owner = max(range(self.cp_size), key=lambda r: (len(self._free[r]), -r))
                pages.append(heapq.heappop(self._free[owner]))
            self._allocated.update(pages)
            return pages

    def free(self, pages: Sequence[int]) -> None:
        pages = [int(p) for p in pages]
        with self._lock:
            unknown = [p for p in pages if p not in self._allocated]
            if unknown or len(set(pages)) != len(pages):
                raise ValueError(
                    f"pages {unknown[:8] or pages[:8]} are not allocated or listed twice "
                    "(double free or foreign page ids)"
                )
            for p in pages:
                self._allocated.discard(p)
                heapq.heappush(self._free[page_owner(p, self.cp_size)], p)


@dataclass
class ExtendBatch:
    """The page bookkeeping of one prefill batch: what the KV store and kernels index with."""

    keys: list[Hashable]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_size: int
    req_pages: list[list[int]]  # each request's logical page ids in position order
    out_cache_loc: torch.Tensor  # logical slot of each new token, flat-batch order
    # Every page receiving new tokens is owned by the one rank computing them, so each rank can
    # persist exactly what it computed (direct write). False when the split is not page-aligned
    # or the allocator had to borrow a page from another owner class.
    compute_owned: bool = False

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def page_table(self) -> torch.Tensor:
        """[bs, max_pages] logical page ids per request (-1 past the end)."""
        table = torch.full((len(self.keys), max(len(p) for p in self.req_pages)), -1, dtype=torch.long)
        for i, pages in enumerate(self.req_pages):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        return table

    def req_to_token(self) -> torch.Tensor:
        """[bs, max_seq_len] logical slot of every position (SGLang's req_to_token rows); -1 past the end."""
        max_len = max(self.seq_lens)
        table = torch.full((len(self.keys), max_len), -1, dtype=torch.long)
        for i, (pages, n) in enumerate(zip(self.req_pages, self.seq_lens)):
            pos = torch.arange(n)
            table[i, :n] = (
                torch.tensor(pages, dtype=torch.long)[pos // self.page_size] * self.page_size + pos % self.page_size
            )
        return table


@dataclass
class RequestPageTable:
    """Each live request's logical pages, and the owner-classed allocation of new ones (SPMD)."""

    allocator: OwnerClassedAllocator
    page_size: int
    pages: dict[Hashable, list[int]] = field(default_factory=dict)
    lengths: dict[Hashable, int] = field(default_factory=dict)
    _rotation: int = 0

    @property
    def cp_size(self) -> int:
        return self.allocator.cp_size

    def prefix_len(self, key: Hashable) -> int:
        return self.lengths.get(key, 0)

    def slots(self, key: Hashable) -> torch.Tensor:
        """Logical slot of every cached position of a request (its req_to_token row)."""
        pos = torch.arange(self.prefix_len(key))
        pages = torch.tensor(self.pages[key], dtype=torch.long)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def first_page_owners(self, keys: Sequence[Hashable]) -> list[int | None]:
        """Owner of the page a request's next token lands on, where that page already exists."""
        owners = []
        for key in keys:
            n = self.prefix_len(key)
            owners.append(
                page_owner(self.pages[key][n // self.page_size], self.cp_size) if n % self.page_size else None
            )
        return owners

    def fork(self, key: Hashable, source: Hashable, length: int) -> None:
        """Start request `key` on the first `length` cached tokens of `source` (radix-cache hit).

        Whole shared pages keep their owner; a shared partial last page is not supported by
        SGLang's page-granular radix cache either, so `length` must end on a page boundary.
        """
        if length % self.page_size:
            raise ValueError(
                f"a shared prefix must end on a page boundary; {length} is not a multiple of {self.page_size}"
            )
        if length > self.prefix_len(source):
            raise ValueError(f"request {source!r} has only {self.prefix_len(source)} cached tokens, not {length}")
        if key in self.pages:
            raise ValueError(f"request {key!r} already exists")
        self.pages[key] = list(self.pages[source][: length // self.page_size])
        self.lengths[key] = length

    def schedule(
        self, keys: Sequence[Hashable], extend_lens: Sequence[int], mode: str
    ) -> tuple[SplitPlan, ExtendBatch]:
        """Split a batch continuing (or starting) `keys` and allocate its pages, as one step."""
        prefix = [self.prefix_len(k) for k in keys]
        first_owners = self.first_page_owners(keys) if mode == "page_zigzag" else None
        plan = plan_split(extend_lens, prefix, self.cp_size, mode, self.page_size, first_owners)
        return plan, self.extend(keys, plan)

    def extend(self, keys: Sequence[Hashable], plan: SplitPlan) -> ExtendBatch:
        """Allocate pages for every request's new tokens as `plan` splits them."""
        if len(keys) != plan.batch_size or len(set(keys)) != len(keys):
            raise ValueError("keys must name each request of the plan exactly once")
        prefix = [self.prefix_len(k) for k in keys]
        if list(plan.prefix_lens) != prefix:
            raise ValueError(f"plan prefix lengths {list(plan.prefix_lens)} differ from the cached lengths {prefix}")
        needed = []
        for key, n_prefix, n_new in zip(keys, prefix, plan.extend_lens):
            have = len(self.pages.get(key, []))
            needed.append(-(-(n_prefix + n_new) // self.page_size) - have)
        owners = self._new_page_owners(keys, plan, needed)
        flat_owners = [o for req in owners for o in req]
        new_pages = self.allocator.alloc(flat_owners)
        borrowed = any(page_owner(p, self.cp_size) != o for p, o in zip(new_pages, flat_owners))
        it = iter(new_pages)
        for key, req_owners in zip(keys, owners):
            self.pages.setdefault(key, []).extend(next(it) for _ in req_owners)
        for key, n_new in zip(keys, plan.extend_lens):
            self.lengths[key] = self.prefix_len(key) + n_new

        slots = [self.slots(k)[p:] for k, p in zip(keys, prefix)]
        return ExtendBatch(
            keys=list(keys),
            prefix_lens=prefix,
            extend_lens=list(plan.extend_lens),
            page_size=self.page_size,
            req_pages=[list(self.pages[k]) for k in keys],
            out_cache_loc=torch.cat(slots),
            compute_owned=plan.page_aligned and not borrowed,
        )

    def _new_page_owners(self, keys, plan: SplitPlan, needed: list[int]) -> list[list[int]]:
        owners = []
        if plan.page_aligned:
            # Compute-owner: the rank computing a page's first new token computes all of it.
            for i, (key, count) in enumerate(zip(keys, needed)):
                first_new_page = len(self.pages.get(key, []))
                start = int(plan.request_starts[i])
                req_owners = []
                for k in range(first_new_page, first_new_page + count):
                    first_token = start + k * self.page_size - plan.prefix_lens[i]
                    req_owners.append(int(plan.token_rank[first_token]))
                owners.append(req_owners)
            return owners
        # Rotation: a request continues the rotation it started with; new requests start where
        # the previous one stopped, so short requests do not all land on rank 0.
        for key, count in zip(keys, needed):
            existing = self.pages.get(key, [])
            if existing:
                first = (page_owner(existing[0], self.cp_size) + len(existing)) % self.cp_size
            else:
                first = self._rotation
                self._rotation = (self._rotation + count) % self.cp_size
            owners.append([(first + k) % self.cp_size for k in range(count)])
        return owners

    def release(self, key: Hashable) -> None:
        """Free a finished request's pages that no other live request shares."""
        pages = self.pages.pop(key)
        self.lengths.pop(key)
        in_use = {p for other in self.pages.values() for p in other}
        self.allocator.free([p for p in pages if p not in in_use])
