"""Time of one prefill step of an 8-GPU node, and the queue that turns it into TTFT.

    step_ms = outside + max over the node's workers of attention_w + moe_extra(all new tokens) + load_back

Every term, its source, and what it does not model (`TERMS`, printed by the command):
- outside, attention_w: fitted to the chunks `bench_sglang_prefill.py` timed on 2 x H200 with
  the deleted pool (16 DSA layers with a dense 12,288-wide MLP each, CP=2; stand-ins listed in
  the result files) -- MEASURED ON THE DELETED POOL, to be re-measured on #33's machine. Scaled
  x 78/16 layers and x 2/g GPUs, where g shares one worker's attention: 8 for CP (W x attention
  TP), 8/W for a DP rank (its attention TP), so a DP rank runs a long prompt's attention on 8/W
  GPUs alone. Going from 2 to g > 2 GPUs costs efficiency ATTN_EFFICIENCY (assumed).
- moe_extra: GLM-5's MoE (8 routed + 1 shared expert of 3 x 6144 x 2048 per token, 75 layers)
  in FLOPs on the node's 8 GPUs at an MFU (assumed), less the measured dense MLP it replaces in
  the low and mid cases; the high case adds it whole. Not modelled: EP all-to-all, fp8 GEMM
  efficiency beyond the MFU, the shared path's gather at CP=8 (its CP=2 cost is in the fit).
- load_back: HiCache host pages brought back over PCIe (H2D_GBPS per GPU, assumed): every GPU
  of a replicated group loads the whole page, a shared rank its 1/W; overlapped with compute in
  the low case (SGLang loads layer by layer), serial in the others.
Ranges: each term at its low, mid and high value together.
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASUREMENTS = {
    "bf16": os.path.join(ROOT, "benchmark", "results", "bench_sglang_prefill.json"),
    "fp8": os.path.join(ROOT, "benchmark", "results", "bench_sglang_prefill_fp8.json"),
}
H200_FP8_DENSE_TFLOPS = 1979.0  # NVIDIA H200 datasheet, FP8 tensor core, dense
CASES = ("low", "mid", "high")
ATTN_EFFICIENCY = {"low": 1.0, "mid": 0.85, "high": 0.7}  # scaling 2 -> 8 GPUs: assumed
MOE_MFU = {"low": 0.6, "mid": 0.4, "high": 0.25}  # assumed
FIT_ERROR = {"low": 0.95, "mid": 1.0, "high": 1.05}  # the fit's worst point: 4.4 % (measured)
H2D_GBPS = {"low": 55.0, "mid": 50.0, "high": 40.0}  # PCIe Gen5 x16 host-to-device: assumed
COST_FORM = "chunk_ms = outside_ms + (78/16) x (2/g) x (c0 + c1 x new + c2 x sum_i new_i x (hist_i + new_i / 2))"

TERMS = [
    ("outside, attention (c0, c1, c2)", "bench_sglang_prefill*.json: 2 x H200, CP=2, 16 layers, the deleted pool",
     "MEASURED ON THE DELETED POOL; MoE, CP>2 and the CP=8 gather not measured"),
    ("attention scaling 2 -> g GPUs", f"assumed efficiency {ATTN_EFFICIENCY}", "no measurement at CP 4 or 8"),
    ("MoE", f"FLOPs of 9 experts x 3 x 6144 x 2048 x 75 layers at MFU {MOE_MFU} of {H200_FP8_DENSE_TFLOPS:.0f} TFLOPS",
     "EP all-to-all, expert imbalance"),
    ("HiCache load-back", f"KV bytes / {H2D_GBPS} GB/s per GPU", "host memory bandwidth limits, prefetch from storage"),
    ("fit error", f"x {FIT_ERROR}", "-"),
]  # fmt: skip


def fit_cost_model(paths: dict[str, str] = MEASUREMENTS) -> dict:
    """Least-squares fit of every chunk the H200 runs timed (16 layers, CP=2 on 2 x H200): layer
    time (chunk ms - the case's time outside the layers) against new tokens and the attention
    pairs new x (history + new / 2), per KV dtype and path (replicated; shared with prefetch)."""
    import numpy as np

    model = {"form": COST_FORM, "layers_measured": None, "cp_measured": None, "sources": {}, "stand_ins": {},
             "fits": {}}  # fmt: skip
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


def measured_chunk_ms(model: dict, path: str, kv_dtype: str, batch: list[tuple[int, int]]) -> float:
    """The fit as measured (16 layers, 2 GPUs): the check that it reproduces the timed chunks."""
    fit = model["fits"][f"{path}/{kv_dtype}"]
    return fit["outside_ms"] + _layers_ms(fit, batch)


def _layers_ms(fit: dict, batch) -> float:
    new = sum(n for n, _ in batch)
    pairs = sum(n * (h + n / 2) for n, h in batch)
    return fit["c0_ms"] + fit["c1_ms_per_token"] * new + fit["c2_ms_per_pair"] * pairs


class StepCost:
    """step_ms for one arm and one case (low/mid/high) of the model's uncertainty."""

    def __init__(self, model: dict, mcfg: dict, path: str, kv_dtype: str, attn_gpus: int, width: int, case: str,
                 kv_bytes_per_token: int):  # fmt: skip
        self.fit = model["fits"][f"{'shared' if path == 'shared' else 'replicated'}/{kv_dtype}"]
        eff = ATTN_EFFICIENCY[case] if attn_gpus > model["cp_measured"] else 1.0
        self.attn_scale = (mcfg["num_hidden_layers"] / model["layers_measured"]) * (model["cp_measured"] / attn_gpus)
        self.attn_scale *= FIT_ERROR[case] / eff
        h, moe_i = mcfg["hidden_size"], mcfg["moe_intermediate_size"]
        moe_layers = mcfg["num_hidden_layers"] - mcfg["first_k_dense_replace"]
        experts = mcfg["num_experts_per_tok"] + mcfg["n_shared_experts"]
        moe_flops = 2 * experts * 3 * h * moe_i * moe_layers
        stand_in = 2 * 3 * h * 12288 * mcfg["num_hidden_layers"]  # the measured dense MLP, scaled to all layers
        extra = moe_flops if case == "high" else max(moe_flops - stand_in, 0)
        self.moe_ms_per_token = extra / (8 * H200_FP8_DENSE_TFLOPS * 1e12 * MOE_MFU[case]) * 1e3
        share = width if path == "shared" else 1
        self.load_ms_per_token = kv_bytes_per_token / share / (H2D_GBPS[case] * 1e9) * 1e3
        self.overlap_load = case == "low"

    def step_ms(self, batches: list[list[tuple[int, int]]], loaded_tokens: int) -> float:
        """`batches`: per worker of the node, (new tokens, history) per request in its batch."""
        attn = max((_layers_ms(self.fit, b) for b in batches if b), default=0.0) * self.attn_scale
        new = sum(n for b in batches for n, _ in b)
        compute = self.fit["outside_ms"] + attn + self.moe_ms_per_token * new
        load = self.load_ms_per_token * loaded_tokens
        return max(compute, load) if self.overlap_load else compute + load


def simulate_node(workers: list[list[tuple]], chunk: int, cost: StepCost) -> tuple[list[float], float]:
    """TTFT of every request on one node. `workers`: per radix cache, its requests in arrival
    order as (arrival_s, input_len, hit_tokens, loaded_tokens). All workers step together (DP
    attention ranks run each forward in lockstep; a CP node has one worker): each builds a batch
    of up to `chunk` new tokens, the chunked request first, then waiting requests FIFO, the last
    one cut at a page boundary. Returns (TTFTs, busy seconds)."""
    page = 64
    queues = [list(w) for w in workers]
    nxt = [0] * len(workers)
    waiting = [[] for _ in workers]  # indices into queues, FIFO (head at pos)
    heads = [0] * len(workers)
    running = [None] * len(workers)  # [index, done_tokens]
    ttft, now, busy = [], 0.0, 0.0
    left = sum(len(q) for q in queues)
    while left:
        for w, q in enumerate(queues):
            while nxt[w] < len(q) and q[nxt[w]][0] <= now:
                waiting[w].append(nxt[w])
                nxt[w] += 1
        batches, finished, loaded = [], [], 0
        for w, q in enumerate(queues):
            budget, batch = chunk, []
            if running[w] is not None:
                i, done = running[w]
                take = min(q[i][1] - done, budget // page * page)
                batch.append((take, done))
                budget -= take
                running[w] = [i, done + take] if done + take < q[i][1] else None
                if running[w] is None:
                    finished.append((w, i))
            while heads[w] < len(waiting[w]) and budget >= page and running[w] is None:
                i = waiting[w][heads[w]]
                arrival, length, hit, load = q[i]
                extend = length - hit
                take = extend if extend <= budget else budget // page * page
                heads[w] += 1
                batch.append((take, hit))
                loaded += load
                budget -= take
                if take < extend:
                    running[w] = [i, hit + take]
                else:
                    finished.append((w, i))
            batches.append(batch)
        if not any(batches):
            now = min(q[nxt[w]][0] for w, q in enumerate(queues) if nxt[w] < len(q))
            continue
        dt = cost.step_ms(batches, loaded) / 1e3
        now += dt
        busy += dt
        for w, i in finished:
            ttft.append(now - queues[w][i][0])
            left -= 1
    return ttft, busy
