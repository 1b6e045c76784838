"""Where does a CP=N run of SGLang's DSA model first differ from CP off? (CPU, ~4 min for N=4)

Runs test/helpers/sglang_model_harness.py's scenario twice (CP off on 1 rank, then `mode` on N gloo ranks)
with hooks on every decoder layer, its attention, MLP and indexer, and on the indexer's MQA-logits
call, then prints per prefill batch and layer: the token rows whose top-k set, attention output or
layer output differ (rows in global token order), and for each row whose top-k set differs whether
its logits window [ks, ke) is bit-identical and how many keys tie at the top-k cutoff.

    TRITON_INTERPRET=1 .venv/bin/python scripts/cp_layer_diff.py [--cp 4] [--mode replicated|shared]
                                                                 [--stable-topk]

--stable-topk swaps the torch top-k inside SGLang's `_topk_unfused` for a stable sort (ties go to the
lowest key position), which makes the pick independent of where a request's window sits in the
rank's packed logits row (see docs/sglang_cpu_forward.md, "Why bit-identical").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from helpers import sglang_model_harness as H  # noqa: E402


def _stable_topk(x, k, dim=-1):
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def run_probe(rank, world, group, ckpt, mode, stable_topk):
    """One rank: the harness scenario with captures; returns it plus `cap` [(batch, name, value)]."""
    cap, state = [], {"batch": 0}

    def rec(name, value):
        def clone(v):
            if isinstance(v, torch.Tensor):
                return v.detach().clone()
            if isinstance(v, (tuple, list)):
                return type(v)(clone(x) for x in v)
            return v

        cap.append((state["batch"], name, clone(value)))

    def first(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    inner_build = H.build_model

    def build(sa, seed=0):
        mc, model = inner_build(sa, seed)
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(lambda m, a, o, i=i: rec(f"L{i}.out", first(o)))
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: rec(f"L{i}.attn", first(o)))
            layer.self_attn.indexer.register_forward_hook(lambda m, a, o, i=i: rec(f"L{i}.topk", o))
        from sglang.srt.layers.attention.dsa import dsa_indexer

        resolve = dsa_indexer.resolve_fp8_mqa_logits_fn

        def resolve_recorded():
            fn = resolve()

            def logits_fn(q, kv, w, ks, ke, clean_logits=False):
                logits = fn(q, kv, w, ks, ke, clean_logits=clean_logits)
                rec("mqa", dict(ks=ks, ke=ke, logits=logits))
                return logits

            return logits_fn

        dsa_indexer.resolve_fp8_mqa_logits_fn = resolve_recorded
        return mc, model

    H.build_model = build
    if stable_topk:
        from sglang.srt.layers.attention.dsa import dsa_topk_backend

        unfused = dsa_topk_backend._topk_unfused
        dsa_topk_backend._topk_unfused = lambda score, lengths, topk, row_starts=None, **_: unfused(
            score, lengths, topk, row_starts=row_starts, topk_op=_stable_topk
        )
    # Batch boundaries: the harness appends one trace entry per Engine.run.
    inner_run = H.Engine.run

    def run(self, fb):
        state["batch"] = len(self.trace)
        return inner_run(self, fb)

    H.Engine.run = run
    out = H.run_scenario(rank, world, group, ckpt, mode, False)
    out["cap"] = cap
    return out


def _get(cap, batch, name, occurrence=0):
    return [v for b, n, v in cap if b == batch and n == name][occurrence]


def report(off, ranks, layers):
    n = len(ranks)
    names = [f"prefill batch {b}" for b in range(len(H.BATCHES))] + ["decode step"]
    for b, name in enumerate(names):
        diffs = [(off["logits"][b] - r["logits"][b]).abs().max().item() for r in ranks]
        print(f"{name}: max |logits diff| per rank {diffs}")
    for b, batch in enumerate(H.BATCHES):
        tokens = sum(t for _, t in batch)
        for layer in range(layers):
            rows = {"topk": [], "attn": [], "out": []}
            notes = []
            for r, res in enumerate(ranks):
                glob = list(range(r, tokens, n))  # interleave: rank r holds tokens r, r+N, ...
                for what in rows:
                    a = _get(off["cap"], b, f"L{layer}.{what}")
                    c = _get(res["cap"], b, f"L{layer}.{what}")
                    for i, g in enumerate(glob):
                        same = set(a[g].tolist()) == set(c[i].tolist()) if what == "topk" else torch.equal(a[g], c[i])
                        if not same:
                            rows[what].append(g)
                            if what == "topk":
                                mo, mc = _get(off["cap"], b, "mqa", layer), _get(res["cap"], b, "mqa", layer)
                                wo = mo["logits"][g, mo["ks"][g] : mo["ke"][g]]
                                wc = mc["logits"][i, mc["ks"][i] : mc["ke"][i]]
                                kth = torch.topk(wo, min(H.TINY_V32["index_topk"], wo.numel())).values[-1]
                                notes.append(
                                    f"    row {g} (rank {r}): logits window identical {torch.equal(wo, wc)}; "
                                    f"cutoff {kth.item():.6g}, {(wo > kth).sum().item()} above, {(wo == kth).sum().item()} tied; "
                                    f"window at ks {int(mo['ks'][g])}/{mo['logits'].shape[1]} (off) vs "
                                    f"{int(mc['ks'][i])}/{mc['logits'].shape[1]} (rank {r})"
                                )
            print(f"batch {b} layer {layer}: rows differing: top-k set {sorted(rows['topk'])}, "
                  f"attention {sorted(rows['attn'])}, layer output {sorted(rows['out'])}")  # fmt: skip
            for line in notes:
                print(line)


def main():
    from helpers.distributed import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--mode", choices=("replicated", "shared"), default="replicated")
    p.add_argument("--stable-topk", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = H.write_checkpoint(os.path.join(tmp, "ckpt"))
        off = run_ranks(run_probe, 1, args=(ckpt, "off", args.stable_topk), timeout_s=600)[0]
        ranks = run_ranks(run_probe, args.cp, args=(ckpt, args.mode, args.stable_topk), timeout_s=600)
    report(off, ranks, H.TINY_V32["num_hidden_layers"])


if __name__ == "__main__":
    main()
