"""CPU: the demo (`bash scripts/demo.sh`, test/helpers/demo.py) with the options README.md and
docs/sglang_cpu_server.md show, through the demo's own code path: SGLang's real servers, the tokens
of every path against the oracle, the prompt only shared KV can serve, SGLang's capacity reports.

- A few seconds: the tiny checkpoint loads at every CP size the demo takes (SGLang's CPU head
  padding leaves it alone), the others are refused with the reason, and the report's capacity
  sentence says what its rows show.
- In CI: the default, `bash scripts/demo.sh` (CP=2, bf16: the README's first command), runs the
  demo's own requests and reports (`demo.exercise`) on test_sglang_server_pd.py's cluster, which
  is started with the demo's options (`demo.cluster_options`), so CI starts one cluster fewer;
  the same assertions (helpers/demo_checks.py). Here, by hand, it starts its own servers.
- By hand (NSA_CP_DEMO_ALL=1): the default as `bash scripts/demo.sh` runs it, `--cp 4 --kv-cache-dtype fp8_e4m3 --hicache` (four CP ranks per
  prefill, fp8 KV, HiCache's host tier: ~20 SGLang processes, 5-10 min on 2 cores; fp8 and HiCache
  each have their own server test in CI) and `--cp 8` (the slowest: 2 x 8 CP ranks; timings in
  docs/sglang_cpu_server.md). `--cp` 3, 5, 6 and 7 cannot run on CPU (SGLang's CPU head
  padding against flashmla_sparse's 64-head rule): refused with the reason, checked here.

Each server run (`assert_demo_run`): every prompt's greedy tokens through the shared-KV PD (router),
the replicated PD and the non-CP oracle are equal; a prompt longer than one prefill rank's pool
(both prefills hold the same KV rows per rank) is refused by the replicated prefill with SGLang's
own message and served by the shared-KV PD with the oracle's tokens; SGLang reports N x the logical
tokens for the shared prefill in the same pool rows per rank; every process and port is gone
afterwards.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import demo  # noqa: E402
from helpers.demo_checks import assert_demo_run  # noqa: E402
from helpers import sglang_servers as S  # noqa: E402

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")

BY_HAND = pytest.mark.skipif(
    os.environ.get("NSA_CP_DEMO_ALL") != "1", reason="by hand: NSA_CP_DEMO_ALL=1 (minutes of start-up on 2 cores)"
)
DEMO_COMMANDS = [
    pytest.param([], id="default", marks=BY_HAND),  # in CI: test_sglang_server_pd.py's cluster
    pytest.param(["--cp", "4", "--kv-cache-dtype", "fp8_e4m3", "--hicache"], id="cp4-fp8-hicache", marks=BY_HAND),
    pytest.param(["--cp", "8"], id="cp8", marks=BY_HAND),
]


def _adjusted_heads(config: dict, tp: int, tmp_path) -> tuple[int, int]:
    """Attention and KV heads after SGLang's CPU TP adjustment (what a --device cpu server builds)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

    path = tmp_path / f"tp{tp}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    model_config = adjust_config_with_unaligned_cpu_tp(ModelConfig(str(path)), LoadConfig(), tp)
    return model_config.num_attention_heads, model_config.get_total_num_kv_heads()


def test_the_checkpoint_keeps_its_heads_at_every_demo_cp_size(tmp_path):
    """SGLang pads a CPU server's heads to a multiple of TP but loads attention weights unpadded:
    the demo's checkpoint at CP=N has N heads, so nothing is padded (MODEL's 2 heads would be at
    4), and N divides 64 as SGLang's flashmla_sparse path needs."""
    assert _adjusted_heads(S.MODEL, 4, tmp_path) == (4, 4)  # what broke --cp 4 (kv_b_proj 256 vs 128)
    assert S.model_for_tp(S.CP) == S.MODEL  # the existing CP=2 tests keep their checkpoint
    for tp in demo.CP_SIZES:
        config = S.model_for_tp(tp)
        assert _adjusted_heads(config, tp, tmp_path) == (tp, tp), f"{tp=}"
        assert 64 % config["num_attention_heads"] == 0, f"{tp=}"


@pytest.mark.parametrize("cp", [3, 5, 6, 7])
def test_cp_sizes_that_cannot_run_on_cpu_are_refused_with_the_reason(cp, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--cp", str(cp)])
    assert exit_.value.code == 2
    assert f"--cp {cp}: on CPU must be 2, 4 or 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"model_for_tp\\({cp}\\)"):
        S.model_for_tp(cp)


def _capacity(logical_tokens: int, rows_per_rank: int, n: int) -> dict:
    return {"logical_tokens": logical_tokens, "kv_gb": [0.001], "pool_rows": dict.fromkeys(range(n), rows_per_rank),
            "scratch_mib": {}, "host_rows": {}, "transfer": {}}  # fmt: skip


def test_the_capacity_sentence_says_what_the_rows_show():
    args = SimpleNamespace(cp=2, kv_cache_dtype="fp8_e4m3")
    same_rows = demo.capacity_lines(args, _capacity(1024, 512, 2), _capacity(512, 512, 2))
    assert same_rows[-1] == "logical capacity, shared / replicated = 2.00 x in the same KV memory per rank"
    # the same logical capacity from half the rows per rank (HiCache's test sizes its pools so)
    half_rows = demo.capacity_lines(args, _capacity(1024, 512, 2), _capacity(1024, 1024, 2))
    assert half_rows[-1] == "logical capacity, shared / replicated = 1.00 x in 0.50 x the KV memory per rank"


@pytest.mark.parametrize("argv", DEMO_COMMANDS)
def test_demo_serves_every_path_with_the_oracles_tokens(argv, tmp_path, capsys):
    args = demo.parse_args([*argv, "--workdir", str(tmp_path / "demo")])
    run = demo.run_demo(args, tmp_path / "demo")
    with capsys.disabled():
        print(f"\n{' '.join(argv) or 'default'}: servers up in {run.startup_s:.0f} s")
        if run.error is None:
            demo.report(args, run)
    assert_demo_run(args, run)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
