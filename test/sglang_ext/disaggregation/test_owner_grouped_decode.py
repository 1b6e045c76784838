"""CPU (one rank, a 646-token prefill in the Triton
interpreter): the owner-grouped page order the decode writes into req_to_token
(sglang_ext/disaggregation/decode.py) is invisible to SGLang's decode.

SGLang 0.5.23's own DSA decode (`DeepseekV32ForCausalLM` with random weights, `DSATokenToKVPool`,
`DeepseekSparseAttnBackend.forward_decode`, the DSA indexer reading paged index-K, as in
test_sglang_model_forward.py; stand-ins in docs/sglang_cpu_forward.md) decodes two requests
(446 and 200 prompt tokens, last pages partly filled) for three steps twice: once with the
prefill's pages where they were written (request order), once after the pages were moved, as the
PD transfer moves them, to a decode pool whose pages are dealt out grouped by owner for CP 2 and
4 (`regroup_token_slots`, the function the hook runs), with req_to_token pointing at them. The
logits of every step must be equal bit for bit; the decode steps also fill the rest of the
regrouped last page and then take fresh pages. Control: the grouped pool read through
request-order slots gives different logits, so the comparison can fail.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_model_harness as H  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=20, suite="nsa-cp-test-cpu")

PAGE = H.PAGE
PROMPTS = {0: 446, 1: 200}  # request 0's third decode step opens a fresh page
STEPS = 3


def _moved_pool(engine, order_pages, grouped_pages):
    """A fresh pool holding each request page at its grouped page: what the transfer delivers."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    src = engine.pool
    dst = DSATokenToKVPool(
        size=src.size, page_size=PAGE, kv_lora_rank=src.kv_lora_rank, dtype=torch.bfloat16,
        qk_rope_head_dim=src.qk_rope_head_dim, layer_num=src.layer_num, device=engine.device,
        index_head_dim=128, enable_memory_saver=False, kv_cache_dim=src.kv_cache_dim,
    )  # fmt: skip
    pages = src.size // PAGE + 1
    s, d = torch.tensor(order_pages), torch.tensor(grouped_pages)
    for layer in range(src.layer_num):
        dst.kv_buffer[layer].view(pages, -1)[d] = src.kv_buffer[layer].view(pages, -1)[s]
        dst.index_k_with_scale_buffer[layer][d] = src.index_k_with_scale_buffer[layer][s]
    return dst


def _decode(engine, toks, state):
    """STEPS decode steps of both requests from `state` (req_to_token, pages, lens, free list)."""
    rows, pages, lens, free = state
    engine.req_to_token.copy_(rows)
    engine.requests.pages = {k: list(v) for k, v in pages.items()}
    engine.requests.lens = dict(lens)
    engine.requests.free = list(free)
    return [engine.run(engine.forward_batch([(i, 1) for i in PROMPTS], toks, decode=True)) for _ in range(STEPS)]


def run_layouts(rank, world, group, model_path):
    from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import regroup_token_slots

    sa = H.setup_process(rank, world, model_path, 1)
    mc, model = H.build_model(sa)
    engine = H.Engine(sa, mc, model, pool_pages=48)
    engine.init_requests(seed=3)
    engine.requests.free = list(range(47, 0, -1))  # pop() hands out 1, 2, 3, ...: request order
    g = torch.Generator().manual_seed(5)
    toks = {i: torch.randint(2, H.TINY_V32["vocab_size"], (n + STEPS,), generator=g) for i, n in PROMPTS.items()}
    engine.run(engine.forward_batch(list(PROMPTS.items()), toks))
    req = engine.requests
    layouts = {
        "request order": (engine.pool, (engine.req_to_token.clone(), req.pages, req.lens, list(range(47, 12, -1))))
    }
    for cp in (2, 4):  # the transfer, before any decode step writes the prefill's pool
        rows = engine.req_to_token.clone()
        first = 20 if cp == 2 else 32  # the decode's own pages, dealt out grouped by owner
        pages, src, dst = {}, [], []
        for idx, n in PROMPTS.items():
            grouped = regroup_token_slots(torch.arange(first * PAGE, first * PAGE + n), PAGE, cp)
            rows[idx, :n] = grouped.to(rows.dtype)
            pages[idx] = (grouped[::PAGE] // PAGE).tolist()
            src += req.pages[idx]
            dst += pages[idx]
            first += len(pages[idx])
        free = [p for p in range(47, 12, -1) if p not in dst]
        layouts[f"grouped cp {cp}"] = (_moved_pool(engine, src, dst), (rows, pages, req.lens, free))
        if cp == 4:  # control: the same pool read through request-order slots
            wrong = engine.req_to_token.clone()
            for idx, n in PROMPTS.items():
                wrong[idx, :n] = torch.arange(pages[idx][0] * PAGE, pages[idx][0] * PAGE + n, dtype=wrong.dtype)
            layouts["control"] = (_moved_pool(engine, src, dst), (wrong, pages, req.lens, free))
    out = {}
    for name, (pool, state) in layouts.items():
        engine.rebind_pool(pool)
        out[name] = _decode(engine, toks, state)
        out[name + " pages"] = state[1]
    return out


@pytest.mark.timeout(300)
def test_decode_reads_owner_grouped_pages_as_request_order(tmp_path):
    path = H.write_checkpoint(str(tmp_path / "tiny"), H.TINY_V32)
    (out,) = run_ranks(run_layouts, 1, args=(path,), timeout_s=280)
    want = out["request order"]
    assert len(want) == STEPS and all(torch.isfinite(w).all() for w in want)
    for cp in (2, 4):
        pages = out[f"grouped cp {cp} pages"]
        assert pages[0] != sorted(pages[0]), "the layout must actually be regrouped"
        for step, (g, w) in enumerate(zip(out[f"grouped cp {cp}"], want)):
            assert torch.equal(g, w), f"CP {cp}, decode step {step}: logits differ"
    assert not torch.equal(out["control"][0], want[0]), "the control must see a different cache"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
