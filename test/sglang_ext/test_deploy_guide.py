"""CPU: every command line of docs/deploy.md resolves as SGLang would start it.

Each `python -m sglang.launch_server` line of the guide goes through SGLang 0.5.23's own argument
resolution (`prepare_server_args`, `resolve_once`) with the plugin loaded, the GPU node stood in
(`--device cuda`, SGLang's detection there; the SM90 capability; `mlx5_0` in its InfiniBand sysfs)
and a tiny config.json of the same architecture in place of the checkpoint: the prefill
lines must come out with shared KV on SGLang's KV sharding (and the KV dtype and prefill backend
they name), the decode lines as decodes that opted in (the same flag), without SGLang's sharding. The router line goes through sglang-router's own
parser. A guide line that stops resolving fails here.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from helpers.resolution import GLM5, V32, write_config

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu-unit")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
FLAG = "--enable-nsa-prefill-cp-shared-kv"
# the checkpoint a guide line names -> the architecture of its tiny stand-in
CHECKPOINTS = {"zai-org/GLM-5-FP8": GLM5, "deepseek-ai/DeepSeek-V3.2": V32}


def guide_commands(module: str) -> list[list[str]]:
    """argv after `python -m <module>` of every command of the guide's bash blocks (continuation
    lines joined, environment assignments before the command dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", module] or (f"-m {module}" in line and "=" in words[0]):
                commands.append(words[words.index(module) + 1 :])
    return commands


SERVERS = guide_commands("sglang.launch_server")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")  # with their MTP layer, for the GLM-5 MTP line
    return {name: write_config(root / arch[1], arch, num_nextn_predict_layers=1) for name, arch in CHECKPOINTS.items()}


IB_SYSFS = "/sys/class/infiniband"


@pytest.fixture
def node(sm90, monkeypatch):
    """The GPU node as SGLang's resolution sees it: SM90 (`sm90`), and the RDMA device the guide
    names in sysfs (SGLang checks `--disaggregation-ib-device` against it)."""
    import os

    from sglang.srt.arg_groups import validation_hook

    isdir, listdir = os.path.isdir, os.listdir
    node_os = type("NodeOs", (), {})()
    node_os.path = type("NodePath", (), {"isdir": staticmethod(lambda p: p == IB_SYSFS or isdir(p))})()
    node_os.listdir = lambda p: ["mlx5_0"] if p == IB_SYSFS else listdir(p)
    monkeypatch.setattr(validation_hook, "os", node_os)


def test_the_guide_has_the_deployments_it_promises():
    prefills = [argv for argv in SERVERS if "prefill" in argv]
    decodes = [argv for argv in SERVERS if "decode" in argv]
    assert all(FLAG in argv for argv in prefills + decodes), "every line of the pair carries the flag"
    models = {argv[argv.index("--model-path") + 1] for argv in prefills}
    dtypes = {argv[argv.index("--kv-cache-dtype") + 1] for argv in prefills}
    assert models == set(CHECKPOINTS) and dtypes == {"bfloat16", "fp8_e4m3"}, (models, dtypes)
    assert len(decodes) == len(CHECKPOINTS) and len(guide_commands("sglang_router.launch_router")) == 1


@pytest.mark.parametrize("argv", SERVERS, ids=lambda argv: " ".join(argv[1:2] + argv[-5:]))
def test_every_server_line_resolves(plugin, tiny_models, node, argv):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_nsa_cp.sglang_ext.server_args import ATTR, DECODE_ATTR

    argv = list(argv) + ["--device", "cuda"]  # what SGLang detects on the GPU node; none here
    i = argv.index("--model-path") + 1
    argv[i] = tiny_models[argv[i]]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    cfg = resolving_view(server_args)
    if "prefill" in argv:
        assert getattr(server_args, ATTR) is True and cfg.enable_kv_cache_sharding is True, argv
        assert cfg.kv_cache_dtype == argv[argv.index("--kv-cache-dtype") + 1]
        assert (cfg.dsa_prefill_backend, cfg.page_size, cfg.disaggregation_mode) == ("flashmla_sparse", 64, "prefill")
    else:
        assert getattr(server_args, DECODE_ATTR) is True and not getattr(server_args, ATTR, False), argv
        assert cfg.disaggregation_mode == "decode" and not cfg.enable_kv_cache_sharding, argv


def test_the_router_line_parses():
    from sglang_router.launch_router import parse_router_args

    (argv,) = guide_commands("sglang_router.launch_router")
    router = parse_router_args(argv)
    assert router.pd_disaggregation and router.port == 8000, router


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
