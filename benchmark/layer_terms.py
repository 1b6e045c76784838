"""GLM-5 layer terms: a fitted cost model per part and KV dtype from bench_glm5_layer.py's results
(one layer, one rank, one H200). Imported as `layer_terms` (a benchmark's own folder is on sys.path).

    terms = layer_terms.load()                  # benchmark/results/bench_glm5_layer_1xh200.json
    terms.ms("attention", "fp8", new=4096, history=131072)   # ms, one layer, one rank
    terms.layer_ms("fp8", 4096, 131072)        # attention + indexer + gemms + moe
    terms.fill_ms("fp8", rows), terms.store_ms("fp8", tokens)
    terms.max_rel_err[("attention", "fp8")], terms.provenance, terms.describe()

Each part's time is fitted over the measured grid by least squares on the relative error with
non-negative coefficients (q = new tokens per rank, h = history tokens):

    attention     a + b q + c q min(topk, h + q/2) + d h   (FlashMLA reads at most top-k keys a
                  query; d: fp8's dequantization of the request's history, SGLang's RAGGED path)
    indexer       a + b q + c q (h + q/2)                   (logits and top-k over every key)
    gemms, moe    a + b q
    scratch_fill  a + b rows;   fused_store   a + b tokens

Parts that do not read the KV cache (indexer, gemms, moe) have one fit, serving both dtypes.
No work costs nothing: new = 0, rows = 0 or tokens = 0 give 0 ms. Below the grid's smallest
point the fit extrapolates towards its constant a; past its largest, along its terms; describe()
says where the grid ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

PARTS = ("attention", "indexer", "gemms", "moe")
KV = ("bf16", "fp8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "benchmark", "results", "bench_glm5_layer_1xh200.json")
GPU_COMMAND = (
    "bash scripts/gpu_run.sh layer   (on 1 x H200 with .gpu_bundle carried; writes "
    "$OUT/bench_glm5_layer_1xh200.json: copy it to benchmark/results/)"
)
# part -> the names of its terms and what each multiplies, as functions of (q, h, topk) or (n,)
TERMS = {
    "attention": (("a", "1"), ("b", "q"), ("c", "q*min(topk, h + q/2)"), ("d", "h")),
    "indexer": (("a", "1"), ("b", "q"), ("c", "q*(h + q/2)")),
    "gemms": (("a", "1"), ("b", "q")),
    "moe": (("a", "1"), ("b", "q")),
    "scratch_fill": (("a", "1"), ("b", "rows")),
    "fused_store": (("a", "1"), ("b", "tokens")),
}


def features(part: str, x: float, h: float, topk: int) -> list[float]:
    """The values the terms of `part` multiply: x = new tokens (rows, tokens for fill and store)."""
    if part == "attention":
        return [1.0, x, x * min(topk, h + x / 2), h]
    if part == "indexer":
        return [1.0, x, x * (h + x / 2)]
    return [1.0, x]


def nonnegative_lstsq_rel(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{coef >= 0} sum ((rows @ coef - y) / y)^2: every subset of the columns solved
    unconstrained, the best one whose coefficients are all >= 0 kept (exact for a few columns)."""
    a = rows / y[:, None]
    best, best_err = None, np.inf
    n = rows.shape[1]
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(a[:, cols], np.ones_like(y), rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - 1.0) ** 2))
            if err < best_err - 1e-15:
                best, best_err = np.zeros(n), err
                best[list(cols)] = coef
    assert best is not None, "a single non-negative column always fits"
    return best


@dataclasses.dataclass(frozen=True)
class Fit:
    part: str
    kv: str | None  # None: the part does not read the KV cache
    coef: dict[str, float]
    max_rel_err: float
    points: int
    x_range: tuple[int, int]  # q (rows, tokens) measured
    h_range: tuple[int, int] | None

    def ms(self, x: float, h: float, topk: int) -> float:
        return float(np.dot(list(self.coef.values()), features(self.part, x, h, topk)))

    def formula(self) -> str:
        return " + ".join(f"{v:.4g}" + ("" if what == "1" else f" x {what}") for (_, what), v in
                          zip(TERMS[self.part], self.coef.values()))  # fmt: skip


def _x(point: dict) -> int:
    return (
        point["rows"]
        if point["part"] == "scratch_fill"
        else point["tokens"]
        if point["part"] == "fused_store"
        else point["new"]
    )


def fit_points(points: list[dict], topk: int) -> dict[tuple[str, str | None], Fit]:
    """(part, kv) -> its Fit, from a results file's points (kv None for KV-independent parts)."""
    groups: dict[tuple[str, str | None], list[dict]] = {}
    for p in points:
        groups.setdefault((p["part"], p["kv"]), []).append(p)
    fits = {}
    for (part, kv), pts in groups.items():
        if part not in TERMS:
            raise ValueError(f"unknown part {part!r} in the results (known: {', '.join(TERMS)})")
        xs = np.array([[_x(p), p.get("history", 0)] for p in pts], dtype=float)
        y = np.array([p["ms"] for p in pts], dtype=float)
        rows = np.array([features(part, x, h, topk) for x, h in xs])
        coef = nonnegative_lstsq_rel(rows, y)
        rel = np.abs(rows @ coef - y) / y
        hs = [p["history"] for p in pts if "history" in p]
        fits[part, kv] = Fit(part, kv, {name: float(c) for (name, _), c in zip(TERMS[part], coef)}, float(rel.max()),
                             len(pts), (int(xs[:, 0].min()), int(xs[:, 0].max())),
                             (min(hs), max(hs)) if hs else None)  # fmt: skip
    return fits


class LayerTerms:
    """The fits of one results file; see the module docstring for the API."""

    def __init__(self, raw: dict, path: str):
        self.path, self.raw = path, raw
        self.provenance = raw["provenance"]
        self.topk = int(self.provenance["model"]["shapes"]["topk"])
        fitted = fit_points(raw["points"], self.topk)
        self.fits: dict[tuple[str, str], Fit] = {}
        for (part, kv), fit in fitted.items():
            for k in KV if kv is None else (kv,):
                self.fits[part, k] = fit
        missing = [(p, k) for p in TERMS for k in KV if (p, k) not in self.fits]
        if missing:
            raise ValueError(f"{path} has no points for {missing}: re-run `{GPU_COMMAND}`")
        self.max_rel_err = {key: fit.max_rel_err for key, fit in self.fits.items()}

    def _fit(self, part: str, kv: str) -> Fit:
        if kv not in KV:
            raise ValueError(f"kv={kv!r}; expected one of {KV}")
        return self.fits[part, kv]

    def ms(self, part: str, kv: str, new: int, history: int) -> float:
        """One layer's `part` on one rank: `new` query tokens after `history` cached ones."""
        if part not in PARTS:
            raise ValueError(f"part={part!r}; expected one of {PARTS} (fill_ms, store_ms for the others)")
        if new < 0 or history < 0:
            raise ValueError(f"new={new}, history={history}: both must be >= 0")
        return 0.0 if new == 0 else self._fit(part, kv).ms(new, history, self.topk)

    def coefficients(self, part: str, kv: str) -> tuple[float, ...]:
        """The fit's coefficients in TERMS[part] order: ms = their dot with `features(part, ...)`
        (trace_cost's step cost sums the features of a batch's requests, then takes one dot)."""
        return tuple(self._fit(part, kv).coef.values())

    def layer_ms(self, kv: str, new: int, history: int) -> float:
        """attention + indexer + gemms + moe of one layer on one rank."""
        return sum(self.ms(part, kv, new, history) for part in PARTS)

    def fill_ms(self, kv: str, rows: int) -> float:
        """The scratch fill's send block: `rows` latent rows and their index pages selected."""
        if rows < 0:
            raise ValueError(f"rows={rows} must be >= 0")
        return 0.0 if rows == 0 else self._fit("scratch_fill", kv).ms(rows, 0, self.topk)

    def store_ms(self, kv: str, tokens: int) -> float:
        """The chunk's store of `tokens` rows into the scratch and the owned shard rows."""
        if tokens < 0:
            raise ValueError(f"tokens={tokens} must be >= 0")
        return 0.0 if tokens == 0 else self._fit("fused_store", kv).ms(tokens, 0, self.topk)

    def describe(self) -> list[str]:
        p = self.provenance
        where = ", ".join(p["machine"].get("gpus") or [p["machine"]["cpu"]])
        shown = os.path.relpath(self.path, REPO) if self.path.startswith(REPO + os.sep) else self.path
        lines = [f"source: {shown} (commit {p['commit'][:10]}{' + uncommitted changes' if p['dirty'] else ''}; "
                 f"{where}; {p['date_utc'][:10]}); model: {p['model']['name']}; topk {self.topk}",
                 "fit: least squares on the relative error, coefficients >= 0; q = new tokens per rank, h = history; "
                 "zero work is 0 ms; below the grid's smallest point a fit extrapolates towards its constant a "
                 "(not measured), past its largest along its terms"]  # fmt: skip
        seen = set()
        for part, kv in sorted(self.fits, key=lambda k: (list(TERMS).index(k[0]), k[1])):
            fit = self.fits[part, kv]
            if id(fit) in seen:
                continue
            seen.add(id(fit))
            x_name = {"scratch_fill": "rows", "fused_store": "tokens"}.get(part, "q")
            grid = f"{x_name} {fit.x_range[0]}-{fit.x_range[1]}" + (
                f", h {fit.h_range[0]}-{fit.h_range[1]}" if fit.h_range else ""
            )
            label = f"{part} {kv}" if fit.kv else f"{part} (bf16 and fp8: the part does not read the KV cache)"
            lines.append(f"{label}: ms = {fit.formula()}; max rel err {100 * fit.max_rel_err:.1f} % over "
                         f"{fit.points} points ({grid}); kernel: {self._kernel(part, kv)}")  # fmt: skip
        lines += [f"stand-in: {s}" for s in p["stand_ins"]]
        return lines

    def _kernel(self, part: str, kv: str) -> str:
        k, modes = self.raw["kernels"], self.raw["modes"]
        if part == "attention":
            return k["attention"] + (f" after {k['dequant']} (history > 0)" if kv == "fp8" else "")
        if part == "indexer":
            return f"{k['indexer_logits']} + {k['indexer_topk']}"
        if part == "gemms":
            return "torch._scaled_mm " + ", ".join(f"{n}: {m}" for n, m in modes["gemms"].items()) + "; bmm bf16"
        if part == "moe":
            return f"{modes['moe']}; shared expert {modes['moe_dense']}"
        if part == "fused_store":
            return k[f"fused_store_{kv}"]
        return "torch.index_select"


def load(path: str = DEFAULT) -> LayerTerms:
    """The fitted terms of a results file; refuses a missing one with the command that writes it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: measure it on one H200 with `{GPU_COMMAND}`")
    with open(path) as f:
        return LayerTerms(json.load(f), path)
