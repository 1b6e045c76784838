"""SGLang's returned logprobs compared between serving paths (`scripts/sglang_server_check.py`).

A /generate request with `return_logprob: true, top_logprobs_num: K` answers, per new token,
`meta_info.output_token_logprobs` = [[logprob, token_id, text], ...] and
`meta_info.output_top_logprobs` = [[[logprob, token_id, text] x K], ...]. Two comparisons:

- `exact`: the shared-KV and the replicated prefill do the same arithmetic (the same CP split, the
  same kernels; only where a rank reads its history differs): tokens and every logprob equal bit
  for bit.
- `against_oracle`: the non-CP oracle sums in another order (CP's all-gathers and TP's
  reductions), so its logprobs differ by rounding. Up to the first token where the paths choose
  differently, every token id in both top-K lists must agree within `atol`; a different choice
  is allowed only where the oracle's own top two are within 2 x `atol` (a near-tie that
  rounding may flip: if every logprob moves by at most atol, the order of two changes only when
  they are 2 x atol apart or less); after it the contexts differ and nothing is compared.
"""

from __future__ import annotations

import math
import struct


def logprob_request(top_k: int) -> dict:
    """The /generate fields that make SGLang return output logprobs (the prompt's are not asked for)."""
    return {"return_logprob": True, "top_logprobs_num": top_k}


def f32(x: float) -> float:
    """`x` rounded to float32: SGLang's logprobs are float32, and sglang-router re-parses the JSON
    numbers it forwards with up to one double ulp of error (seen on the CPU servers: -3.695501804351806
    through the router, -3.6955018043518066 from the decode), which this rounding removes."""
    return struct.unpack("f", struct.pack("f", x))[0]


def positions(answer: dict) -> list[dict]:
    """Per new token: {"token", "logprob", "top": {token_id: logprob}} from a /generate answer,
    logprobs as float32 values (`f32`)."""
    meta = answer["meta_info"]
    chosen, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    if len(chosen) != len(answer["output_ids"]) or len(tops) != len(chosen):
        raise ValueError(f"{len(answer['output_ids'])} output ids but {len(chosen)} token logprobs and "
                         f"{len(tops)} top-logprob lists: was the request sent with logprob_request()?")  # fmt: skip
    return [{"token": int(t), "logprob": f32(lp), "top": {int(i): f32(v) for v, i, *_ in top}}
            for (lp, t, *_), top in zip(chosen, tops)]  # fmt: skip


def exact(a: list[dict], b: list[dict]) -> dict:
    """Bit-for-bit equality of two paths' positions; the first position that differs, if any."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"equal": first is None, "first_difference": first}


def against_oracle(path: list[dict], oracle: list[dict], atol: float) -> dict:
    """How far `path` is from the oracle: the largest |logprob difference| over the token ids both
    top lists hold, up to and including the first position where the chosen tokens differ, and
    at that position the oracle's margin between its choice and the path's."""
    diverged, max_diff, where = None, 0.0, None
    for i, (p, o) in enumerate(zip(path, oracle)):
        for token in set(p["top"]) & set(o["top"]):
            d = abs(p["top"][token] - o["top"][token])
            if d > max_diff:
                max_diff, where = d, i
        if p["token"] != o["token"]:
            diverged = i
            break
    out = {"tokens_equal": diverged is None and len(path) == len(oracle), "first_divergence": diverged,
           "max_abs_logprob_diff": max_diff, "max_diff_position": where, "atol": atol}  # fmt: skip
    if diverged is not None:
        o = oracle[diverged]
        margin = o["logprob"] - o["top"].get(path[diverged]["token"], -math.inf)
        out["oracle_margin_at_divergence"] = margin
        out["near_tie"] = margin <= 2 * atol
    out["ok"] = len(path) == len(oracle) and max_diff <= atol and (diverged is None or out["near_tie"])
    return out
