"""SGLang's request bookkeeping, reduced, for tests that drive SGLang's own code: `req_to_token`
rows and a paged allocator. Deterministic, so every rank of a test builds the same tables.

`PagedRequests` hands out a seeded shuffle of logical pages 1.. (page 0 is SGLang's padding page).
`RotatedPagedRequests` takes them from SGLang's owner-rotating allocator
(`PageInterleavePoolAllocator`, what a server builds under KV sharding), so request pages follow
its contract: a request's k-th page is owned by rank (b + k) % N for its rotation base b, and
extends start page-aligned (SGLang's radix match and chunk flooring give that under sharding).
N = 2, one rank's pool of 4 pages: logical pages 2..9 (0 and 1 are padding), class r = pages p
with p % 2 == r; a new request takes its base from the least-full class."""

import random

import torch


class PagedRequests:
    def __init__(self, req_to_token: torch.Tensor, num_pages: int, page_size: int, seed: int):
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def fork(self, idx: int, source: int, length: int) -> None:
        """A radix-cache hit: request `idx` starts with `source`'s first `length` tokens."""
        assert length % self.page_size == 0
        self.pages[idx] = list(self.pages[source][: length // self.page_size])
        self.lens[idx] = length
        self.req_to_token[idx, :length] = self.req_to_token[source, :length]

    def extend(self, batch: list[tuple[int, int]]) -> tuple[list[int], list[int], torch.Tensor]:
        """batch: [(request index, new tokens)] -> (prefix_lens, seq_lens, out_cache_loc int64)."""
        prefix, seq, locs = [], [], []
        for idx, n in batch:
            start = self.lens.get(idx, 0)
            loc = self.new_slots(idx, start, n)
            self.req_to_token[idx, start : start + n] = loc.to(self.req_to_token.dtype)
            self.lens[idx] = start + n
            prefix.append(start)
            seq.append(start + n)
            locs.append(loc)
        return prefix, seq, torch.cat(locs).long()

    def new_slots(self, idx: int, start: int, n: int) -> torch.Tensor:
        """Slots of request `idx`'s tokens start..start+n, taking pages as needed."""
        pages = self.pages.setdefault(idx, [])
        while len(pages) * self.page_size < start + n:
            pages.append(self.free.pop())
        pos = torch.arange(start, start + n)
        return torch.tensor(pages)[pos // self.page_size] * self.page_size + pos % self.page_size


ALLOCATOR_MIN_SHARDS = 2  # SGLang's allocator needs N > 1; a CP-off test uses N = 2's page ids


def logical_pool_pages(pages_per_rank: int, shard_size: int) -> int:
    """Pages of an unsharded pool (`DSATokenToKVPool`, size + one page) that hold every logical
    page the allocator hands out: the last is N * (pages_per_rank + 1) - 1."""
    return max(shard_size, ALLOCATOR_MIN_SHARDS) * (pages_per_rank + 1)


class RotatedPagedRequests(PagedRequests):
    """Request pages from SGLang's owner-rotating allocator (see the module docstring)."""

    def __init__(
        self, req_to_token: torch.Tensor, pages_per_rank: int, page_size: int, shard_size: int, kvcache=None,
        shard_spec=None,
    ):  # fmt: skip
        """`kvcache`, `shard_spec`: the sharded pool and its spec, as SGLang's configurator binds
        them (an MTP draft finds its target's pool through them); None for an unsharded pool."""
        from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

        self.req_to_token = req_to_token
        self.page_size = page_size
        self.allocator = PageInterleavePoolAllocator(
            pages_per_rank * page_size,
            physical_page_size=page_size,
            shard_size=max(shard_size, ALLOCATOR_MIN_SHARDS),
            dtype=torch.int64,
            device="cpu",
            kvcache=kvcache,
            need_sort=True,
            shard_spec=shard_spec,
        )
        self.lens: dict[int, int] = {}
        self.bases: dict[int, int] = {}

    def fork(self, idx: int, source: int, length: int) -> None:
        """A radix-cache hit: request `idx` starts with `source`'s first `length` tokens (whole
        pages, as SGLang matches), continuing its owner rotation."""
        assert length % self.page_size == 0, f"a radix hit is whole pages, got {length} tokens"
        self.lens[idx] = length
        self.bases[idx] = self.bases[source]
        self.req_to_token[idx, :length] = self.req_to_token[source, :length]

    def new_slots(self, idx: int, start: int, n: int) -> torch.Tensor:
        if start % self.page_size:  # a decode step: the rest of the last page
            return self._last_page_slots(idx, start, n)
        base = [self.bases.get(idx)]  # page-aligned: new pages from the allocator
        lens = torch.tensor([start, start + n])
        loc = self.allocator.alloc_extend(
            lens[:1], lens[:1], lens[1:], lens[1:], last_loc=lens[:1], extend_num_tokens=n, rotation_bases=base
        )
        assert loc is not None, "the test's pool is too small"
        self.bases[idx] = base[0]
        return loc

    def _last_page_slots(self, idx: int, start: int, n: int) -> torch.Tensor:
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        first = int(self.req_to_token[idx, start - 1]) + 1
        assert (first - 1) // self.page_size == (first + n - 1) // self.page_size, "slots past the last page"
        return torch.arange(first, first + n)
