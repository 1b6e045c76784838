"""What the shared KV's capacity buys: a production trace replayed through SGLang 0.5.23's own
radix cache, once at the capacity of a replicated CP group and once at the capacity the flag gives.

    python benchmark/bench_trace_replay.py                       # the shipped Mooncake trace: 2-4 min on 2 cores
    python benchmark/bench_trace_replay.py --limit 2000 --cp 8 --kv-dtypes fp8 --scratch-contexts 1   # quick

For each CP size, KV dtype and path (replicated; shared with `--scratch-contexts` C) it replays
the trace's requests, at their arrival times, FIFO through one prefill group: SGLang's
`UnifiedRadixCache` (what 0.5.23's scheduler builds for a DSA model: `create_tree_cache` ->
`create_unified_radix_cache`, FULL component, its default Rust tree core and LRU eviction) with
a `TokenToKVPoolAllocator` of the path's capacity, and a chunk time from a cost model fitted to
our H200 measurements of SGLang's DSA forward (docs/trace_replay.md says what is measured and
what is assumed). One JSON row per configuration, a table, DIR/bench_trace_replay.json and
DIR/bench_trace_replay.png (hit fraction and TTFT against capacity).

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
compute: `_compute_max_prefix_len`), computes the rest (the partial last page counts its real
tokens) and, when done, inserts its floor(input_length / 64) full pages; a chunked request
inserts what it has after every chunk (`checkpoint_into_tree`), as SGLang's scheduler does.
A partial last block that a later request extends gets a new id in the trace, so its full pages
cannot be matched here even where the tokens agree: hits are, if anything, undercounted.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import time
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from tables import format_table, parse_comma_list, save_plot  # noqa: E402

DEFAULT_TRACE = os.path.join(ROOT, "benchmark", "data", "mooncake_conversation_trace.jsonl.gz")
MEASUREMENTS = {
    "bf16": os.path.join(ROOT, "benchmark", "results", "bench_sglang_prefill.json"),
    "fp8": os.path.join(ROOT, "benchmark", "results", "bench_sglang_prefill_fp8.json"),
}
PAGE = 64  # SGLang's page size for DSA (FlashMLA)
BLOCK = 512  # tokens per Mooncake hash id
PAGES_PER_BLOCK = BLOCK // PAGE
GIB = 1 << 30

# GLM-5 (what the defaults describe; docs/trace_replay.md gives the sources)
LAYERS = 78
CONTEXT_LEN = 202752
KV_LORA_RANK, ROPE_DIM, INDEX_HEAD_DIM = 512, 64, 128
KV_CACHE_DIM = {"bf16": 576, "fp8": 656}  # SGLang's calculate_mla_kv_cache_dim (fp8: FlashMLA's row)
WEIGHT_BYTES = 744e9  # GLM-5 FP8: ~744B parameters at one byte each
H200_BYTES = 143771 * (1 << 20)  # what nvidia-smi reports for one H200 (143,771 MiB)
MEM_FRACTION_STATIC = 0.85  # weights + KV; the rest is activations, CUDA graphs, NCCL
NODE_GPUS = 8  # one prefill group is one 8-GPU node: weights over TP 8, attention CP N x TP 8/N
UPSTREAM_SCRATCH_CONTEXTS = 8  # sglang.srt.mem_cache.page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS


class UsageError(Exception):
    """A bad option value: the command prints one line and exits 2."""


# ---------------------------------------------------------------------------------------------
# the trace
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # at speed 1
    input_len: int
    page_keys: array  # int64, one per full page: floor(input_len / 64)


def page_keys(hash_ids: list[int], input_len: int) -> array:
    """One key per full 64-token page: `hash_id * 8 + page_in_block` (see the module docstring)."""
    return array(
        "q", (hash_ids[j // PAGES_PER_BLOCK] * PAGES_PER_BLOCK + j % PAGES_PER_BLOCK for j in range(input_len // PAGE))
    )


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
    return TraceRequest(ts / 1000.0, length, page_keys(ids, length))


# ---------------------------------------------------------------------------------------------
# capacity: bytes per token from SGLang's pool, the KV budget, the shared pool's scratch
# ---------------------------------------------------------------------------------------------


def measure_kv_bytes_per_token(kv_dtype: str, layers: int = LAYERS) -> int:
    """Bytes one token takes in SGLang's `DSATokenToKVPool` (latent rows and index K with its
    scale, all layers): the difference between two CPU pools of one layer, 64 and 128 pages."""
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_dtype]

    def nbytes(size: int) -> int:
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
            pool = DSATokenToKVPool(
                size=size, page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                layer_num=1, device="cpu", index_head_dim=INDEX_HEAD_DIM, enable_memory_saver=False,
                kv_cache_dim=KV_CACHE_DIM[kv_dtype],
            )  # fmt: skip
        return sum(t.numel() * t.element_size() for t in (*pool.kv_buffer, *pool.index_k_with_scale_buffer))

    per_layer = (nbytes(128 * PAGE) - nbytes(64 * PAGE)) // (64 * PAGE)
    return per_layer * layers


def scratch_row_bytes(kv_dtype: str) -> int:
    """One token of ONE layer in the shared pool's scratch: SGLang's `_page_shard_row_bytes` for
    a DSA model (latent row + FP8 index K + one fp32 scale per 128)."""
    kv_size = 2 if kv_dtype == "bf16" else 1
    return KV_CACHE_DIM[kv_dtype] * kv_size + INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4


def scratch_bytes(cp: int, kv_dtype: str, contexts: int, chunk: int, context_len: int = CONTEXT_LEN) -> int:
    """SGLang's `compute_page_shard_scratch_bytes` per rank: two slots (double buffer) of one
    layer's [prefix | chunk | trash page] rows, prefix = C contexts each rounded up to N pages
    (`make_page_shard_spec`), chunk = chunked_prefill_size rounded up to a page."""
    granule = cp * PAGE
    rows = contexts * _ceil_to(context_len, granule) + _ceil_to(chunk, PAGE) + PAGE
    return 2 * rows * scratch_row_bytes(kv_dtype)


def default_budget_bytes() -> tuple[int, list[str]]:
    """KV bytes per GPU that an H200 leaves next to GLM-5's weights, with the arithmetic."""
    weights = WEIGHT_BYTES / NODE_GPUS
    budget = int(H200_BYTES * MEM_FRACTION_STATIC - weights)
    lines = [
        f"H200 memory {H200_BYTES / GIB:.1f} GiB (nvidia-smi: 143,771 MiB) x mem-fraction-static "
        f"{MEM_FRACTION_STATIC} = {H200_BYTES * MEM_FRACTION_STATIC / GIB:.1f} GiB for weights and KV "
        f"(the other {1 - MEM_FRACTION_STATIC:.2f}: activations, CUDA graphs, NCCL)",
        f"GLM-5 FP8 weights ~{WEIGHT_BYTES / 1e9:.0f} GB (744B params x 1 byte) over the {NODE_GPUS} GPUs of "
        f"the prefill node (TP {NODE_GPUS}, attention CP N x TP {NODE_GPUS}/N): {weights / GIB:.1f} GiB per GPU "
        f"(TP = CP alone does not fit at CP 2 and 4: {WEIGHT_BYTES / 2 / 1e9:.0f} and {WEIGHT_BYTES / 4 / 1e9:.0f} GB)",
        f"KV budget per GPU = {H200_BYTES * MEM_FRACTION_STATIC / GIB:.1f} - {weights / GIB:.1f} = {budget / GIB:.2f} GiB",
    ]
    return budget, lines


def capacity_tokens(budget: int, kv_bytes_per_token: int, cp: int, path: str, scratch: int = 0) -> int:
    """Tokens of KV one prefill group holds, in whole pages: replicated = one rank's pool (every
    rank holds everything); shared = N x (budget - scratch) / bytes per token."""
    if path == "replicated":
        return (budget // kv_bytes_per_token) // PAGE * PAGE
    return cp * (((budget - scratch) // kv_bytes_per_token) // PAGE * PAGE)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------
# cost model: time of one prefill chunk
# ---------------------------------------------------------------------------------------------

COST_FORM = "chunk_ms = outside_ms + (78/16) x (2/8) x (c0 + c1 x new + c2 x sum_i new_i x (hist_i + new_i / 2))"


def fit_cost_model(paths: dict[str, str] = MEASUREMENTS) -> dict:
    """Least-squares fit of every chunk the H200 runs timed (16 attention-only layers, CP=2 on
    2 x H200): layer time (chunk ms - the case's time outside the layers) against new tokens and
    the attention pairs new x (history + new / 2), per KV dtype and path (replicated; shared with
    prefetch). Returns the model as a JSON-able dict with each point's fit error."""
    import numpy as np

    model = {"form": COST_FORM, "layers_measured": None, "layers": LAYERS, "cp_measured": None, "gpus": NODE_GPUS,
             "sources": {}, "stand_ins": {}, "fits": {}}  # fmt: skip
    for kv_dtype, path in paths.items():
        raw = json.load(open(path))
        model["layers_measured"], model["cp_measured"] = raw["args"]["layers"], raw["args"]["cp"]
        model["sources"][kv_dtype] = os.path.relpath(path, ROOT)
        model["stand_ins"][kv_dtype] = raw["stand_ins"].splitlines()[0]
        for name, measured in (("replicated", "replicated"), ("shared", "shared_prefetch")):
            points = []  # (new, hist, chunk_ms, outside_ms)
            for p in (p for p in raw["paths"] if p["path"] == measured):
                for new, hist, ms in _chunks_of(p["case"], raw["args"]["chunk"], p["chunk_ms"]):
                    points.append((new, hist, ms, p["outside_layers_ms_per_chunk"]))
            a = np.array([[1.0, n, n * (h + n / 2)] for n, h, _, _ in points])
            y = np.array([ms - out for _, _, ms, out in points])
            coef = np.linalg.lstsq(a, y, rcond=None)[0]
            outside = float(np.mean([out for *_, out in points]))
            fit = [float(outside + a_i @ coef) for a_i in a]
            errs = [abs(f - ms) / ms for f, (_, _, ms, _) in zip(fit, points)]
            model["fits"][f"{name}/{kv_dtype}"] = {
                "c0_ms": float(coef[0]), "c1_ms_per_token": float(coef[1]), "c2_ms_per_pair": float(coef[2]),
                "outside_ms": outside, "max_rel_err": max(errs), "mean_rel_err": sum(errs) / len(errs),
                "points": [{"new": n, "hist": h, "measured_ms": ms, "fit_ms": f} for (n, h, ms, _), f in zip(points, fit)],
            }  # fmt: skip
    return model


def _chunks_of(case: str, chunk: int, chunk_ms: list[float]):
    """(new, history, ms) of each timed chunk of a bench_sglang_prefill case: 'cold 32k' (chunks
    of `chunk` from history 0) or 'hit 60k+4k' (one chunk of 4k after a 60k prefix)."""
    kind, size = case.split()
    if kind == "cold":
        return [(chunk, i * chunk, ms) for i, ms in enumerate(chunk_ms)]
    prefix, new = (int(s[:-1]) * 1024 for s in size.split("+"))
    assert len(chunk_ms) == 1, f"{case}: one chunk expected, got {len(chunk_ms)}"
    return [(new, prefix, chunk_ms[0])]


def load_cost_model(path: str) -> dict:
    try:
        model = json.load(open(path))
        for key, fit in model["fits"].items():
            for field in ("c0_ms", "c1_ms_per_token", "c2_ms_per_pair", "outside_ms"):
                float(fit[field])
        int(model["layers"]), int(model["layers_measured"]), int(model["cp_measured"]), int(model["gpus"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--cost-model {path}: not a cost model like DIR/bench_trace_replay_cost_model.json ({exc!r})")
    return model


def chunk_seconds(model: dict, path: str, kv_dtype: str, batch: list[tuple[int, int]]) -> float:
    """Seconds one prefill batch takes: `batch` is (new tokens, history tokens) per request."""
    fit = model["fits"][f"{path}/{kv_dtype}"]
    new = sum(n for n, _ in batch)
    pairs = sum(n * (h + n / 2) for n, h in batch)
    layers_ms = fit["c0_ms"] + fit["c1_ms_per_token"] * new + fit["c2_ms_per_pair"] * pairs
    scale = (model["layers"] / model["layers_measured"]) * (model["cp_measured"] / model["gpus"])
    return (fit["outside_ms"] + scale * layers_ms) / 1000.0


# ---------------------------------------------------------------------------------------------
# SGLang's radix cache over page keys
# ---------------------------------------------------------------------------------------------


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

    def match(self, keys: array, limit: int):
        """Cached pages of keys[:limit] and the node they end on."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if limit <= 0:
            return 0, self.tree.root_node_handle()
        result = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(keys[:limit])))
        return result.device_prefix_len, result.last_device_node

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock) -> None:
        self.tree.unlock(lock)

    def alloc(self, num_pages: int):
        """`num_pages` free slots, evicting unlocked LRU leaves first if needed; None when even
        eviction cannot free enough (the rest is locked by running requests)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        short = num_pages - self.allocator.available_size()
        if short > 0:
            self.tree.evict(EvictParams(num_tokens=short))
        return self.allocator.alloc(num_pages)

    def free(self, slots) -> None:
        self.allocator.free(slots)

    def insert(self, keys: array, slots, protected_pages: int):
        """Insert keys with their slots (the tree frees this request's duplicate slots past
        `protected_pages`); returns the node it ends on and the tree's slots for the keys."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        params = InsertParams(key=RadixKey(keys), value=slots, prev_prefix_len=protected_pages,
                              inserted_len=protected_pages)  # fmt: skip
        node = self.tree.insert(params).last_device_node
        path = self.tree.path_device_indices(node)
        assert len(path) == len(keys), f"insert ended at {len(path)} pages, {len(keys)} keys"
        return node, path

    def cached_pages(self) -> int:
        return self.capacity_pages - self.allocator.available_size()


# ---------------------------------------------------------------------------------------------
# one prefill group: FIFO, chunked prefill, the shared pool's scratch admission
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayConfig:
    cp: int
    kv_dtype: str
    path: str  # "replicated" or "shared"
    scratch_contexts: int | None  # shared only
    capacity_tokens: int
    chunk: int = 8192
    speed: float = 1.0
    context_len: int = CONTEXT_LEN

    def max_prefix_tokens(self) -> int | None:
        """The shared pool's scratch prefix region (`PageShardSpec.max_prefix_tokens`)."""
        if self.path != "shared":
            return None
        return self.scratch_contexts * _ceil_to(self.context_len, self.cp * PAGE)


@dataclasses.dataclass(slots=True)
class _Running:
    req: TraceRequest
    cached_tokens: int  # prefix hit at admission
    done_tokens: int  # tokens with KV: the hit plus what was computed
    slots: object  # int64 tensor, one slot per page started (the last may be partial)
    protected_pages: int  # pages the tree holds for it (its lock covers them)
    lock: object


@dataclasses.dataclass
class ReplayStats:
    served: int = 0
    rejected: int = 0  # longer than the cache or the context: SGLang refuses them
    input_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    gpu_s: float = 0.0
    batches: int = 0
    max_queue: int = 0
    deferred_by_scratch: int = 0  # admissions the scratch prefix region put off to a later batch
    ttft_s: list = dataclasses.field(default_factory=list)


def replay(requests: list[TraceRequest], cfg: ReplayConfig, model: dict, progress=None) -> ReplayStats:
    """Replay `requests` through one prefill group with SGLang's radix cache at
    `cfg.capacity_tokens`. Each batch: the chunked request first, then waiting requests FIFO
    while the chunk budget lasts (the last one chunked at a page boundary); a request is admitted
    only when its pages can be allocated (evicting LRU) and, on the shared path, when the batch's
    padded history still fits the scratch prefix region (`_kv_shard_reserve_scratch`)."""
    cache = PagePrefixCache(cfg.capacity_tokens // PAGE)
    stats = ReplayStats()
    waiting: collections.deque[TraceRequest] = collections.deque()
    chunked: _Running | None = None
    now, nxt, n = 0.0, 0, len(requests)
    cost_path = "shared" if cfg.path == "shared" else "replicated"
    while nxt < n or waiting or chunked is not None:
        while nxt < n and requests[nxt].arrival_s / cfg.speed <= now:
            req = requests[nxt]
            nxt += 1
            if -(-req.input_len // PAGE) > cache.capacity_pages or req.input_len > cfg.context_len:
                stats.rejected += 1
                continue
            waiting.append(req)
        stats.max_queue = max(stats.max_queue, len(waiting))
        batch = _build_batch(cache, cfg, waiting, chunked, stats)
        if not batch:
            assert chunked is None and not waiting, (
                "nothing admitted with work waiting: a request larger than the cache?"
            )
            now = max(now, requests[nxt].arrival_s / cfg.speed)
            continue
        dt = chunk_seconds(model, cost_path, cfg.kv_dtype, [(take, run.done_tokens) for run, take in batch])
        now += dt
        stats.gpu_s += dt
        stats.batches += 1
        chunked = None
        for run, take in batch:
            run.done_tokens += take
            stats.computed_tokens += take
            if run.done_tokens < run.req.input_len:
                _checkpoint(cache, run)
                chunked = run
            else:
                _finish(cache, run)
                stats.served += 1
                stats.ttft_s.append(now - run.req.arrival_s / cfg.speed)
                if progress is not None:
                    progress(stats.served + stats.rejected)
    return stats


def _build_batch(cache: PagePrefixCache, cfg: ReplayConfig, waiting, chunked: _Running | None, stats) -> list:
    budget = cfg.chunk
    prefix_cap = cfg.max_prefix_tokens()
    scratch = {"block_pages": 0, "chunk_pages": 0}
    batch: list[tuple[_Running, int]] = []
    if chunked is not None:
        take = min(chunked.req.input_len - chunked.done_tokens, budget // PAGE * PAGE)
        assert _reserve_scratch(cfg, prefix_cap, scratch, chunked.done_tokens, take), "chunked request off the scratch"
        assert _grow(cache, chunked, take), "no page for the chunked request: the cache is smaller than one request"
        batch.append((chunked, take))
        budget -= take
    while waiting and budget >= PAGE:
        req = waiting[0]
        limit = (req.input_len - 1) // PAGE
        hit_pages, node = cache.match(req.page_keys, limit)
        extend = req.input_len - hit_pages * PAGE
        take = extend if extend <= budget else budget // PAGE * PAGE
        if not _reserve_scratch(cfg, prefix_cap, scratch, hit_pages * PAGE, take):
            stats.deferred_by_scratch += 1
            break
        lock = cache.lock(node)
        path = cache.tree.path_device_indices(node)[:hit_pages]
        run = _Running(req, hit_pages * PAGE, hit_pages * PAGE, path, hit_pages, lock)
        if not _grow(cache, run, take):
            cache.unlock(lock)
            break
        waiting.popleft()
        stats.input_tokens += req.input_len
        stats.cached_tokens += run.cached_tokens
        batch.append((run, take))
        budget -= take
    return batch


def _reserve_scratch(cfg: ReplayConfig, prefix_cap: int | None, scratch: dict, prefix_len: int, extend: int) -> bool:
    """SGLang's `PrefillAdder._kv_shard_reserve_scratch`: the batch's histories, each padded to
    N pages, must fit the prefix region (C contexts); its new pages the chunk region."""
    if prefix_cap is None:
        return True
    block = scratch["block_pages"] + -(-(prefix_len // PAGE) // cfg.cp)
    chunk = scratch["chunk_pages"] + -(-extend // PAGE)
    if cfg.cp * block * PAGE > prefix_cap or chunk * PAGE > _ceil_to(cfg.chunk, PAGE):
        return False
    scratch["block_pages"], scratch["chunk_pages"] = block, chunk
    return True


def _grow(cache: PagePrefixCache, run: _Running, take: int) -> bool:
    """Slots for `take` more tokens of `run` (the pages they start)."""
    need = -(-(run.done_tokens + take) // PAGE) - len(run.slots)
    if need <= 0:
        return True
    slots = cache.alloc(need)
    if slots is None:
        return False
    run.slots = cache.torch.cat([run.slots, slots])
    return True


def _checkpoint(cache: PagePrefixCache, run: _Running) -> None:
    """After a chunk (page-aligned): insert what the request has, move its lock to the new end."""
    pages = run.done_tokens // PAGE
    node, path = cache.insert(run.req.page_keys[:pages], run.slots[:pages], run.protected_pages)
    run.slots = cache.torch.cat([path, run.slots[pages:]])
    old, run.lock, run.protected_pages = run.lock, cache.lock(node), pages
    cache.unlock(old)


def _finish(cache: PagePrefixCache, run: _Running) -> None:
    """Prefill done: insert the prompt's full pages, free the partial last page, drop the lock."""
    pages = run.req.input_len // PAGE
    cache.insert(run.req.page_keys[:pages], run.slots[:pages], run.protected_pages)
    cache.free(run.slots[pages:])
    cache.unlock(run.lock)


def summarize(cfg: ReplayConfig, stats: ReplayStats, wall_s: float) -> dict:
    import numpy as np

    ttft = np.array(stats.ttft_s) if stats.ttft_s else np.array([float("nan")])
    return {
        "cp": cfg.cp, "kv_dtype": cfg.kv_dtype, "path": cfg.path, "scratch_contexts": cfg.scratch_contexts,
        "capacity_tokens": cfg.capacity_tokens,
        "prefix_hit_fraction": stats.cached_tokens / max(stats.input_tokens, 1),
        "prefill_tokens_computed": stats.computed_tokens, "prefill_gpu_s": stats.gpu_s,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)), "max_queue": stats.max_queue,
        "served": stats.served, "rejected": stats.rejected, "input_tokens": stats.input_tokens,
        "cached_tokens": stats.cached_tokens, "batches": stats.batches,
        "deferred_by_scratch": stats.deferred_by_scratch, "speed": cfg.speed, "chunk": cfg.chunk,
        "replay_wall_s": wall_s,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage too)
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSON lines, plain or .gz")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"), help="directory for JSON and PNG")
    p.add_argument("--cp", default="2,4,8", help="CP sizes, e.g. 2,4,8 (each 2 to 64)")
    p.add_argument("--kv-dtypes", default="bf16,fp8", help="bf16 and/or fp8")
    p.add_argument("--budget-gib", type=float, default=None, help="KV bytes per GPU (default: an H200 next to GLM-5)")
    p.add_argument("--speed", type=float, default=1.0, help="arrival-rate factor: 2 replays the trace twice as fast")
    p.add_argument("--scratch-contexts", default="1,2,8", help="shared pool's scratch prefix contexts C (8: SGLang's)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="new tokens per prefill batch")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--cost-model", default=None, help="a cost-model JSON instead of fitting the H200 measurements")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every value before any work; UsageError names the value, the rule and the fix."""
    for name in ("cp", "scratch_contexts"):
        try:
            setattr(args, name, parse_comma_list(getattr(args, name), int, low=1 if name != "cp" else 2))
        except ValueError as exc:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: {exc}") from None
    if max(args.cp) > 64:
        raise UsageError(f"--cp {max(args.cp)}: must be from 2 to 64 (a prefill group's CP size)")
    if max(args.scratch_contexts) > 64:
        raise UsageError(f"--scratch-contexts {max(args.scratch_contexts)}: must be from 1 to 64")
    dtypes = [d.strip() for d in args.kv_dtypes.split(",")]
    if not dtypes or set(dtypes) - {"bf16", "fp8"}:
        raise UsageError(f"--kv-dtypes {args.kv_dtypes!r}: must be bf16, fp8 or bf16,fp8")
    args.kv_dtypes = list(dict.fromkeys(dtypes))
    if args.budget_gib is not None and not (0 < args.budget_gib <= 1024 and math.isfinite(args.budget_gib)):
        raise UsageError(f"--budget-gib {args.budget_gib}: must be a KV budget per GPU above 0 and at most 1024")
    if not (0 < args.speed <= 1000 and math.isfinite(args.speed)):
        raise UsageError(f"--speed {args.speed}: must be above 0 and at most 1000 (1 = the trace's own arrival times)")
    if not (PAGE <= args.chunked_prefill_size <= 1 << 20 and args.chunked_prefill_size % PAGE == 0):
        raise UsageError(
            f"--chunked-prefill-size {args.chunked_prefill_size}: must be a multiple of {PAGE} from {PAGE} to 1048576"
        )
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be at least 1 (the first N requests)")
    if not os.path.isfile(args.trace):
        raise UsageError(
            f"--trace {args.trace}: no such file; give a Mooncake-format JSON lines file (.jsonl or .jsonl.gz)"
        )
    if args.cost_model is not None and not os.path.isfile(args.cost_model):
        raise UsageError(
            f"--cost-model {args.cost_model}: no such file; write one with a run without it (DIR/bench_trace_replay_cost_model.json)"
        )
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: exists and is not a directory")


def machine() -> dict:
    from importlib.metadata import version

    import torch

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None  # fmt: skip
    except OSError:
        commit = None
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), cpu=cpu,
                cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                sglang=version("sglang"), commit=commit)  # fmt: skip


class _Progress:
    """One stderr line, rewritten: configurations done, requests of this one, elapsed."""

    def __init__(self, total_configs: int, per_config: int, enabled: bool):
        self.total, self.per, self.enabled, self.t0 = total_configs, per_config, enabled, time.monotonic()
        self.index, self.label, self.last = 0, "", -1

    def start(self, label: str) -> None:
        self.index, self.label, self.last = self.index + 1, label, -1
        self(0)

    def __call__(self, done: int) -> None:
        pct = done * 100 // max(self.per, 1) // 5 * 5
        if not self.enabled or pct == self.last:
            return
        self.last = pct
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        print(f"\r[{bar}] {self.index}/{self.total} {self.label:<28} {done}/{self.per} requests, "
              f"{time.monotonic() - self.t0:.0f} s", end="", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def plan(args, kv_bytes: dict[str, int], budget: int) -> list[ReplayConfig]:
    configs = []
    for kv_dtype in args.kv_dtypes:
        for cp in args.cp:
            cap = capacity_tokens(budget, kv_bytes[kv_dtype], cp, "replicated")
            configs.append(ReplayConfig(cp, kv_dtype, "replicated", None, cap, args.chunked_prefill_size, args.speed))
            for c in args.scratch_contexts:
                scratch = scratch_bytes(cp, kv_dtype, c, args.chunked_prefill_size)
                if scratch >= budget:
                    raise UsageError(f"--scratch-contexts {c}: the scratch ({scratch / GIB:.1f} GiB) does not fit the "
                                     f"KV budget ({budget / GIB:.1f} GiB per GPU); raise --budget-gib or lower C")  # fmt: skip
                cap = capacity_tokens(budget, kv_bytes[kv_dtype], cp, "shared", scratch)
                configs.append(ReplayConfig(cp, kv_dtype, "shared", c, cap, args.chunked_prefill_size, args.speed))
    return configs


def run_all(args, requests, configs, model) -> list[dict]:
    """Every configuration's row. A replicated group's capacity does not depend on N (every rank
    holds everything; the per-GPU budget is the same), so equal replicated runs are replayed once."""
    progress = _Progress(len(configs), len(requests), not args.no_progress)
    rows, done = [], {}
    for cfg in configs:
        key = (cfg.kv_dtype, cfg.path, cfg.scratch_contexts, cfg.capacity_tokens)
        progress.start(
            f"cp={cfg.cp} {cfg.kv_dtype} {cfg.path}" + (f" C={cfg.scratch_contexts}" if cfg.scratch_contexts else "")
        )
        if cfg.path == "replicated" and key in done:
            row = dict(done[key], cp=cfg.cp)
            progress(len(requests))
        else:
            t0 = time.monotonic()
            stats = replay(requests, cfg, model, progress)
            row = summarize(cfg, stats, time.monotonic() - t0)
            done[key] = row
        rows.append(row)
    progress.close()
    return rows


def print_report(info, budget_lines, kv_bytes, model, rows, args, n_requests) -> None:
    print(f"machine: {info['cpu']}, {info['cores']} cores; python {info['python']}, torch {info['torch']}, "
          f"sglang {info['sglang']}; commit {info['commit']}; {info['date']}")  # fmt: skip
    print(f"trace: {os.path.relpath(args.trace, ROOT) if args.trace.startswith(ROOT) else args.trace}, "
          f"{n_requests} requests, speed x{args.speed}, chunked prefill {args.chunked_prefill_size}")  # fmt: skip
    for line in budget_lines:
        print("budget:", line)
    for kv_dtype, b in kv_bytes.items():
        print(f"KV per token ({kv_dtype}): {b} B = {LAYERS} layers x {b // LAYERS} B (measured on SGLang's "
              f"DSATokenToKVPool: latent row {KV_CACHE_DIM[kv_dtype] * (2 if kv_dtype == 'bf16' else 1)} B + "
              f"index K {INDEX_HEAD_DIM} B + scale 4 B); scratch row {scratch_row_bytes(kv_dtype)} B")  # fmt: skip
    print(f"scratch per rank = 2 x (C x ceil(context {CONTEXT_LEN}, N x {PAGE}) + chunk + {PAGE}) rows x row bytes "
          f"(SGLang's compute_page_shard_scratch_bytes; upstream C = {UPSTREAM_SCRATCH_CONTEXTS})")  # fmt: skip
    print(f"cost model: {model['form']}")
    for name, fit in model["fits"].items():
        print(f"  {name:<16} c0 {fit['c0_ms']:.2f} ms, c1 {fit['c1_ms_per_token'] * 1e3:.3f} us/token, "
              f"c2 {fit['c2_ms_per_pair'] * 1e9:.1f} ps/pair, outside {fit['outside_ms']:.1f} ms; "
              f"fit max err {fit.get('max_rel_err', float('nan')):.1%}")  # fmt: skip
    print(f"  from {', '.join(model['sources'].values())}: {model['layers_measured']} attention-only layers (dense MLP, "
          f"no MoE), CP={model['cp_measured']} on 2 x H200, stand-ins listed there; scaled to {model['layers']} layers "
          f"and {model['gpus']} GPUs; shared = the shared path with prefetch, measured")  # fmt: skip
    print()
    table = [["cp", "kv", "path", "C", "capacity tok", "hit %", "computed Mtok", "prefill GPU s", "TTFT p50 s",
              "p90 s", "p99 s", "max queue", "rejected"]]  # fmt: skip
    for r in rows:
        table.append([r["cp"], r["kv_dtype"], r["path"], r["scratch_contexts"] or "-", f"{r['capacity_tokens']:,}",
                      f"{100 * r['prefix_hit_fraction']:.1f}", f"{r['prefill_tokens_computed'] / 1e6:.1f}",
                      f"{r['prefill_gpu_s']:.0f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p90_s']:.2f}",
                      f"{r['ttft_p99_s']:.2f}", r["max_queue"], r["rejected"]])  # fmt: skip
    print(format_table(table, align="rllrrrrrrrrrr"))
    print()
    for line in best_settings(rows):
        print(line)


def best_settings(rows: list[dict]) -> list[str]:
    """Per CP size and dtype: the scratch setting with the lowest TTFT p90 (ties: p50), against replicated."""
    lines = []
    for cp, kv in dict.fromkeys((r["cp"], r["kv_dtype"]) for r in rows):
        shared = [r for r in rows if r["cp"] == cp and r["kv_dtype"] == kv and r["path"] == "shared"]
        repl = next((r for r in rows if r["cp"] == cp and r["kv_dtype"] == kv and r["path"] == "replicated"), None)
        if not shared or repl is None:
            continue
        best = min(shared, key=lambda r: (r["ttft_p90_s"], r["ttft_p50_s"]))
        lines.append(f"best at cp={cp} {kv}: C={best['scratch_contexts']} (hit {100 * best['prefix_hit_fraction']:.1f} % "
                     f"vs {100 * repl['prefix_hit_fraction']:.1f} % replicated; TTFT p50 {best['ttft_p50_s']:.2f} s vs "
                     f"{repl['ttft_p50_s']:.2f} s, p90 {best['ttft_p90_s']:.2f} s vs {repl['ttft_p90_s']:.2f} s)")  # fmt: skip
    return lines


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {cp: f"C{i}" for i, cp in enumerate(sorted({r["cp"] for r in rows}))}
    markers = {1: "^", 2: "s", 4: "D", 8: "P"}
    for r in rows:
        x = r["capacity_tokens"] / 1e6
        shared = r["path"] == "shared"
        style = dict(marker=markers.get(r["scratch_contexts"], "v") if shared else "o",
                     color=colors[r["cp"]] if shared else "black",
                     fillstyle="full" if r["kv_dtype"] == "fp8" else "none", linestyle="none", markersize=8)  # fmt: skip
        ax_hit.plot(x, 100 * r["prefix_hit_fraction"], **style)
        ax_ttft.plot(x, r["ttft_p50_s"], **style)
        ax_ttft.plot(x, r["ttft_p90_s"], **dict(style, markersize=4, alpha=0.5))
    ax_hit.set(
        xscale="log", xlabel="KV capacity of the prefill group (M tokens)", ylabel="prefix hit (% of input tokens)"
    )
    ax_ttft.set(xscale="log", yscale="log", xlabel="KV capacity of the prefill group (M tokens)",
                ylabel="TTFT p50 (large) and p90 (small), s")  # fmt: skip
    handles = [plt.Line2D([], [], color="black", marker="o", linestyle="none", label="replicated")]
    handles += [
        plt.Line2D([], [], color=c, marker="^", linestyle="none", label=f"shared CP={cp}") for cp, c in colors.items()
    ]
    handles += [plt.Line2D([], [], color="gray", marker=m, linestyle="none", label=f"C={c}")
                for c, m in markers.items() if any(r["scratch_contexts"] == c for r in rows)]  # fmt: skip
    handles += [
        plt.Line2D([], [], color="gray", marker="o", fillstyle="full", linestyle="none", label="fp8 (filled)"),
        plt.Line2D([], [], color="gray", marker="o", fillstyle="none", linestyle="none", label="bf16 (hollow)"),
    ]
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for ax in (ax_hit, ax_ttft):
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain)
    ax_ttft.yaxis.set_major_formatter(plain)
    ax_ttft.yaxis.set_minor_formatter(plain)
    ax_hit.legend(handles=handles, fontsize=8, loc="upper left")
    ax_hit.grid(alpha=0.3)
    ax_ttft.grid(alpha=0.3)
    fig.suptitle("Mooncake conversation trace through SGLang's radix cache: replicated vs shared KV capacity")
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
        model = load_cost_model(args.cost_model) if args.cost_model else None
        requests = load_trace(args.trace, args.limit)
        if args.budget_gib is not None:
            budget = int(args.budget_gib * GIB)
            budget_lines = [f"KV budget per GPU {args.budget_gib} GiB (--budget-gib)"]
        else:
            budget, budget_lines = default_budget_bytes()
        kv_bytes = {d: measure_kv_bytes_per_token(d) for d in args.kv_dtypes}
        configs = plan(args, kv_bytes, budget)
    except UsageError as exc:
        print(f"bench_trace_replay.py: error: {exc}", file=sys.stderr)
        return 2
    if model is None:
        model = fit_cost_model()
    info = machine()
    rows = run_all(args, requests, configs, model)
    print_report(info, budget_lines, kv_bytes, model, rows, args, len(requests))
    os.makedirs(args.out, exist_ok=True)
    raw = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "budget_bytes_per_gpu": budget,
           "budget": budget_lines, "kv_bytes_per_token": kv_bytes, "layers": LAYERS, "context_len": CONTEXT_LEN,
           "rows": rows, "best": best_settings(rows)}  # fmt: skip
    with open(os.path.join(args.out, "bench_trace_replay.json"), "w") as f:
        json.dump(raw, f, indent=1)
    with open(os.path.join(args.out, "bench_trace_replay_cost_model.json"), "w") as f:
        json.dump(model, f, indent=1)
    print(f"json: {os.path.join(args.out, 'bench_trace_replay.json')}")
    plot(rows, os.path.join(args.out, "bench_trace_replay.png"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's imports reach Triton; no GPU here
    sys.exit(main())
