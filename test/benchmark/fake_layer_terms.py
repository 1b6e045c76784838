"""A stand-in for benchmark/layer_terms.py's loaded terms (its API, known coefficients), for the
cost model's tests until the H200 measurement exists. ms = a + b q + c q (h + q / 2) per part, the
form layer_terms fits; the numbers are round guesses at GLM-5's H200 scale, not measurements."""

PARTS = ("attention", "indexer", "gemms", "moe")
COEF = {  # (a ms, b ms per query token, c ms per query-key pair)
    "attention": (0.02, 7e-4, 0.0),  # sparse: top-k 2048 keys per query, whatever the history
    "indexer": (0.02, 1e-5, 8e-9),  # q x (h + q) logits
    "gemms": (0.02, 3.5e-4, 0.0),
    "moe": (0.05, 7e-4, 0.0),
}


class FakeTerms:
    def __init__(self, coef=None, err=0.05):
        self.coef = dict(COEF if coef is None else coef)
        self.max_rel_err = {(p, kv): err for p in (*PARTS, "fill", "store") for kv in ("bf16", "fp8")}
        self.provenance = {"commit": "fake", "source": "test/benchmark/fake_layer_terms.py"}

    def ms(self, part, kv, new, history):
        a, b, c = self.coef[part]
        return a + b * new + c * new * (history + new / 2)

    def layer_ms(self, kv, new, history):
        return sum(self.ms(p, kv, new, history) for p in PARTS)

    def fill_ms(self, kv, rows):
        return 0.005 + rows * 788 / 3e9  # 3 TB/s

    def store_ms(self, kv, tokens):
        return 0.005 + tokens * 2 * 788 / 3e9

    def describe(self):
        return [f"{p}: a {a} ms, b {b} ms/token, c {c} ms/pair (fake)" for p, (a, b, c) in self.coef.items()]
