"""Decode-side page allocator: a free list, lowest pages first.

Handing out the lowest free pages keeps a request's destination pages mostly consecutive, which
lets a prefill rank coalesce runs into fewer transfers. Pages of a failed request whose writes may
still be in flight come back only when the receiver's fence lifts (transfers.py), never on a timer.
"""

from __future__ import annotations

import heapq
import threading
from typing import Iterable, Sequence


class OutOfDecodePages(RuntimeError):
    """The decode pool has fewer free pages than a request needs."""


class PageAllocator:
    def __init__(self, num_pages: int, reserved: Iterable[int] = ()):
        reserved = set(reserved)
        self.num_pages = num_pages
        self._free = [p for p in range(num_pages) if p not in reserved]
        heapq.heapify(self._free)
        self._allocated: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with self._lock:
            if count > len(self._free):
                raise OutOfDecodePages(f"need {count} decode pages, {len(self._free)} free of {self.num_pages}")
            pages = [heapq.heappop(self._free) for _ in range(count)]
            self._allocated.update(pages)
            return pages

    def free(self, pages: Sequence[int]) -> None:
        pages = [int(p) for p in pages]
        with self._lock:
            not_allocated = [p for p in pages if p not in self._allocated]
            if not_allocated or len(set(pages)) != len(pages):
                raise ValueError(f"freeing pages that are not allocated or listed twice: {not_allocated[:8]}")
            self._allocated.difference_update(pages)
            for p in pages:
                heapq.heappush(self._free, p)
