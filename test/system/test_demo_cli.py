"""The demo command (`python -m sglang_nsa_cp demo`): the KV it reports as held, and its refusal
of bad input. CPU; 2 to 5 minutes on 2 shared cores: two demo runs with 6 and 8 ranks, and
23 short command runs (about 3 s of imports each).

Bad input is run as a user runs it, in a subprocess: one line on stderr naming the option, the
value and the rule, nothing on stdout, exit status 2, and no work done (no report, no --json file).
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.__main__ import main, set_mooncake_log_level
from sglang_nsa_cp.layout import OwnerClassedAllocator, RequestPageTable
from sglang_nsa_cp.oracle import Scenario, held_pages, run_oracle
from sglang_nsa_cp.reference import get_config
from sglang_nsa_cp.shared_kv import KVStore

register_cpu_ci(est_time=300, suite="nsa-cp-test-cpu")

PROG = "python -m sglang_nsa_cp demo: error: "


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_nsa_cp", "demo", *args]


def _page_bytes(config: str, page_size: int, value_bytes: int = 4) -> int:
    """Hand count: per layer and token, one MLA latent row and 128 fp8 index bytes + an fp32 scale."""
    cfg = get_config(config)
    return cfg.num_layers * page_size * (cfg.latent_dim * value_bytes + 128 + 4)


# ---- held KV: pages of the requests that each rank keeps --------------------------------------


def _held_per_rank(scenario: Scenario, cp_size: int) -> tuple[list[int], int]:
    """Shared pages held by each rank and replicated pages held per rank, from the page table
    the CP paths build (every rank schedules the same pages)."""
    cfg = get_config(scenario.config)
    table = RequestPageTable(OwnerClassedAllocator(scenario.num_pages(), cp_size), scenario.page_size)
    for chunk in scenario.chunks:
        table.schedule([k for k, _ in chunk], [n for _, n in chunk], "page_zigzag")
    kw = dict(
        num_layers=cfg.num_layers,
        num_pages=scenario.num_pages(),
        page_size=scenario.page_size,
        latent_dim=cfg.latent_dim,
    )
    shared = [held_pages(KVStore(cp_size=cp_size, rank=r, **kw), table) for r in range(cp_size)]
    return shared, held_pages(KVStore.replicated(**kw), table)


@pytest.mark.parametrize(
    "cp_size, lens, want_shared",
    [
        (8, [3], [1, 0, 0, 0, 0, 0, 0, 0]),  # one page, N larger than the request's pages
        (6, [1000], [11, 11, 11, 10, 10, 10]),  # ceil(1000 / 16) = 63 pages
        (3, [16, 17], [1, 1, 1]),  # 1 + 2 pages
    ],
)
def test_each_page_is_held_once_by_its_owner(cp_size, lens, want_shared):
    scenario = Scenario([[(f"r{i}", n) for i, n in enumerate(lens)]], cp_size=cp_size, page_size=16)
    shared, replicated = _held_per_rank(scenario, cp_size)
    assert shared == want_shared, f"{cp_size=}, {lens=}"
    assert replicated == sum(-(-n // 16) for n in lens) == sum(shared), f"{cp_size=}, {lens=}"


def test_demo_reports_a_held_ratio_of_one_when_n_exceeds_the_pages(tmp_path):
    # 3 tokens are one page: every replicated rank and one shared rank hold it (ratio 1.0),
    # while the pools, sized in whole pages per rank, differ by N (0.125).
    out = tmp_path / "report.json"
    proc = subprocess.run(
        _demo_cmd("--cp", "8", "--extend-lens", "3", "--json", str(out)), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = _page_bytes("tiny", 16)
    assert page == 15552
    report = json.loads(out.read_text())
    assert report["held_pages_per_rank"] == {"replicated": [1] * 8, "shared": [1] + [0] * 7}
    assert report["held_bytes_per_rank"] == {"replicated": [page] * 8, "shared": [page] + [0] * 7}
    assert report["kv_bytes_per_rank"] == {"replicated": [8 * page] * 8, "shared": [page] * 8}
    assert report["paths"]["single"]["held_bytes"] == page
    assert report["kv_per_rank"]["held_ratio"] == 1.0 and report["kv_per_rank"]["pool_ratio"] == 0.125
    assert "shared KV held per rank = 1.000 x replicated (busiest rank 1 of 1 pages; 1/N = 0.125)" in proc.stdout
    assert "shared KV pool per rank = 0.125 x replicated" in proc.stdout
    assert "Shared pages held by ranks 0..7: 1, 0, 0, 0, 0, 0, 0, 0" in proc.stdout


def test_held_ratio_is_the_busiest_ranks_pages_over_all_pages():
    # 1000 tokens of 16-token pages: 63 pages; 6 ranks hold 11, 11, 11, 10, 10, 10 of them, so
    # the busiest holds 11 / 63 = 0.175 of a replica, not 1/6 (the pool, padded to 66 pages).
    report = run_oracle(Scenario([[("r0", 1000)]], cp_size=6, page_size=16))
    assert report["ok"]
    page = _page_bytes("tiny", 16)
    shared, replicated = report["paths"]["shared"], report["paths"]["replicated"]
    assert shared["held_pages_per_rank"] == [11, 11, 11, 10, 10, 10]
    assert shared["held_bytes_per_rank"] == [n * page for n in [11, 11, 11, 10, 10, 10]]
    assert replicated["held_bytes_per_rank"] == [63 * page] * 6
    assert report["kv_per_rank"]["held_ratio"] == pytest.approx(11 / 63)
    assert report["kv_per_rank"]["pool_ratio"] == pytest.approx(1 / 6)


def test_demo_command_writes_a_report(tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = main(["demo", "--cp", "2", "--extend-lens", "40,9", "--prefix-lens", "21,0", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert set(report["max_rel_logit_err"]) == {"replicated", "shared"}
    assert report["kv_bytes_per_rank"]["shared"][0] * 2 == report["kv_bytes_per_rank"]["replicated"][0]
    # r0: 61 tokens = 4 pages, r1: 9 tokens = 1 page; each held once across the two shared ranks.
    assert sum(report["held_pages_per_rank"]["shared"]) == report["held_pages_per_rank"]["replicated"][0] == 5
    assert (
        report["bytes_moved"]["shared"]["tail_narrow"]["bytes"]
        < report["bytes_moved"]["replicated"]["tail_full"]["bytes"]
    )
    assert "oracle: ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "environment, option, want",
    [(None, None, "WARNING"), ("INFO", None, "INFO"), (None, "info", "INFO"), ("ERROR", "trace", "TRACE")],
)
def test_mooncake_logs_warnings_unless_asked(monkeypatch, environment, option, want):
    if environment is None:
        monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MC_LOG_LEVEL", environment)
    set_mooncake_log_level(option)
    assert os.environ["MC_LOG_LEVEL"] == want, (environment, option)


# ---- bad input: one line, exit status 2, before any work --------------------------------------

BAD_INPUTS = {
    "page size zero": (["--page-size", "0"], "--page-size 0: must be an integer from 1 to 4096 (tokens per KV page)"),
    "negative page size": (["--page-size=-16"], "--page-size -16: must be an integer from 1 to 4096"),
    "page size not a number": (["--page-size", "big"], "--page-size big: must be an integer from 1 to 4096"),
    "unknown config": (["--config", "nope"], "--config nope: must be one of tiny, glm5-attn"),
    "unknown split": (["--split", "ring"], "--split ring: must be one of zigzag, interleave"),
    "unknown dtype": (["--dtype", "half"], "--dtype half: must be one of float32, float64"),
    "no ranks": (["--cp", "0"], "--cp 0: must be an integer from 1 to 64"),
    "empty extend list": (
        ["--extend-lens="],
        "--extend-lens '': item 1 is empty; must be comma-separated integers >= 1",
    ),
    "empty prefix list": (
        ["--prefix-lens="],
        "--prefix-lens '': item 1 is empty; must be comma-separated integers >= 0",
    ),
    "empty item": (
        ["--extend-lens", "5,,6"],
        "--extend-lens 5,,6: item 2 is empty; must be comma-separated integers >= 1",
    ),
    "zero new tokens": (
        ["--extend-lens", "5,0"],
        "--extend-lens 5,0: item 2 is 0; must be comma-separated integers >= 1",
    ),
    "not a length": (["--extend-lens", "5,x"], "--extend-lens 5,x: item 2 x is not an integer"),
    "negative prefix": (
        ["--extend-lens", "5", "--prefix-lens", "-1"],
        "--prefix-lens -1: item 1 is -1; must be comma-separated integers >= 0",
    ),
    "lengths differ": (
        ["--extend-lens", "4,5", "--prefix-lens", "0"],
        "--prefix-lens 0: 1 value for the 2 requests of --extend-lens 4,5; give one cached length per request",
    ),
    "too many tokens": (
        ["--extend-lens", "70000"],
        "--extend-lens 70000: 70000 tokens in all; the CPU demo takes at most 65536",
    ),
    "oversized seed": (["--seed", str(2**64)], f"--seed {2**64}: must be an integer from 0 to {2**63 - 1}"),
    "negative seed": (["--seed", "-1"], "--seed -1: must be an integer from 0 to"),
    "decode steps without pd": (["--decode-steps", "3"], "--decode-steps 3: only used with --pd; add --pd or drop it"),
    "negative decode steps": (["--pd", "--decode-steps", "-1"], "--decode-steps -1: must be an integer from 0 to 1024"),
    "unknown mooncake level": (
        ["--pd", "--mooncake-log", "loud"],
        "--mooncake-log loud: must be one of trace, info, warning, error",
    ),
    "json in a missing folder": (
        ["--json", "{tmp}/missing/report.json"],
        "--json {tmp}/missing/report.json: cannot be written (No such file or directory)",
    ),
    "json is a folder": (["--json", "{tmp}"], "--json {tmp}: is a directory; give a file path"),
    "missing value": (["--cp"], "argument --cp: expected one argument"),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad input, two at a time (each is a fresh interpreter: about 3 s of imports)."""
    tmp = str(tmp_path_factory.mktemp("bad"))
    env = {**os.environ, "TRITON_INTERPRET": "1"}

    def run(args):
        cmd = _demo_cmd(*(a.format(tmp=tmp) for a in args))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        return proc.returncode, proc.stdout, proc.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(BAD_INPUTS, pool.map(run, [args for args, _ in BAD_INPUTS.values()])))
    return tmp, results


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_in_one_line_before_any_work(name, bad_input_runs):
    tmp, results = bad_input_runs
    code, out, err = results[name]
    want = BAD_INPUTS[name][1].format(tmp=tmp)
    assert code == 2, (name, code, err)
    assert out == "", (name, out)  # no report: nothing ran
    assert err.count("\n") == 1 and err.startswith(PROG), (name, err)
    assert want in err, (name, err)
    assert os.listdir(tmp) == [], (name, os.listdir(tmp))  # the --json probe left nothing behind


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
