"""Time of one prefill step of an 8-GPU node from the GLM-5 layer terms measured on one H200
(`layer_terms.py`, `bench_glm5_layer.py`), the bytes SGLang's collectives move (`traffic.py`) and
how SGLang overlaps them, and the queue that turns steps into TTFT.

Per layer, on the busiest GPU of the node:

    compute  = attention + indexer + gemms (its worker's slice) + moe (all the node's new tokens / 8)
               + store (the chunk's KV write)
    exposed  = compute-stream collectives + max(0, side-stream collectives - what they hide under)
    step     = moe layers x moe + layers x (compute - moe + exposed) + tail gather + HiCache load-back

- A CP rank (replicated, shared, layer split at W) holds every request's interleaved 1/W of the
  new tokens: `terms.ms(part, kv, n / W, h + n/2 - n/(2W))`, the history chosen so the query-key
  pairs are the slice's, (n / W)(h + n/2). A DP rank runs its own batch whole; plain TP runs the
  whole batch. Attention and the split projections divide by the attention-TP width g (heads
  split g ways: linear, assumed); the indexer does not (SGLang replicates its weights, so every
  attention-TP rank computes it whole). The MoE runs over all 8 GPUs in every layout (EP / TP 8),
  so each GPU's share is the node's new tokens / 8 -- DP attention included.
- The flag's history all-gather runs one layer ahead on its own stream and hides under the whole
  layer (`_prefetch_layer`, kicked when the previous layer reads its slot); its send block's fill
  (`index_select`, `terms.fill_ms`) runs on that stream too. Layer split's latent broadcast is
  kicked after the previous layer's attention, so it hides only under that layer's MoE and the
  next one's projections; its index-K broadcast and every chunk all-gather and hidden-state
  collective run on the compute stream, fully exposed.
- A collective takes bus_bytes / busBW + a latency: busBW from nccl-tests all-gather / broadcast
  on 8 x H100/H200 NVLink4 (BUS_GBPS, large messages; below it latency dominates).
- HiCache load-back: host pages over PCIe (H2D_GBPS per GPU, assumed); every GPU of a replicated
  group loads the whole page, a shared rank its 1/W; overlapped with compute in the low case
  (SGLang loads layer by layer), serial in the others.
- Not modelled: GLM-5's first dense MLP layers (no MoE term there), EP all-to-all imbalance,
  contention between the side stream's collective and the compute stream's, attention-TP
  efficiency, a kernel's launch gaps between requests of one batch.

Ranges: low = every measured term x (1 - its fit's max error), the fastest bus, the shortest
latency; high the opposite; mid the measured fits.
"""

from __future__ import annotations

import traffic as TF

CASES = ("low", "mid", "high")
# nccl-tests all_gather_perf / broadcast_perf busBW at >= 256 MB on 8 x H100/H200 SXM (NVLink4,
# 900 GB/s bidirectional per GPU): published runs report ~350-370 GB/s; NOT measured here
BUS_GBPS = {"low": 370.0, "mid": 360.0, "high": 350.0}
BUS_SOURCE = "nccl-tests all-gather / broadcast busBW on 8 x H100/H200 NVLink4, ~350-370 GB/s (published, not measured)"
LATENCY_US = {"low": 10.0, "mid": 20.0, "high": 40.0}  # one NCCL collective on NVLink: assumed
H2D_GBPS = {"low": 55.0, "mid": 50.0, "high": 40.0}  # PCIe Gen5 x16 host-to-device: assumed
CP_PATHS = ("replicated", "shared", "layer_split")


def load_terms(path: str | None = None):
    """The measured layer terms; `layer_terms.load` refuses, naming the GPU command, while missing."""
    import layer_terms

    return layer_terms.load() if path is None else layer_terms.load(path=path)


def terms_lines() -> list[tuple[str, str, str]]:
    """(term, source, not modelled) for the report."""
    return [
        ("attention, indexer, gemms, moe, fill, store", "layer_terms.py: one GLM-5 layer on one H200 (bench_glm5_layer)",
         "attention-TP efficiency, dense MLP layers"),
        ("collectives", f"traffic.py bytes / {BUS_SOURCE} + {LATENCY_US} us each", "side/compute stream contention"),
        ("overlap", "SGLang's streams: the flag's gather under the layer, layer split's latent broadcast under the "
         "MoE + projections, everything else exposed", "-"),
        ("HiCache load-back", f"KV bytes / {H2D_GBPS} GB/s per GPU", "host memory bandwidth, storage prefetch"),
    ]  # fmt: skip


class StepCost:
    """step_ms for one arm and one case (low/mid/high)."""

    def __init__(self, terms, mcfg: dict, path: str, width: int, attn_tp: int, kv_dtype: str, case: str,
                 kv_bytes_per_token: int, pool_rows: int = 0):  # fmt: skip
        if case not in CASES:
            raise ValueError(f"case {case!r}: must be one of {', '.join(CASES)}")
        self.terms, self.mcfg, self.path, self.kv, self.case = terms, mcfg, path, kv_dtype, case
        self.width, self.attn_tp, self.pool_rows = width, attn_tp, pool_rows
        self.cp = width if path in CP_PATHS else 1
        self.layers = mcfg["num_hidden_layers"]
        self.moe_layers = self.layers - mcfg["first_k_dense_replace"]
        sign = {"low": -1.0, "mid": 0.0, "high": 1.0}[case]
        self.scale = {p: 1.0 + sign * float(terms.max_rel_err.get((p, kv_dtype), 0.0))
                      for p in ("attention", "indexer", "gemms", "moe", "fill", "store")}  # fmt: skip
        self.bus = BUS_GBPS[case] * 1e9
        self.latency_ms = LATENCY_US[case] / 1e3
        share = width if path == "shared" else 1
        self.load_ms_per_token = kv_bytes_per_token / share / (H2D_GBPS[case] * 1e9) * 1e3
        self.overlap_load = case == "low"
        # step_ms's fast path: the fits' coefficients (None: terms.ms per request) and memos of
        # the collectives' ms, keyed by what traffic.py's bytes depend on
        coefficients = getattr(terms, "coefficients", None)
        self._coef = None if coefficients is None else {
            p: coefficients(p, kv_dtype) for p in ("attention", "indexer", "gemms", "moe", "fused_store")}  # fmt: skip
        self._topk = getattr(terms, "topk", None)
        self._kv_memo: dict[tuple[int, int], tuple[float, float]] = {}
        self._hidden_memo: dict[tuple[int, int], tuple[float, float]] = {}

    def _ms(self, part: str, new: float, history: float) -> float:
        if new <= 0:
            return 0.0
        return self.terms.ms(part, self.kv, new, history) * self.scale[part]

    def _worker_layer_ms(self, batch) -> dict[str, float]:
        """One layer of one worker's batch on its busiest GPU, MoE excluded."""
        g, w = self.attn_tp, self.cp
        slices = [(n / w, h + n / 2 - n / (2 * w)) for n, h in batch if n]
        q = sum(s for s, _ in slices)
        out = {
            "attention": sum(self._ms("attention", s, h) for s, h in slices) / g,
            "indexer": sum(self._ms("indexer", s, h) for s, h in slices),
            "gemms": self._ms("gemms", q, 0) / g,
            "store": self.terms.store_ms(self.kv, sum(n for n, _ in batch)) * self.scale["store"] if batch else 0.0,
        }  # fmt: skip
        return out

    def _collective_ms(self, term) -> float:
        return term.bus_bytes / self.bus * 1e3 + self.latency_ms

    def breakdown(self, batches: list[list[tuple[int, int]]], loaded_tokens: int = 0) -> dict[str, float]:
        """Every term of one step, ms. `batches`: per worker of the node, (new, history) per request."""
        work = [(b, self._worker_layer_ms(b)) for b in batches if b]
        if not work:
            return {"step_ms": 0.0}
        batch, layer = max(work, key=lambda bw: sum(bw[1].values()))
        node_new = sum(n for b in batches for n, _ in b)
        moe = self._ms("moe", node_new / 8, 0)
        fwd = TF.Batch(tuple(batch))
        coll = TF.kv_terms(self.path, self.cp, self.kv, self.layers, fwd, self.pool_rows)
        node_batch = TF.Batch(tuple((n, h) for b in batches for n, h in b))
        hidden = TF.hidden_terms(self.path, self.cp, self.mcfg["hidden_size"], self.layers, node_batch)
        per_layer_compute_comm = sum(self._collective_ms(t) for t in coll + hidden if t.per == "layer" and
                                     t.stream == "compute")  # fmt: skip
        side = sum(self._collective_ms(t) for t in coll if t.stream == "side")
        if self.path == "shared" and side:
            _, moved = fwd.history_pages(self.cp)
            side += self.terms.fill_ms(self.kv, moved // self.cp * TF.PAGE) * self.scale["fill"]
        compute = sum(layer.values())
        window = compute + moe if self.path == "shared" else moe + layer["gemms"]
        exposed_side = max(0.0, side - window)
        tail = sum(self._collective_ms(t) for t in hidden if t.per == "forward")
        load = self.load_ms_per_token * loaded_tokens
        total = self.moe_layers * moe + self.layers * (compute + per_layer_compute_comm + exposed_side) + tail
        step = max(total, load) if self.overlap_load else total + load
        return {**{f"{k}_ms_per_layer": v for k, v in layer.items()}, "moe_ms_per_layer": moe,
                "compute_collectives_ms_per_layer": per_layer_compute_comm, "side_collectives_ms_per_layer": side,
                "side_exposed_ms_per_layer": exposed_side, "tail_ms": tail, "load_back_ms": load,
                "step_ms": step}  # fmt: skip

    def step_ms(self, batches: list[list[tuple[int, int]]], loaded_tokens: int = 0) -> float:
        """breakdown(batches, loaded_tokens)["step_ms"], fast: each worker's requests summed into
        the fits' features (one dot per part, not one per request), the collectives' ms memoized
        by the integers traffic.py's bytes depend on. test_trace_cost_fast.py holds it to
        breakdown() and the replay it drives to the per-request implementation."""
        best, best_layer, best_gemms, node_new, node_requests = None, -1.0, 0.0, 0, 0
        for batch in batches:
            if not batch:
                continue
            layer, gemms, new = self._fast_worker_layer_ms(batch)
            node_new += new
            node_requests += len(batch)
            if layer > best_layer:  # the first busiest, as max() picks it
                best, best_layer, best_gemms = batch, layer, gemms
        if best is None:
            return 0.0
        moe = self._fast_ms("moe", node_new / 8)
        coll_compute, side = self._fast_kv_ms(best)
        hidden_compute, tail = self._fast_hidden_ms(batches, node_new, node_requests)
        window = best_layer + moe if self.path == "shared" else moe + best_gemms
        exposed_side = max(0.0, side - window)
        total = (self.moe_layers * moe + self.layers * (best_layer + (coll_compute + hidden_compute) + exposed_side)
                 + tail)  # fmt: skip
        load = self.load_ms_per_token * loaded_tokens
        return max(total, load) if self.overlap_load else total + load

    def _fast_ms(self, part: str, q: float) -> float:
        """A part that reads no history (gemms, moe) at q tokens: a + b q, scaled; 0 for no work."""
        if q <= 0:
            return 0.0
        if self._coef is None:
            return self._ms(part, q, 0)
        a, b = self._coef[part]
        return (a + b * q) * self.scale[part]

    def _fast_worker_layer_ms(self, batch) -> tuple[float, float, int]:
        """(attention + indexer + gemms + store, gemms, new tokens) of `_worker_layer_ms(batch)`."""
        w, g, new = self.cp, self.attn_tp, 0
        if self._coef is None:
            slices = [(n / w, h + n / 2 - n / (2 * w)) for n, h in batch if n]
            att = sum(self._ms("attention", s, h) for s, h in slices) / g
            idx = sum(self._ms("indexer", s, h) for s, h in slices)
            q = sum(s for s, _ in slices)
            new = sum(n for n, _ in batch)
        else:
            topk = self._topk
            count = q = f_att = f_idx = hist = 0.0
            for n, h in batch:
                if n:
                    s, hh = n / w, h + n / 2 - n / (2 * w)
                    count += 1.0
                    q += s
                    hist += hh
                    f_att += s * min(topk, hh + s / 2)
                    f_idx += s * (hh + s / 2)
                    new += n
            a, b, c, d = self._coef["attention"]
            att = (a * count + b * q + c * f_att + d * hist) * self.scale["attention"] / g
            a, b, c = self._coef["indexer"]
            idx = (a * count + b * q + c * f_idx) * self.scale["indexer"]
        gemms = self._fast_ms("gemms", q) / g
        if self._coef is None or not new:
            store = self.terms.store_ms(self.kv, new) * self.scale["store"]
        else:
            a, b = self._coef["fused_store"]
            store = (a + b * new) * self.scale["store"]
        return att + idx + gemms + store, gemms, new

    def _fast_kv_ms(self, batch) -> tuple[float, float]:
        """(compute-stream per-layer ms, side-stream per-layer ms incl. the fill) of the busiest
        worker's KV collectives: they depend on its new tokens and (shared) its moved pages only."""
        new = sum(n for n, _ in batch)
        moved = self.cp * sum(-(-(h // TF.PAGE) // self.cp) for _, h in batch) if self.path == "shared" else 0
        key = (new, moved)
        hit = self._kv_memo.get(key)
        if hit is None:
            fwd = TF.Batch(tuple(batch))
            coll = TF.kv_terms(self.path, self.cp, self.kv, self.layers, fwd, self.pool_rows)
            compute = sum(self._collective_ms(t) for t in coll if t.per == "layer" and t.stream == "compute")
            side = sum(self._collective_ms(t) for t in coll if t.stream == "side")
            if self.path == "shared" and side:
                side += self.terms.fill_ms(self.kv, moved // self.cp * TF.PAGE) * self.scale["fill"]
            hit = self._kv_memo[key] = (compute, side)
        return hit

    def _fast_hidden_ms(self, batches, node_new: int, node_requests: int) -> tuple[float, float]:
        """(compute-stream per-layer ms, per-forward tail ms) of the hidden-state collectives: they
        depend on the node's new tokens and request count only."""
        key = (node_new, node_requests)
        hit = self._hidden_memo.get(key)
        if hit is None:
            node_batch = TF.Batch(tuple((n, h) for b in batches for n, h in b))
            hidden = TF.hidden_terms(self.path, self.cp, self.mcfg["hidden_size"], self.layers, node_batch)
            compute = sum(self._collective_ms(t) for t in hidden if t.per == "layer" and t.stream == "compute")
            tail = sum(self._collective_ms(t) for t in hidden if t.per == "forward")
            hit = self._hidden_memo[key] = (compute, tail)
        return hit


def simulate_node(workers: list[list[tuple]], chunk: int, cost) -> tuple[list[float], float]:
    """TTFT of every request on one node. `workers`: per radix cache, its requests in arrival
    order as (arrival_s, input_len, hit_tokens, loaded_tokens). All workers step together (DP
    attention ranks run each forward in lockstep; a CP node has one worker): each builds a batch
    of up to `chunk` new tokens, the chunked request first, then waiting requests FIFO, the last
    one cut at a page boundary. Returns (TTFTs, busy seconds).

    A worker's waiting requests are its arrived ones not yet started, [head, arrived) of its
    queue (FIFO in arrival order), so no queue is built."""
    page = 64
    queues = [list(w) for w in workers]
    sizes = [len(q) for q in queues]
    arrived = [0] * len(queues)  # requests with arrival_s <= now
    heads = [0] * len(queues)  # the first not yet started
    running = [None] * len(queues)  # (index, done_tokens) of the chunked request
    ttft, now, busy = [], 0.0, 0.0
    left = sum(sizes)
    while left:
        batches, finished, loaded, work = [], [], 0, False
        for w, q in enumerate(queues):
            a, n = arrived[w], sizes[w]
            while a < n and q[a][0] <= now:
                a += 1
            arrived[w] = a
            budget, batch = chunk, []
            r = running[w]
            if r is not None:
                i, done = r
                length = q[i][1]
                take = min(length - done, budget // page * page)
                batch.append((take, done))
                budget -= take
                if done + take < length:
                    running[w] = (i, done + take)
                else:
                    running[w] = r = None
                    finished.append(q[i][0])
            head = heads[w]
            while head < a and budget >= page and r is None:
                arrival, length, hit, load = q[head]
                extend = length - hit
                take = extend if extend <= budget else budget // page * page
                batch.append((take, hit))
                loaded += load
                budget -= take
                if take < extend:
                    running[w] = r = (head, hit + take)
                else:
                    finished.append(arrival)
                head += 1
            heads[w] = head
            if batch:
                work = True
            batches.append(batch)
        if not work:
            now = min(q[arrived[w]][0] for w, q in enumerate(queues) if arrived[w] < sizes[w])
            continue
        dt = cost.step_ms(batches, loaded) / 1e3
        now += dt
        busy += dt
        for arrival in finished:
            ttft.append(now - arrival)
        left -= len(finished)
    return ttft, busy
