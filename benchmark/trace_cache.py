"""A Mooncake trace and SGLang 0.5.23's own radix cache over its pages.

Keys. A Mooncake request gives one hash id per 512-token block (equal ids: equal prefix). SGLang
matches and caches whole pages of 64 tokens, so a block is its 8 pages and the tree holds one
synthetic key per page, `hash_id * 8 + page_in_block`, instead of 64 token ids:

    input_length 1100, hash_ids [7, 9, 4]      pages of 64 tokens (17 full, 12 tokens over)
    block 7: tokens    0..511  -> keys 56..63   (8 pages)
    block 9: tokens  512..1023 -> keys 72..79   (8 pages)
    block 4: tokens 1024..1099 -> key  32       (1 full page; the 12 tokens after it are never cached)

The tree runs at page_size 1 over these keys (one key = one slot = one 64-token page), which is
SGLang's page-64 tree up to the unit: a page matches iff its block and its place in the block do.
A request may reuse at most floor((input_length - 1) / 64) pages (SGLang keeps one token to
compute: `_compute_max_prefix_len`), computes the rest and, when done, inserts its
floor(input_length / 64) full pages. A partial last block that a later request extends gets a new
id in the trace, so its full pages cannot be matched here even where the tokens agree: hits are,
if anything, undercounted.

The cache pass serves one pool's requests one after another in arrival order, as a server does
that runs one request at a time (SGLang's tree: `UnifiedRadixCache`, FULL component, its Rust tree
core, LRU eviction, what `create_tree_cache` builds for a DSA model). Requests that overlap in time
on a real server can miss pages a predecessor is still computing; the pass does not model that.
"""

from __future__ import annotations

import dataclasses
import gzip
import heapq
import json
from array import array

PAGE = 64  # SGLang's page size for DSA (FlashMLA)
BLOCK = 512  # tokens per Mooncake hash id
PAGES_PER_BLOCK = BLOCK // PAGE


class UsageError(Exception):
    """A bad option value: the command prints one line and exits 2."""


@dataclasses.dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # at speed 1
    input_len: int
    page_keys: array  # int64, one per full page: floor(input_len / 64)
    conversation: int  # the first two blocks' ids: system prompt + first turn (see conversation_key)
    blocks: list  # the hash ids


def page_keys(hash_ids: list[int], input_len: int) -> array:
    """One key per full 64-token page: `hash_id * 8 + page_in_block` (see the module docstring)."""
    return array(
        "q", (hash_ids[j // PAGES_PER_BLOCK] * PAGES_PER_BLOCK + j % PAGES_PER_BLOCK for j in range(input_len // PAGE))
    )


def conversation_key(hash_ids: list[int]) -> int:
    """Which conversation a request continues. The trace has no session ids; every request starts
    with block 0 (a system prompt), so the second block (the first user turn) names the
    conversation. A one-block request is its own."""
    return hash_ids[1] if len(hash_ids) > 1 else -1 - hash_ids[0]


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake-format JSON lines (plain or .gz) -> requests in arrival order. Raises UsageError
    naming the line for a malformed record."""
    opener = gzip.open if path.endswith(".gz") else open
    requests = []
    try:
        with opener(path, "rt") as f:
            for n, line in enumerate(f, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                requests.append(_parse_record(path, n, line))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UsageError(f"--trace {path}: cannot read it ({exc})") from None
    if not requests:
        raise UsageError(f"--trace {path}: no requests in it")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _parse_record(path: str, n: int, line: str) -> TraceRequest:
    where = f"--trace {path} line {n}"
    try:
        rec = json.loads(line)
        ts, length, ids = rec["timestamp"], rec["input_length"], rec["hash_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"{where}: not a Mooncake record with timestamp, input_length, hash_ids ({exc})") from None
    if not (isinstance(length, int) and length >= 1 and isinstance(ts, (int, float)) and ts >= 0):
        raise UsageError(f"{where}: input_length must be an integer >= 1 and timestamp a number >= 0")
    if not (isinstance(ids, list) and all(isinstance(h, int) and h >= 0 for h in ids)):
        raise UsageError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(ids) != -(-length // BLOCK):
        raise UsageError(f"{where}: {len(ids)} hash_ids for input_length {length}; need one per {BLOCK}-token block")
    return TraceRequest(ts / 1000.0, length, page_keys(ids, length), conversation_key(ids), ids)


class PagePrefixCache:
    """SGLang's `UnifiedRadixCache` (FULL component, LRU) over page keys, with a
    `TokenToKVPoolAllocator` of `capacity_pages` slots: one slot = one 64-token page."""

    def __init__(self, capacity_pages: int):
        import torch
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.torch = torch
        self.capacity_pages = capacity_pages
        self.allocator = TokenToKVPoolAllocator(capacity_pages, torch.int64, "cpu", kvcache=None, need_sort=False)
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
                                 page_size=1, tree_components=(ComponentType.FULL,))  # fmt: skip
        self.tree = UnifiedRadixCache(params)

    def serve(self, keys: array, input_len: int) -> int | None:
        """One request, start to end: match at most (input_len - 1) // 64 pages, lock them, allocate
        the rest (evicting LRU leaves), insert the full pages, free the partial one, unlock.
        Returns the pages it reused, or None if it cannot fit (SGLang refuses such a prompt)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        need = -(-input_len // PAGE)
        if need > self.capacity_pages:
            return None
        limit = (input_len - 1) // PAGE
        if limit > 0:
            result = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(keys[:limit])))
            hit, node = result.device_prefix_len, result.last_device_node
        else:
            hit, node = 0, self.tree.root_node_handle()
        lock = self.tree.lock(node)
        short = need - hit - self.allocator.available_size()
        if short > 0:
            self.tree.evict(EvictParams(num_tokens=short))
        new = self.allocator.alloc(need - hit)
        assert new is not None, f"no room for {need - hit} pages in a cache of {self.capacity_pages}"
        prefix = self.tree.path_device_indices(node)[:hit]
        slots = self.torch.cat([prefix, new])
        full = input_len // PAGE
        self.tree.insert(InsertParams(key=RadixKey(keys[:full]), value=slots[:full], prev_prefix_len=hit,
                                      inserted_len=hit))  # fmt: skip
        self.allocator.free(slots[full:])
        self.tree.unlock(lock)
        return hit

    def cached_pages(self) -> int:
        return self.capacity_pages - self.allocator.available_size()


def cache_pass(requests: list[TraceRequest], capacity_tokens: int) -> list[int | None]:
    """Pages each request reuses when `requests` go one after another through one radix cache of
    `capacity_tokens` (None: refused, larger than the cache)."""
    cache = PagePrefixCache(capacity_tokens // PAGE)
    return [cache.serve(r.page_keys, r.input_len) for r in requests]


class FastPageCache:
    """The same cache in plain Python for the many-arm sweep, a block at a time: a trie of the
    trace's 512-token blocks, each node holding the pages of its block that are cached (8, or
    fewer for a prompt's partial last block), LRU eviction of leaf blocks with the chain above a
    leaf that shares its access time (SGLang evicts whole radix nodes: a chain inserted or
    matched together). `test_bench_trace_replay.py` holds its hits to SGLang's tree; the command
    prints the gap on the trace it replays."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.used = 0
        self.children: dict[int, int] = {}  # (parent << 32 | block id) -> node
        self.parent, self.block, self.pages = [-1], [-1], [0]
        self.nchild, self.stamp, self.alive = [0], [0], [True]
        self.free_ids: list[int] = []
        self.heap: list[tuple[int, int]] = []
        self.clock = 0

    def serve(self, blocks: list[int], input_len: int) -> int | None:
        """Like PagePrefixCache.serve, over the request's block ids."""
        need = -(-input_len // PAGE)
        if need > self.capacity_pages:
            return None
        self.clock += 1
        limit, full = (input_len - 1) // PAGE, input_len // PAGE
        children, pages, stamp = self.children, self.pages, self.stamp
        node, hit, path = 0, 0, []
        for b in blocks:
            if hit >= limit:
                break
            child = children.get(node << 32 | b)
            if child is None:
                break
            path.append(child)
            hit = min(hit + pages[child], limit)
            node = child
            if pages[child] < PAGES_PER_BLOCK:
                break
        for n in path:
            stamp[n] = self.clock
        short = need - hit - (self.capacity_pages - self.used)
        if short > 0:
            self._evict(short, set(path))
        # insert: the full pages of every block; pages already cached past the hit are not reallocated
        new_pages = need - hit
        node = 0
        for j, b in enumerate(blocks):
            want = min(PAGES_PER_BLOCK, full - j * PAGES_PER_BLOCK)
            if want <= 0:
                break
            key = node << 32 | b
            child = children.get(key)
            if child is None:
                child = self._new(node, b, key)
            have = pages[child]
            if want > have:
                pages[child] = want
            # pages of this block held before beyond the hit were allocated again: freed now
            new_pages -= max(0, min(have, want) - max(0, hit - j * PAGES_PER_BLOCK))
            stamp[child] = self.clock
            node = child
        self.used += new_pages - (need - full)  # the partial last page is freed
        if self.nchild[node] == 0 and node != 0:
            heapq.heappush(self.heap, (self.clock, node))
        return hit

    def _new(self, parent: int, b: int, key: int) -> int:
        if self.free_ids:
            n = self.free_ids.pop()
            self.parent[n], self.block[n], self.pages[n], self.nchild[n], self.alive[n] = parent, b, 0, 0, True
        else:
            n = len(self.parent)
            for lst, v in ((self.parent, parent), (self.block, b), (self.pages, 0), (self.nchild, 0),
                           (self.stamp, 0), (self.alive, True)):  # fmt: skip
                lst.append(v)
        self.children[key] = n
        self.nchild[parent] += 1
        return n

    def _evict(self, pages: int, locked: set) -> None:
        heap, stamp, skipped = self.heap, self.stamp, []
        while pages > 0 and heap:
            t, n = heapq.heappop(heap)
            if not self.alive[n] or self.nchild[n] or stamp[n] != t:
                continue  # stale: gone, no longer a leaf, or touched since
            if n in locked:
                skipped.append((t, n))
                continue
            while True:  # the leaf and the chain above it with the same access time: one radix node
                p = self.parent[n]
                del self.children[p << 32 | self.block[n]]
                self.alive[n] = False
                self.free_ids.append(n)
                self.used -= self.pages[n]
                pages -= self.pages[n]
                self.nchild[p] -= 1
                if p == 0 or self.nchild[p] or p in locked:
                    break
                if stamp[p] != t:
                    heapq.heappush(heap, (stamp[p], p))
                    break
                n = p
        for item in skipped:
            heapq.heappush(heap, item)
        assert pages <= 0, "eviction could not free enough pages"


def fast_cache_pass(requests: list[TraceRequest], capacity_tokens: int) -> list[int | None]:
    cache = FastPageCache(capacity_tokens // PAGE)
    return [cache.serve(r.blocks, r.input_len) for r in requests]
