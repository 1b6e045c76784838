"""CPU (the traffic comparison imports SGLang): the GPU server harness's set-up (test/helpers/sglang_gpu_servers.py and
sglang_gpu_server_stand_ins.py), checked without a GPU: what `scripts/gpu_run.sh server` runs
on the H200 must compare like with like and put every rank on GPU 0 as its own NCCL host."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("cp", [2, 4])
def test_both_prefills_get_the_same_kv_bytes_per_rank_and_only_shared_has_the_flag(cp):
    from helpers import sglang_gpu_servers as GS

    roles = GS.roles(cp)
    shared, replicated = roles["shared"][0], roles["replicated"][0]
    assert _arg(shared, "--max-total-tokens") == _arg(replicated, "--max-total-tokens"), f"{cp=}"
    assert "--enable-nsa-prefill-cp-shared-kv" in shared, f"{cp=}"
    assert "--enable-nsa-prefill-cp-shared-kv" not in replicated, f"{cp=}"
    assert _arg(shared, "--attn-cp-size") == _arg(replicated, "--attn-cp-size") == str(cp), f"{cp=}"


@pytest.mark.parametrize("cp", [2, 4])
def test_layer_split_is_the_replicated_prefill_plus_sglangs_flag(cp):
    """sglang_server_check.py --layer-split: SGLang's layer split beside the flag at the same rows per rank."""
    from helpers import sglang_gpu_servers as GS

    roles = GS.roles(cp)
    assert roles["layer_split"][0] == roles["replicated"][0] + ["--enable-dsa-cache-layer-split"], f"{cp=}"
    assert roles["layer_split"][1], "a PD prefill needs its bootstrap port"


def test_the_speculative_check_runs_eagle_on_both_prefills_and_the_decode_but_not_the_oracle(tmp_path):
    """sglang_server_check.py --model mtp-toy: the same roles as the toy's, EAGLE added to the two
    prefills and the decode, the servers' stand-in plugin told to build the NextN MLP dense, and a
    checkpoint whose NextN layer is the target's layer 0 (so the draft is accepted)."""
    from safetensors.torch import load_file

    from helpers import sglang_gpu_servers as GS

    spec = GS.MODELS["mtp-toy"]
    plain, roles = GS.roles(2, dataclasses.replace(spec, speculative=False)), GS.roles(2, spec)
    for name in GS.SPEC_ROLES:
        assert roles[name] == (plain[name][0] + GS.SPEC_ARGS, plain[name][1]), name
    assert roles["single"] == plain["single"] and "--speculative-algorithm" not in roles["single"][0]
    cluster = GS.GpuCluster(tmp_path, cp=2, spec=spec)
    assert cluster.server_env()[GS.SPEC_ENV] == "1"
    assert GS.SPEC_ENV not in GS.GpuCluster(tmp_path / "toy", cp=2).server_env()
    sd = load_file(os.path.join(GS.write_model(str(tmp_path / "model"), spec), "model.safetensors"))
    layers = spec.config["num_hidden_layers"]
    copied = [k for k in sd if k.startswith("model.layers.0.")]
    assert copied and all(sd[k].equal(sd[k.replace("model.layers.0.", f"model.layers.{layers}.")]) for k in copied), (
        "the NextN layer is layer 0's copy"
    )


def _report(tmp_path, port, rank, forwards):
    import json

    (tmp_path / f"collectives-{port}{rank}.json").write_text(json.dumps(
        {"port": port, "rank": rank, "attn_cp_rank": rank, "attn_cp_size": 2, "forwards": forwards, "outside": {}}))  # fmt: skip


def test_server_check_compares_counted_bytes_with_the_formula(tmp_path, monkeypatch):
    """The check's comparison (`counted_traffic`) on reports as the counter writes them: a forward
    whose bytes are the formula's is exact, one broadcast short is not."""
    from types import SimpleNamespace

    sys.path.insert(0, str(os.path.join(os.path.dirname(__file__), "..", "..", "scripts")))
    import sglang_server_check as check

    from helpers import collective_counter as C

    monkeypatch.setenv(C.ENV, str(tmp_path))
    rows, page = 1024, 64
    broadcast = 2 * ((rows + page) * 1152 + (rows + page + 1) // page * page * 132)  # 2 layers, bf16
    site = "sglang.srt.mem_cache.dsa_cache_layer_split:_broadcast_tensor_from_owner"
    history = 2 * 2 * page * (1152 + 132)  # 2 layers, 2 pages (one each rank) of 128 cached tokens
    gather_site = "sglang.srt.mem_cache.page_interleave_pool:_prefetch_layer"
    for rank in (0, 1):
        short = broadcast - (1 if rank else 0)
        _report(tmp_path, 1, rank, [{"mode": "EXTEND", "extend_lens": [40], "prefix_lens": [0],
                                     "calls": [{"op": "broadcast", "bytes": short, "site": site}]}])  # fmt: skip
        _report(tmp_path, 2, rank, [{"mode": "EXTEND", "extend_lens": [40], "prefix_lens": [128],
                                     "calls": [{"op": "all_gather", "bytes": history, "site": gather_site}]}])  # fmt: skip
    cluster = SimpleNamespace(servers={"layer_split": SimpleNamespace(ports=[1]), "shared": SimpleNamespace(ports=[2])})
    out = check.counted_traffic(cluster, "bfloat16", 2, rows, 2)
    assert out["shared"]["exact"], out["shared"]
    assert not out["layer_split"]["exact"], "rank 1's broadcast is one byte short"
    assert [f["counted"] - f["formula"] for f in out["layer_split"]["forwards"]] == [0, -1]


def test_the_long_prompt_fits_the_shared_pool_at_cp4_but_not_one_rank():
    from helpers import sglang_gpu_servers as GS

    long_prompt = 100_000  # what gpu_run.sh server sends
    assert GS.PREFILL_TOKENS_PER_RANK < long_prompt <= 4 * GS.PREFILL_TOKENS_PER_RANK - 4 * GS.CHUNK_TOKENS
    assert long_prompt < GS.BIG_POOL_TOKENS and long_prompt < GS.CONTEXT_TOKENS
    assert GS.MODEL["vocab_size"] % (4 * 64) == 0, "the vocabulary must split at TP 4 in 64-row shards"


def test_servers_run_on_cuda_through_the_stand_in_launcher_with_socket_nccl(tmp_path):
    from helpers import sglang_gpu_servers as GS

    cluster = GS.GpuCluster(tmp_path, cp=4, kv_cache_dtype="fp8_e4m3")
    cluster.model = str(tmp_path / "model")
    cmd = cluster.server_command(1, cluster.role("shared")[0], 2, 3)
    assert cmd[1:3] == ["-m", "helpers.sglang_gpu_server_stand_ins"], cmd
    assert (_arg(cmd, "--device"), _arg(cmd, "--kv-cache-dtype")) == ("cuda", "fp8_e4m3")
    assert _arg(cmd, "--dsa-prefill-backend") == "flashmla_sparse"
    env = cluster.server_env()
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["TRITON_INTERPRET"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_HOSTID" not in env, "the launcher sets it per rank, never for a whole server"
    assert not [k for k in GS.CPU_ONLY_ENV if k in env and k not in GS.GPU_ENV]
    entry_points = (tmp_path / "plugin_site").glob("*.dist-info/entry_points.txt")
    assert "helpers.sglang_gpu_server_stand_ins:register" in next(entry_points).read_text()


def test_each_rank_starts_on_gpu_zero_as_its_own_nccl_host(monkeypatch):
    monkeypatch.setenv("NCCL_HOSTID", "outer")
    from helpers.distributed import on_gpu_zero

    for rank in (0, 3):
        with on_gpu_zero(rank) as gpu:
            assert gpu == 0
            assert os.environ["NCCL_HOSTID"] == f"nsa-cp-test-rank-{rank}"
        assert os.environ["NCCL_HOSTID"] == "outer", "restored for the launcher's next child"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
