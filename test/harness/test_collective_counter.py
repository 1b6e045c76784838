"""CPU (2 gloo ranks): the test-only collective counter (test/helpers/collective_counter.py) on 2 gloo ranks and in
process: what it records per forward (op, bytes, group size, calling site), what it leaves out (a
call inside a counted call, other threads' calls), that the wrapped collectives still move the data,
and the per-rank JSON the servers write."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from helpers import collective_counter as C  # noqa: E402
from helpers.distributed import run_ranks  # noqa: E402

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu")

ROWS, ROW = 65, 576  # a layer buffer of one page + 1 row, bf16 latent rows


def _history_gather(group, block):
    """Stands for the sharded pool's gather: through the CPU stand-in communicator (plumbing)."""
    from helpers.sglang_cpu_stand_ins import GlooAllGather

    out = torch.empty(2 * block.shape[0], block.shape[1], dtype=block.dtype)
    GlooAllGather(group).all_gather(out, block)
    return out


def _owner_broadcast(layer_buffer, group):
    dist.broadcast(layer_buffer, src=0, group=group)


def _counted_on_two_ranks(rank, world_size, group):
    import sglang.srt.distributed.utils as sglang_dist_utils  # copies torch's all_gather_single by name

    counter = C.CollectiveCounter()
    counter.install_torch_distributed()
    counter.install_torch_distributed()  # idempotent: a second install does not count twice
    counter.rebind_sglang_imports()
    dist.broadcast(torch.zeros(3), src=0)  # between forwards (a scheduler's request broadcast)
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="EXTEND"),
                                  extend_seq_lens_cpu=[5], extend_prefix_lens_cpu=[128])  # fmt: skip
    counter.begin_forward(batch)
    layer = torch.full((ROWS, ROW), float(rank + 1), dtype=torch.bfloat16)
    _owner_broadcast(layer, group)
    block = torch.full((3, 8), rank, dtype=torch.float32)
    gathered = _history_gather(group, block)
    sglang_dist_utils.all_gather_single(torch.empty(4, dtype=torch.int64), torch.tensor([rank, rank]), group=group)
    nested = counter.wrap(lambda t: dist.broadcast(t, src=1), "broadcast", lambda t: t.numel() * 4, lambda t: 2)
    nested(torch.zeros(10))  # a counted call inside a counted call: one record
    other = threading.Thread(target=lambda: counter.record("broadcast", 1, 2, "thread:elsewhere"))
    other.start()
    other.join()  # another thread's call during the forward: outside it
    counter.end_forward()
    return counter.report(), layer[0, 0].item(), gathered[:, 0].tolist()


def test_counts_each_call_of_a_forward_with_its_site_and_bytes():
    for rank, (report, broadcast_value, gathered) in enumerate(run_ranks(_counted_on_two_ranks, 2, timeout_s=90)):
        assert broadcast_value == 1.0, f"rank {rank}: the wrapped broadcast must still deliver rank 0's buffer"
        assert gathered == [0.0] * 3 + [1.0] * 3, f"rank {rank}: the wrapped all-gather must still gather"
        (forward,) = report["forwards"]
        assert (forward["mode"], forward["extend_lens"], forward["prefix_lens"]) == ("EXTEND", [5], [128])
        calls = [(c["op"], c["bytes"], c["world"], c["site"].rpartition(":")[2]) for c in forward["calls"]]
        assert calls == [
            ("broadcast", ROWS * ROW * 2, 2, "_owner_broadcast"),
            ("all_gather", 2 * 3 * 8 * 4, 2, "_history_gather"),  # the output, attributed past the stand-in
            ("all_gather", 32, 2, "_counted_on_two_ranks"),  # SGLang's name for it, imported before install
            ("broadcast", 40, 2, "_counted_on_two_ranks"),
        ], f"rank {rank}"
        outside = {key.rpartition(":")[2]: v for key, v in report["outside"].items()}
        assert outside == {"_counted_on_two_ranks": {"calls": 1, "bytes": 12}, "elsewhere": {"calls": 1, "bytes": 1}}


def test_pynccl_methods_are_counted_and_the_report_written(tmp_path, monkeypatch):
    from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator

    monkeypatch.setattr(PyNcclCommunicator, "all_gather", lambda self, out, inp, stream=None, sizes=None: out)
    monkeypatch.setattr(PyNcclCommunicator, "broadcast", lambda self, t, src, stream=None: t)
    counter = C.CollectiveCounter(str(tmp_path / "collectives-1.json"))
    counter.install_pynccl()
    comm = types.SimpleNamespace(world_size=4)
    counter.meta.update(port=1234, rank=1, attn_cp_rank=1, attn_cp_size=4)
    counter.begin_forward()
    PyNcclCommunicator.all_gather(comm, torch.empty(8, 656, dtype=torch.uint8), torch.empty(2, 656, dtype=torch.uint8))
    PyNcclCommunicator.broadcast(comm, torch.empty(129, 576, dtype=torch.bfloat16), 0)
    counter.end_forward()
    (report,) = C.read_reports(tmp_path, port=1234)
    assert [(c["op"], c["bytes"], c["world"]) for c in report["forwards"][0]["calls"]] == [
        ("all_gather", 8 * 656, 4),
        ("broadcast", 129 * 576 * 2, 4),
    ]
    assert C.read_reports(tmp_path, port=4321) == []
    assert json.loads((tmp_path / "collectives-1.json").read_text())["attn_cp_rank"] == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
