"""The single-rank oracle path: one plain slot KV cache, no CP, no sharded store.

Deliberately independent of ``shared_kv/``: it mimics SGLang's paged ``req_to_token``
allocation in a few lines, so a bug in the sharded store cannot hide in both paths.

Slot layout, page_size = 4: request A prefills 6 tokens, B 3 tokens, then A extends by 3::

    page            0             1             2             3
    slot      0  1  2  3    4  5  6  7    8  9 10 11   12 13 14 15
    batch 1   A0 A1 A2 A3   A4 A5 .  .    B0 B1 B2 .   .  .  .  .
    batch 2                       A6 A7                A8

Position p of a request lives at ``pages[p // page_size] * page_size + p % page_size``; a
continuing request (chunked prefill, cached prefix, decode) keeps its pages and fills its last
page before taking a new one from the free list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from .config import DSAConfig
from .model import DenseKV, DSAModel, SynchronousKV


@dataclass(slots=True)
class SlotBatch:
    """Metadata of one forward batch, in SGLang's names; shared by the single and CP paths.

    prefix_lens, extend_lens, seq_lens: per request (host ints), seq = prefix + extend.
    out_cache_loc  int64 [num_tokens]: slot of each new token, flat batch order (request by
                   request, positions ascending).
    req_to_token   int64 [bs, max(seq_lens)]: slot of (request i, position p), -1 past seq_lens[i].
    positions      int64 [num_tokens]: position of each new token within its request.
    request_ids    int64 [num_tokens]: batch index of each new token's request.
    """

    request_keys: list[Hashable]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    positions: torch.Tensor
    request_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def last_token_idx(self) -> torch.Tensor:
        """int64 [bs]: flat index of each request's last new token."""
        return torch.tensor(self.extend_lens, device=self.positions.device).cumsum(0) - 1


class SlotKVCache(SynchronousKV):
    """Per-layer logical-slot KV cache: latent [L, num_slots, W], index_key uint8
    [L, num_slots, 128], index_scale float32 [L, num_slots]. Unwritten slots hold NaN
    (0xFF is NaN in float8_e4m3fn), so reading a slot that was never written shows up.

    Use as the model's KV context: ``begin_batch`` then ``model.forward(..., kv=cache)``.
    """

    def __init__(self, config: DSAConfig, num_slots: int, page_size: int, dtype=torch.float32, device="cpu"):
        if page_size < 1 or num_slots < page_size or num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} must be a positive multiple of page_size={page_size}")
        self.page_size = page_size
        shape = (config.num_layers, num_slots)
        self.latent = torch.full(shape + (config.latent_dim,), float("nan"), dtype=dtype, device=device)
        self.index_key = torch.full(shape + (config.index_head_dim,), 0xFF, dtype=torch.uint8, device=device)
        self.index_scale = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
        self._free_pages = deque(range(num_slots // page_size))
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self.batch: SlotBatch | None = None

    def begin_batch(self, request_keys: Sequence[Hashable], extend_lens: Sequence[int]) -> SlotBatch:
        """Allocate slots for each request's new tokens (continuing known keys) and make the
        result the current batch that :meth:`layer_kv` writes."""
        keys, extend_lens = list(request_keys), [int(n) for n in extend_lens]
        if len(keys) != len(extend_lens) or len(set(keys)) != len(keys):
            raise ValueError(f"need one extend length per distinct request key, got {keys=} {extend_lens=}")
        if min(extend_lens, default=0) < 1:
            raise ValueError(f"every request must extend by at least one token, got {extend_lens=}")
        prefix_lens = [self._lens.get(k, 0) for k in keys]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        new_pages = [self._num_pages(s) - len(self._pages.get(k, [])) for k, s in zip(keys, seq_lens)]
        if sum(new_pages) > len(self._free_pages):
            raise RuntimeError(
                f"SlotKVCache out of pages: batch needs {sum(new_pages)}, {len(self._free_pages)} free; "
                "raise num_slots or free finished requests"
            )
        for k, n, s in zip(keys, new_pages, seq_lens):
            self._pages.setdefault(k, []).extend(self._free_pages.popleft() for _ in range(n))
            self._lens[k] = s

        device = self.latent.device
        req_to_token = torch.full((len(keys), max(seq_lens)), -1, dtype=torch.long)
        for i, k in enumerate(keys):
            req_to_token[i, : seq_lens[i]] = self.slots_of(k)
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
        request_ids = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor(extend_lens))
        self.batch = SlotBatch(
            request_keys=keys,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            out_cache_loc=req_to_token[request_ids, positions].to(device),
            req_to_token=req_to_token.to(device),
            positions=positions.to(device),
            request_ids=request_ids.to(device),
        )
        return self.batch

    def slots_of(self, request_key: Hashable) -> torch.Tensor:
        """int64 [seq_len] (CPU): slot of every position of a request, its req_to_token row."""
        pos = torch.arange(self._lens[request_key])
        pages = torch.tensor(self._pages[request_key], dtype=torch.long)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def free(self, request_key: Hashable) -> None:
        """Return a finished request's pages to the free list."""
        self._free_pages.extend(self._pages.pop(request_key))
        del self._lens[request_key]

    def layer_kv(
        self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor
    ) -> DenseKV:
        """Write the batch's new tokens at ``out_cache_loc``; the whole layer cache is the view."""
        if self.batch is None:
            raise RuntimeError("SlotKVCache.layer_kv called before begin_batch")
        loc = self.batch.out_cache_loc
        self.latent[layer_id, loc] = latent
        self.index_key[layer_id, loc] = index_key
        self.index_scale[layer_id, loc] = index_scale
        return DenseKV(
            self.latent[layer_id], self.index_key[layer_id], self.index_scale[layer_id], self.batch.req_to_token
        )

    def _num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@torch.no_grad()
def prefill_single(
    model: DSAModel,
    batch_input_ids: Sequence[torch.Tensor],
    cache: SlotKVCache,
    request_keys: Sequence[Hashable],
    return_topk: bool = False,
):
    """Extend each request by its new tokens in one batch; logits of each last token [bs, vocab].

    batch_input_ids: one int64 [extend_len] per request. Known keys continue (chunked prefill,
    cached prefix); new keys start at position 0. With ``return_topk`` also returns the
    per-layer selections of :meth:`DSAModel.forward`, in flat batch order.
    """
    if len(batch_input_ids) != len(request_keys):
        raise ValueError(f"{len(batch_input_ids)} token lists for {len(request_keys)} request keys")
    batch = cache.begin_batch(request_keys, [len(ids) for ids in batch_input_ids])
    input_ids = torch.cat(list(batch_input_ids)).to(batch.positions.device)
    out = model(input_ids, batch.positions, batch.request_ids, cache, return_topk=return_topk)
    hidden, topk = out if return_topk else (out, None)
    logits = model.logits(hidden[batch.last_token_idx])
    return (logits, topk) if return_topk else logits


def decode_step(
    model: DSAModel, cache: SlotKVCache, request_keys: Sequence[Hashable], token_ids: torch.Tensor
) -> torch.Tensor:
    """One decode step (an extend of one token per request): token_ids int64 [bs] -> logits [bs, vocab]."""
    return prefill_single(model, list(token_ids.reshape(-1, 1)), cache, request_keys)
