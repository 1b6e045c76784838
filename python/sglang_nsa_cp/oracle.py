"""The correctness oracle: one scenario through single-rank, replicated-CP and shared-KV-CP prefill.

A scenario is a list of chunks; each chunk is one prefill batch of (request, new tokens). A
request named again continues where it stopped (chunked prefill, cached prefix ending anywhere,
mid-page included). The three paths must give the same logits (within `RTOL` in float32), the
same top-k selections at every layer, and the same KV at every logical slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang_nsa_cp.comm import TrafficCounter, run_ranks
from sglang_nsa_cp.layout import OwnerClassedAllocator, RequestPageTable
from sglang_nsa_cp.reference import DSAModel, SlotKVCache, get_config
from sglang_nsa_cp.reference.cp import ReplicatedCPKV, SharedCPKV, prefill_cp
from sglang_nsa_cp.shared_kv import KVStore

RTOL = 1e-5
PATHS = ("replicated", "shared")
# The replicated path is today's SGLang split; shared KV needs page-aligned cuts where possible.
PATH_SPLIT_MODES = {
    "zigzag": {"replicated": "zigzag", "shared": "page_zigzag"},
    "interleave": {"replicated": "interleave", "shared": "interleave"},
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class Scenario:
    chunks: list[list[tuple[str, int]]]
    cp_size: int = 4
    split: str = "zigzag"
    page_size: int = 16
    config: str = "tiny"
    seed: int = 0
    dtype: str = "float32"
    prefetch: bool = True  # shared path: materialize history one layer ahead

    def __post_init__(self):
        if self.split not in PATH_SPLIT_MODES:
            raise ValueError(f"split must be one of {sorted(PATH_SPLIT_MODES)}, got {self.split!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be at least 1, got {self.cp_size}")
        for chunk in self.chunks:
            keys = [k for k, _ in chunk]
            if len(set(keys)) != len(keys):
                raise ValueError(f"a chunk names a request twice: {keys}")
            if any(n < 1 for _, n in chunk):
                raise ValueError(f"every request in a chunk needs at least one new token: {chunk}")

    @classmethod
    def from_lens(cls, extend_lens, prefix_lens, **kw) -> "Scenario":
        """Requests r0, r1, ...: a first chunk prefills the non-zero prefixes (the cache), a
        second extends every request by its extend length."""
        if len(extend_lens) != len(prefix_lens):
            raise ValueError(f"{len(extend_lens)} extend lengths but {len(prefix_lens)} prefix lengths")
        if any(p < 0 for p in prefix_lens):
            raise ValueError(f"prefix lengths must be >= 0, got {list(prefix_lens)}")
        cached = [(f"r{i}", p) for i, p in enumerate(prefix_lens) if p > 0]
        extend = [(f"r{i}", e) for i, e in enumerate(extend_lens)]
        return cls(chunks=[cached, extend] if cached else [extend], **kw)

    def tokens(self, vocab_size: int) -> list[list[torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed + 1)
        return [[torch.randint(0, vocab_size, (n,), generator=g) for _, n in chunk] for chunk in self.chunks]

    def final_lengths(self) -> dict[str, int]:
        lengths: dict[str, int] = {}
        for chunk in self.chunks:
            for key, n in chunk:
                lengths[key] = lengths.get(key, 0) + n
        return lengths

    def num_pages(self) -> int:
        """A pool just large enough for the scenario, in whole pages per rank."""
        pages = sum(-(-n // self.page_size) for n in self.final_lengths().values())
        return -(-pages // self.cp_size) * self.cp_size


@dataclass
class PathResult:
    logits: list[torch.Tensor]  # per chunk [bs, vocab]
    topk: list[list[torch.Tensor]]  # per chunk, per layer [num_tokens, topk] in flat order
    kv: dict[str, list[torch.Tensor]]  # per request, per layer: latent rows in position order
    kv_bytes: int = 0  # the pool this rank allocated (capacity)
    held_pages: int = 0  # pages of the scenario's requests this rank keeps
    held_bytes: int = 0  # held_pages x bytes per page (all layers, latent and index)
    traffic: dict = field(default_factory=dict)
    seconds: float = 0.0


class _Capture:
    """Wraps a KV context to record each layer's dense view per request, in position order."""

    def __init__(self, inner, keys, seq_lens, kv):
        self.inner, self.keys, self.seq_lens, self.kv = inner, keys, seq_lens, kv

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_layer(self, layer_id, *fresh):
        self.inner.begin_layer(layer_id, *fresh)

    def finish_layer(self, layer_id):
        dense = self.inner.finish_layer(layer_id)
        for i, (key, n) in enumerate(zip(self.keys, self.seq_lens)):
            rows = dense.latent[dense.req_rows[i, :n]]
            per_layer = self.kv.setdefault(key, [])
            if layer_id < len(per_layer):
                per_layer[layer_id] = rows.clone()
            else:
                per_layer.append(rows.clone())
        return dense


def build_model(s: Scenario) -> DSAModel:
    return DSAModel(get_config(s.config), seed=s.seed, dtype=DTYPES[s.dtype])


def run_single(s: Scenario) -> PathResult:
    start = time.perf_counter()
    model = build_model(s)
    cache = SlotKVCache(model.config, s.num_pages() * s.page_size, s.page_size, dtype=DTYPES[s.dtype])
    result = PathResult([], [], {})
    for chunk, ids in zip(s.chunks, s.tokens(model.config.vocab_size)):
        keys = [k for k, _ in chunk]
        batch = cache.begin_batch(keys, [n for _, n in chunk])
        kv = _Capture(cache, keys, batch.seq_lens, result.kv)
        input_ids = torch.cat(ids)
        hidden, topk = model(input_ids, batch.positions, batch.request_ids, kv, return_topk=True)
        result.logits.append(model.logits(hidden[batch.last_token_idx]))
        result.topk.append(topk)
    result.kv_bytes = sum(t.numel() * t.element_size() for t in (cache.latent, cache.index_key, cache.index_scale))
    pages_in_use = {
        p for key in s.final_lengths() for p in (cache.slots_of(key)[:: s.page_size] // s.page_size).tolist()
    }
    result.held_pages = len(pages_in_use)
    result.held_bytes = result.held_pages * result.kv_bytes // s.num_pages()
    result.seconds = time.perf_counter() - start
    return result


def run_cp_rank(rank: int, world: int, group, s: Scenario) -> dict[str, PathResult]:
    """One rank of both CP paths, one after the other (call through `run_ranks`)."""
    model = build_model(s)
    return {path: _run_cp_path(rank, world, group, s, model, path) for path in PATHS}


def _run_cp_path(rank, world, group, s: Scenario, model: DSAModel, path: str) -> PathResult:
    start = time.perf_counter()
    cfg = model.config
    table = RequestPageTable(OwnerClassedAllocator(s.num_pages(), world), s.page_size)
    store_kw = dict(
        num_layers=cfg.num_layers,
        num_pages=s.num_pages(),
        page_size=s.page_size,
        latent_dim=cfg.latent_dim,
        latent_dtype=DTYPES[s.dtype],
    )
    store = KVStore(cp_size=world, rank=rank, **store_kw) if path == "shared" else KVStore.replicated(**store_kw)
    context = (lambda *a: SharedCPKV(*a, prefetch=s.prefetch)) if path == "shared" else ReplicatedCPKV
    counter = TrafficCounter()
    result = PathResult([], [], {})
    for chunk, ids in zip(s.chunks, s.tokens(cfg.vocab_size)):
        keys = [k for k, _ in chunk]
        plan, batch = table.schedule(keys, [n for _, n in chunk], PATH_SPLIT_MODES[s.split][path])
        kv = _Capture(context(store, plan, batch, rank, group, counter), keys, batch.seq_lens, result.kv)
        logits, topk = prefill_cp(model, torch.cat(ids), kv, narrow_tail=path == "shared", return_topk=True)
        result.logits.append(logits)
        # Local selections back to flat order on the parent: keep them with their token indices.
        result.topk.append([(plan.token_indices(rank), t) for t in topk])
    result.kv_bytes = store.nbytes()
    result.held_pages = held_pages(store, table)
    result.held_bytes = result.held_pages * result.kv_bytes // store.local_pages
    result.traffic = counter.as_dict()
    result.seconds = time.perf_counter() - start
    return result


def held_pages(store: KVStore, table: RequestPageTable) -> int:
    """Pages of the live requests that `store`'s rank persists: all of them in a replicated
    store, the ones it owns (page % N == rank) in a shared one."""
    pages = sorted({p for req_pages in table.pages.values() for p in req_pages})
    if not pages:
        return 0
    first_slots = torch.tensor(pages, dtype=torch.long) * store.page_size
    return int(store.owns(first_slots).sum())


def _flat_topk(per_rank: list[PathResult], chunk: int) -> list[torch.Tensor]:
    layers = []
    for layer in range(len(per_rank[0].topk[chunk])):
        pieces = [r.topk[chunk][layer] for r in per_rank]
        n = sum(idx.numel() for idx, _ in pieces)
        width = pieces[0][1].shape[1]
        flat = torch.empty((n, width), dtype=torch.long)
        for idx, sel in pieces:
            flat[idx] = sel
        layers.append(flat)
    return layers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def compare(s: Scenario, single: PathResult, per_rank: list[PathResult]) -> dict:
    """Oracle checks of one CP path against the single rank."""
    logit_err = max(rel_err(r.logits[c], single.logits[c]) for r in per_rank for c in range(len(s.chunks)))
    topk_equal = all(
        torch.equal(a, b) for c in range(len(s.chunks)) for a, b in zip(_flat_topk(per_rank, c), single.topk[c])
    )
    kv_err = max(
        rel_err(r.kv[key][layer], single.kv[key][layer])
        for r in per_rank
        for key in single.kv
        for layer in range(len(single.kv[key]))
    )
    return {
        "max_rel_logit_err": logit_err,
        "topk_identical": topk_equal,
        "max_rel_kv_err": kv_err,
        "ok": logit_err <= RTOL and topk_equal and kv_err <= RTOL,
    }


def run_oracle(s: Scenario, timeout_s: float = 300.0) -> dict:
    """All three paths and the checks; the report the demo prints and the tests assert on."""
    single = run_single(s)
    report = {
        "scenario": {
            "chunks": s.chunks,
            "cp_size": s.cp_size,
            "split": s.split,
            "page_size": s.page_size,
            "config": s.config,
            "seed": s.seed,
            "dtype": s.dtype,
            "prefetch": s.prefetch,
        }
    }
    report["paths"] = {
        "single": {
            "seconds": single.seconds,
            "kv_bytes": single.kv_bytes,
            "held_pages": single.held_pages,
            "held_bytes": single.held_bytes,
        }
    }
    ranks = run_ranks(run_cp_rank, s.cp_size, args=(s,), timeout_s=timeout_s)
    for path in PATHS:
        per_rank = [r[path] for r in ranks]
        checks = compare(s, single, per_rank)
        report["paths"][path] = {
            **checks,
            "kv_bytes_per_rank": [r.kv_bytes for r in per_rank],
            "held_pages_per_rank": [r.held_pages for r in per_rank],
            "held_bytes_per_rank": [r.held_bytes for r in per_rank],
            "bytes_moved": per_rank[0].traffic,
            "seconds": max(r.seconds for r in per_rank),
        }
    report["kv_per_rank"] = kv_per_rank(report["paths"])
    report["ok"] = all(report["paths"][p]["ok"] for p in PATHS)
    return report


def kv_per_rank(paths: dict) -> dict:
    """Shared against replicated KV on the busiest rank: held (pages of the scenario's requests)
    and pool (capacity, sized for the scenario and rounded up to whole pages per rank)."""
    shared, replicated = paths["shared"], paths["replicated"]
    return {
        "held_ratio": max(shared["held_bytes_per_rank"]) / max(replicated["held_bytes_per_rank"]),
        "pool_ratio": max(shared["kv_bytes_per_rank"]) / max(replicated["kv_bytes_per_rank"]),
        "pages_in_use": max(replicated["held_pages_per_rank"]),
        "busiest_shared_rank_pages": max(shared["held_pages_per_rank"]),
    }
