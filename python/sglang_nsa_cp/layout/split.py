"""Split plans: which CP rank computes which tokens of a prefill batch, in which local order.

A batch is given per request: `extend_lens[i]` new tokens following `prefix_lens[i]` cached ones.
Tokens are numbered in the flat batch (request 0's new tokens first), which is the order of
SGLang's `input_ids` and `out_cache_loc`. Three modes:

- `zigzag` (SGLang's zigzag, formerly in-seq-split): every request is cut into 2N chunks of
  near-equal token counts; rank r computes chunks r and 2N-1-r. Local order is the front chunks
  of all requests, then the back chunks.
- `page_zigzag`: the same pairing, but the cuts fall on page boundaries of the logical slot
  space, so each page that receives new tokens is computed by exactly one rank (the precondition
  for compute-owner direct writes). A first page that continues a cached prefix ending mid-page
  goes to that page's existing owner. When some request has fewer whole pages than 2N chunks,
  the batch falls back to the token-balanced `zigzag` cut and `plan.page_aligned` is False.
- `interleave` (SGLang's interleave, formerly round-robin-split): flat token i goes to rank i % N.

Every rank builds the same plan from the same inputs; nothing in it is rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

SPLIT_MODES = ("zigzag", "page_zigzag", "interleave")


class SplitError(ValueError):
    """Bad input to a split plan."""


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host-built tensor to `device` without stalling the host: a copy from pageable
    memory waits for the device stream to drain (a pipeline bubble in the middle of a forward),
    one from pinned memory is queued like a kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """The token split of one prefill batch over a CP group.

    `rank_tokens[r]` holds the flat-batch token indices that rank r computes, in its local order.
    """

    cp_size: int
    mode: str
    page_size: int
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    page_aligned: bool
    rank_tokens: tuple[torch.Tensor, ...]

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Tokens computed by each rank."""
        return tuple(int(t.numel()) for t in self.rank_tokens)

    @property
    def max_count(self) -> int:
        """Rows per rank in a padded all-gather."""
        return max(self.counts)

    # ---- per-token metadata (flat-batch order) -------------------------------------------------
    @cached_property
    def request_of_token(self) -> torch.Tensor:
        lens = torch.tensor(self.extend_lens, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(self.batch_size), lens)

    @cached_property
    def request_starts(self) -> torch.Tensor:
        """Flat index of each request's first new token."""
        lens = torch.tensor(self.extend_lens, dtype=torch.long)
        return torch.cumsum(lens, 0) - lens

    @cached_property
    def token_positions(self) -> torch.Tensor:
        """Position of each flat token inside its request (prefix included)."""
        req = self.request_of_token
        prefix = torch.tensor(self.prefix_lens, dtype=torch.long)
        return torch.arange(self.num_tokens) - self.request_starts[req] + prefix[req]

    @cached_property
    def token_rank(self) -> torch.Tensor:
        """The rank that computes each flat token."""
        owner = torch.empty(self.num_tokens, dtype=torch.long)
        for rank, tokens in enumerate(self.rank_tokens):
            owner[tokens] = rank
        return owner

    @cached_property
    def rerange_index(self) -> torch.Tensor:
        """For each flat token, its row in the rank-major padded all-gather of local tensors.

        `gathered.index_select(0, plan.rerange_index)` puts an all-gathered tensor (each rank's
        local rows padded to `max_count`) back into flat-batch order.
        """
        index = torch.empty(self.num_tokens, dtype=torch.long)
        for rank, tokens in enumerate(self.rank_tokens):
            index[tokens] = rank * self.max_count + torch.arange(tokens.numel())
        return index

    @cached_property
    def last_token_rank(self) -> torch.Tensor:
        """The rank that computes each request's last new token."""
        lens = torch.tensor(self.extend_lens, dtype=torch.long)
        return self.token_rank[self.request_starts + lens - 1]

    @cached_property
    def last_token_gather_index(self) -> torch.Tensor:
        """Row of each request's last token in the narrow tail gather ([N * bs] rank-major)."""
        return self.last_token_rank * self.batch_size + torch.arange(self.batch_size)

    def device_tensor(self, name: str, device: torch.device | str, *args: int) -> torch.Tensor:
        """A plan tensor (a property, or a per-rank method called with `args`) on `device`.

        Copied once per plan and device, so per-layer code never builds host tensors.
        """
        key = (name, str(device), args)
        cache = self._device_cache
        if key not in cache:
            value = getattr(self, name)
            cache[key] = host_to_device(value(*args) if args else value, device)
        return cache[key]

    @cached_property
    def _device_cache(self) -> dict:
        return {}

    # ---- per-rank views ----------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise SplitError(f"rank {rank} is outside the CP group of size {self.cp_size}")

    def token_indices(self, rank: int) -> torch.Tensor:
        """Flat-batch token indices computed by `rank`, in its local order."""
        self._check_rank(rank)
        return self.rank_tokens[rank]

    def positions(self, rank: int) -> torch.Tensor:
        """Position inside its request of each local token (RoPE position)."""
        return self.token_positions[self.token_indices(rank)]

    def request_ids(self, rank: int) -> torch.Tensor:
        """Request index of each local token."""
        return self.request_of_token[self.token_indices(rank)]

    def kv_lens(self, rank: int) -> torch.Tensor:
        """Causal KV length of each local query: everything up to and including itself."""
        return self.positions(rank) + 1

    def last_token_local_rows(self, rank: int) -> torch.Tensor:
        """For each request, the local row of its last token on `rank`, or -1 elsewhere."""
        self._check_rank(rank)
        lens = torch.tensor(self.extend_lens, dtype=torch.long)
        last = self.request_starts + lens - 1
        local_row = torch.full((self.num_tokens,), -1, dtype=torch.long)
        tokens = self.rank_tokens[rank]
        local_row[tokens] = torch.arange(tokens.numel())
        return local_row[last]

    # ---- balance -----------------------------------------------------------------------------
    def attention_work(self) -> list[int]:
        """Causal attention work per rank: the sum of its queries' KV lengths."""
        return [int(self.kv_lens(r).sum()) for r in range(self.cp_size)]

    def balance_ratio(self) -> float:
        """max / mean of `attention_work`; 1.0 is perfect balance."""
        work = self.attention_work()
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 1.0


def _validate(extend_lens, prefix_lens, cp_size, mode, page_size, first_page_owners):
    if mode not in SPLIT_MODES:
        raise SplitError(f"split mode {mode!r} is not one of {SPLIT_MODES}")
    if cp_size < 1:
        raise SplitError(f"cp_size must be at least 1, got {cp_size}")
    if page_size < 1:
        raise SplitError(f"page_size must be at least 1, got {page_size}")
    if len(extend_lens) == 0:
        raise SplitError("a batch needs at least one request")
    if len(extend_lens) != len(prefix_lens):
        raise SplitError(f"extend_lens has {len(extend_lens)} requests but prefix_lens has {len(prefix_lens)}")
    bad = [i for i, n in enumerate(extend_lens) if n < 1]
    if bad:
        raise SplitError(f"requests {bad} have no new tokens; every extend length must be >= 1")
    bad = [i for i, n in enumerate(prefix_lens) if n < 0]
    if bad:
        raise SplitError(f"requests {bad} have negative prefix lengths")
    if first_page_owners is not None:
        if len(first_page_owners) != len(extend_lens):
            raise SplitError("first_page_owners needs one entry per request")
        bad = [i for i, o in enumerate(first_page_owners) if o is not None and not 0 <= o < cp_size]
        if bad:
            raise SplitError(f"first_page_owners of requests {bad} are not ranks of the CP group")


def _near_equal_chunks(total: int, parts: int) -> list[int]:
    """SGLang's chunking: the first `total % parts` chunks get one extra unit."""
    base, rem = divmod(total, parts)
    return [base + (b < rem) for b in range(parts)]


def _zigzag_assign(chunk_bounds, cp_size, leading=None) -> list[torch.Tensor]:
    """Rank r takes chunk r (front) and chunk 2N-1-r (back) of every request.

    `chunk_bounds[i][b]` is the flat token range [start, end) of request i's chunk b.
    Local order: all requests' front chunks, then all requests' back chunks. `leading[i]`, if
    set, is `(rank, (start, end))`: a range that rank computes just before request i's front.
    """
    ranks = []
    for r in range(cp_size):
        pieces = []
        for i, chunks in enumerate(chunk_bounds):
            if leading is not None and leading[i] is not None and leading[i][0] == r:
                pieces.append(leading[i][1])
            pieces.append(chunks[r])
        pieces += [chunks[2 * cp_size - 1 - r] for chunks in chunk_bounds]
        ranges = [torch.arange(s, e) for s, e in pieces if e > s]
        ranks.append(torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long))
    return ranks


def _token_zigzag(extend_lens, cp_size) -> list[torch.Tensor]:
    bounds, start = [], 0
    for n in extend_lens:
        chunks, edges = _near_equal_chunks(n, 2 * cp_size), []
        for size in chunks:
            edges.append((start, start + size))
            start += size
        bounds.append(edges)
    return _zigzag_assign(bounds, cp_size)


def _page_units(prefix: int, extend: int, page_size: int) -> list[int]:
    """Token counts of the pages a request's new tokens fall on, in order."""
    units, pos, end = [], prefix, prefix + extend
    while pos < end:
        stop = min((pos // page_size + 1) * page_size, end)
        units.append(stop - pos)
        pos = stop
    return units


def _page_zigzag(extend_lens, prefix_lens, cp_size, page_size, first_page_owners):
    """Zigzag over whole pages, or None when some request has too few pages for 2N chunks."""
    bounds, carved, start = [], [], 0
    for i, (n, prefix) in enumerate(zip(extend_lens, prefix_lens)):
        units = _page_units(prefix, n, page_size)
        carve = None
        owner = None if first_page_owners is None else first_page_owners[i]
        if prefix % page_size and owner is not None:
            # The first page already exists with an owner: its new tokens are that owner's.
            carve = (owner, (start, start + units[0]))
            start += units[0]
            units = units[1:]
        if len(units) < 2 * cp_size:
            return None
        edges = []
        for count in _near_equal_chunks(len(units), 2 * cp_size):
            size = sum(units[:count])
            units = units[count:]
            edges.append((start, start + size))
            start += size
        bounds.append(edges)
        carved.append(carve)
    return _zigzag_assign(bounds, cp_size, carved)


def _interleave(num_tokens, cp_size) -> list[torch.Tensor]:
    return [torch.arange(num_tokens)[r::cp_size] for r in range(cp_size)]


def plan_split(
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    cp_size: int,
    mode: str,
    page_size: int = 64,
    first_page_owners: Sequence[int | None] | None = None,
) -> SplitPlan:
    """Plan which rank computes which tokens of a prefill batch.

    `first_page_owners[i]` (page_zigzag only) is the owner of the page holding request i's
    first new token when its cached prefix ends mid-page; None lets the split choose.
    """
    extend_lens = tuple(int(n) for n in extend_lens)
    prefix_lens = tuple(int(n) for n in prefix_lens)
    _validate(extend_lens, prefix_lens, cp_size, mode, page_size, first_page_owners)
    page_aligned = False
    if mode == "interleave":
        ranks = _interleave(sum(extend_lens), cp_size)
    else:
        ranks = None
        if mode == "page_zigzag":
            ranks = _page_zigzag(extend_lens, prefix_lens, cp_size, page_size, first_page_owners)
            page_aligned = ranks is not None
        if ranks is None:
            ranks = _token_zigzag(extend_lens, cp_size)
    return SplitPlan(
        cp_size=cp_size,
        mode=mode,
        page_size=page_size,
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        page_aligned=page_aligned,
        rank_tokens=tuple(ranks),
    )
