"""CPU (two gloo ranks): the plugin's pool subclass against SGLang's own class on one fp8
batch without cached history (sglang_ext/mem_cache/page_interleave_pool.py).

Each CP rank of 2 builds SGLang's `PageInterleaveDSATokenToKVPool` twice, handed out through the
plugin's hook on SGLang's pool builder without the flag (SGLang's class stays) and with it (the
plugin's subclass), poisons the gather scratch as the batch begins and writes the same chunk into
every layer (`helpers/sglang_pool_writes.py`):
- without the flag SGLang's class quantizes each layer write twice (the chunk for the scratch,
  the owned rows again);
- with the flag the pool bytes and the chunk's scratch rows are SGLang's, from one pass of the
  fused store's Triton kernel (run by Triton's interpreter) and no call of SGLang's quantizer;
  so is the whole scratch, row 0 included (SGLang's batch start, not overridden, leaves it as
  the scratch held it before the batch).
SGLang's quantizer is its own Triton kernel, interpreted too (the helper says why not the torch
twin the forward tests use, under which the forward's fp8 runs take the fused store's torch
reference).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import sglang_model_harness as H  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402
from helpers.sglang_pool_writes import run_fp8_pool_writes  # noqa: E402

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")

SGLANG_POOL = "sglang.srt.mem_cache.page_interleave_pool.PageInterleaveDSATokenToKVPool"
PLUGIN_POOL = "sglang_nsa_cp.sglang_ext.mem_cache.page_interleave_pool.PageInterleaveDSATokenToKVPool"
LAYERS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    model = H.write_checkpoint(str(tmp_path_factory.mktemp("tiny_v32")))
    return run_ranks(run_fp8_pool_writes, 2, args=(model,), timeout_s=400)


def _assert_same(got, want, where):
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got != want).nonzero()
    assert len(diff) == 0, f"{where}: {len(diff)} bytes differ, first at {diff[0].tolist()}"


def test_the_flag_alone_makes_the_pool_the_plugins_subclass(ranks):
    for rank, r in enumerate(ranks):
        assert r["sglang"]["pool_class"] == SGLANG_POOL, f"{rank=}"
        assert r["plugin"]["pool_class"] == PLUGIN_POOL, f"{rank=}"
        assert any(buf.any() for buf in r["sglang"]["pool"]), f"{rank=}: the batch wrote nothing"
        assert r["sglang"]["owned_tokens"] > 0, f"{rank=}: owns none of the batch's tokens"


def test_sglangs_pool_quantizes_each_write_twice(ranks):
    for rank, r in enumerate(ranks):
        assert r["sglang"]["quantizations"] == 2 * LAYERS, f"{rank=}: {r['sglang']['quantizations']}"
        assert r["sglang"]["fused_stores"] == 0, f"{rank=}: the fused store ran without the flag"


def test_with_the_flag_one_fused_pass_stores_sglangs_bytes(ranks):
    for rank, r in enumerate(ranks):
        on, sglang = r["plugin"], r["sglang"]
        assert (on["quantizations"], on["fused_stores"]) == (0, LAYERS), f"{rank=}: {on}"
        for layer, (got, want) in enumerate(zip(on["pool"], sglang["pool"], strict=True)):
            _assert_same(got, want, f"{rank=}, {layer=}: pool")
        for name, slots in sglang["scratch"].items():
            for slot, want in enumerate(slots):
                _assert_same(on["scratch"][name][slot], want, f"{rank=}, scratch {name} slot {slot}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
