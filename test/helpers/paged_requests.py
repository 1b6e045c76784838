"""SGLang's request bookkeeping, reduced, for tests that drive SGLang's own code: `req_to_token`
rows and a paged allocator handing out a seeded shuffle of logical pages 1.. (page 0 is SGLang's
padding page). Deterministic, so every rank of a test builds the same tables."""

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
            pages = self.pages.setdefault(idx, [])
            while len(pages) * self.page_size < start + n:
                pages.append(self.free.pop())
            pos = torch.arange(start, start + n)
            loc = torch.tensor(pages)[pos // self.page_size] * self.page_size + pos % self.page_size
            self.req_to_token[idx, start : start + n] = loc.to(self.req_to_token.dtype)
            self.lens[idx] = start + n
            prefix.append(start)
            seq.append(start + n)
            locs.append(loc)
        return prefix, seq, torch.cat(locs).long()
