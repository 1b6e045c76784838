"""A test-only count of the KV collectives a real server's ranks issue: per forward, per call, the op,
its bytes, its group size and the SGLang code that issued it.

Installed by the CPU stand-in plugin (`sglang_cpu_stand_ins.register`) in every server process when
`NSA_CP_TEST_COUNT_COLLECTIVES` names a folder; each scheduler (model runner) then writes
`<folder>/collectives-<pid>.json`, rewritten after each forward:

    {"pid": ..., "port": <the server's HTTP port>, "rank": <torch.distributed's>, "attn_cp_rank": ..., "attn_cp_size": ...,
     "forwards": [{"index": 0, "mode": "EXTEND", "extend_lens": [...], "prefix_lens": [...],
                   "calls": [{"op": "broadcast", "bytes": ..., "world": 2, "site": "module:function", "via": <its caller>, "stack": [<the next callers>]}]}],
     "outside": {"<op> <site>": {"calls": ..., "bytes": ...}}}   # collectives between forwards

What is wrapped: SGLang's `PyNcclCommunicator.all_gather` / `.broadcast` (a GPU's CP groups, the
sharded pool's gather, layer split's broadcasts) and `torch.distributed.all_gather_into_tensor` /
`all_gather` / `broadcast` (gloo on CPU, where the stand-in communicator gathers through it). A call
made inside a counted call is not counted again. `bytes`: the gathered output (N x one rank's block,
as `comm.TrafficCounter` counts) for an all-gather, the tensor for a broadcast. `site`: the first
caller outside torch.distributed, sglang.srt.distributed, the stand-ins and this module, e.g.
`sglang.srt.mem_cache.dsa_cache_layer_split:_broadcast_tensor_from_owner` (layer split),
`sglang.srt.mem_cache.page_interleave_pool:_prefetch_layer` (the flag's history gather),
`sglang.srt.layers.cp.interleave:...` (CP's own all-gathers of the chunk).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

ENV = "NSA_CP_TEST_COUNT_COLLECTIVES"
# callers that are plumbing, not the site that asked for the collective
SKIPPED_MODULES = ("torch.", "sglang.srt.distributed", "helpers.sglang_cpu_stand_ins", __name__)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


STACK_FRAMES = 6  # callers recorded per call, the site first


def call_site(depth: int = 2) -> list[str]:
    """`module:function` of the first frame above the wrappers that is not plumbing, then its callers."""
    frame, found = sys._getframe(depth), []
    while frame is not None and len(found) < STACK_FRAMES:
        module = frame.f_globals.get("__name__", "?")
        if found or not (module == "torch" or module.startswith(SKIPPED_MODULES)):
            found.append(f"{module}:{frame.f_code.co_name}")
        frame = frame.f_back
    return found or ["?"]


class CollectiveCounter:
    """The records of one process; `path` None keeps them in memory only (the unit test)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.meta: dict = {"pid": os.getpid()}
        self.forwards: list[dict] = []
        self.outside: dict[str, dict] = {}
        self.current: dict | None = None  # the forward in progress (on thread `forward_thread`)
        self.forward_thread: int | None = None
        self._local = threading.local()

    # ---- recording --------------------------------------------------------------------------------

    def record(self, op: str, nbytes: int, world: int, site: str, *callers: str) -> None:
        if self.current is not None and threading.get_ident() == self.forward_thread:
            self.current["calls"].append({"op": op, "bytes": nbytes, "world": world, "site": site,
                                          "via": callers[0] if callers else "?", "stack": list(callers)})  # fmt: skip
        else:
            slot = self.outside.setdefault(f"{op} {site}", {"calls": 0, "bytes": 0})
            slot["calls"] += 1
            slot["bytes"] += nbytes

    def wrap(self, fn, op: str, nbytes_of, world_of):
        """`fn` counted: `nbytes_of(*args, **kwargs)` bytes, `world_of(...)` ranks, once per outermost call."""
        if getattr(fn, "_collective_counter", None) is self:
            return fn

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self.record(op, nbytes_of(*args, **kwargs), world_of(*args, **kwargs), *call_site())
            self._local.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.inside = False

        counted._collective_counter = self
        return counted

    def begin_forward(self, forward_batch=None) -> None:
        record = {"index": len(self.forwards), "calls": []}
        if forward_batch is not None:
            record["mode"] = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
            for key, attr in (("extend_lens", "extend_seq_lens_cpu"), ("prefix_lens", "extend_prefix_lens_cpu")):
                value = getattr(forward_batch, attr, None)
                record[key] = [int(v) for v in value] if value is not None else None
            record["return_logprob"] = bool(getattr(forward_batch, "return_logprob", False))
        self.current, self.forward_thread = record, threading.get_ident()

    def end_forward(self) -> None:
        if self.current is not None:
            self.forwards.append(self.current)
            self.current = None
        self.flush()

    # ---- output -----------------------------------------------------------------------------------

    def report(self) -> dict:
        return {**self.meta, "forwards": self.forwards, "outside": self.outside}

    def flush(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        Path(tmp).write_text(json.dumps(self.report()))
        os.replace(tmp, self.path)

    # ---- installation -----------------------------------------------------------------------------

    def install_torch_distributed(self) -> None:
        """Wrap torch.distributed's all_gather_into_tensor / all_gather / broadcast (module attributes)."""

        def world(group=None):
            return dist.get_world_size(group)

        dist.all_gather_into_tensor = self.wrap(
            dist.all_gather_into_tensor, "all_gather", lambda out, inp, group=None, *a, **k: _nbytes(out),
            lambda out, inp, group=None, *a, **k: world(group),
        )  # fmt: skip
        if hasattr(dist, "all_gather_single"):  # what SGLang's CPU all-gathers call (the new name)
            dist.all_gather_single = self.wrap(
                dist.all_gather_single, "all_gather", lambda out, inp, group=None, *a, **k: _nbytes(out),
                lambda out, inp, group=None, *a, **k: world(group),
            )  # fmt: skip
        dist.all_gather = self.wrap(
            dist.all_gather, "all_gather", lambda outs, inp, group=None, *a, **k: sum(_nbytes(t) for t in outs),
            lambda outs, inp, group=None, *a, **k: world(group),
        )  # fmt: skip
        dist.broadcast = self.wrap(
            dist.broadcast, "broadcast", lambda t, src=None, group=None, *a, **k: _nbytes(t),
            lambda t, src=None, group=None, *a, **k: world(group),
        )  # fmt: skip

    def rebind_sglang_imports(self) -> None:
        """SGLang imports torch.distributed's all-gathers by name (`sglang.srt.distributed.utils.
        all_gather_single`, re-imported by parallel_state, dp_attention, ...): rebind those names in
        every sglang module imported so far (later imports take the rebound one from there)."""
        import sglang.srt.distributed.utils  # noqa: F401  (the name's source, before anything copies it)

        counted = {id(getattr(dist, name).__wrapped__): getattr(dist, name)
                   for name in ("all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast")
                   if getattr(getattr(dist, name, None), "_collective_counter", None) is self}  # fmt: skip
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("sglang") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                wrapped = counted.get(id(value))
                if wrapped is not None and wrapped.__wrapped__ is value:
                    setattr(module, attr, wrapped)

    def install_pynccl(self) -> None:
        """Wrap SGLang's PyNcclCommunicator.all_gather / .broadcast (class attributes)."""
        from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator as C

        C.all_gather = self.wrap(C.all_gather, "all_gather", lambda self_, out, inp, *a, **k: _nbytes(out),
                                 lambda self_, *a, **k: self_.world_size)  # fmt: skip
        C.broadcast = self.wrap(C.broadcast, "broadcast", lambda self_, t, *a, **k: _nbytes(t),
                                lambda self_, *a, **k: self_.world_size)  # fmt: skip


_COUNTER: CollectiveCounter | None = None


def _after_why_every_token(result, *args, **kwargs):
    """AFTER the plugin's `why_every_token` (called once a forward, at its tail gather): its reason to
    gather every token's hidden state for the logits, or None where its narrow gather runs."""
    if _COUNTER is not None and _COUNTER.current is not None:
        _COUNTER.current["every_token_tail_because"] = result
    return result


def _around_forward(original, runner, *args, **kwargs):
    """AROUND ModelRunner.forward: one record per forward, the file rewritten after it."""
    counter = _COUNTER
    forward_batch = args[0] if args else kwargs.get("forward_batch")
    if not counter.meta.get("port"):
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        counter.meta.update(port=runner.server_args.port, rank=dist.get_rank(),
                            attn_cp_rank=parallel.attn_cp_rank, attn_cp_size=parallel.attn_cp_size)  # fmt: skip
    counter.begin_forward(forward_batch)
    try:
        return original(runner, *args, **kwargs)
    finally:
        counter.end_forward()


def install_in_server(folder: str) -> CollectiveCounter:
    """What the stand-in plugin calls in every server process when `ENV` names a folder."""
    global _COUNTER
    if _COUNTER is not None:
        return _COUNTER
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    Path(folder).mkdir(parents=True, exist_ok=True)
    _COUNTER = CollectiveCounter(str(Path(folder) / f"collectives-{os.getpid()}.json"))
    _COUNTER.install_torch_distributed()
    _COUNTER.rebind_sglang_imports()
    _COUNTER.install_pynccl()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", _around_forward, HookType.AROUND
    )
    HookRegistry.register(
        "sglang_nsa_cp.sglang_ext.layers.cp.utils.why_every_token", _after_why_every_token, HookType.AFTER
    )
    return _COUNTER


def read_reports(folder: str | Path, port: int | None = None) -> list[dict]:
    """Every scheduler's report in `folder` (those of the server on `port`), by attention-CP rank."""
    reports = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("collectives-*.json"))]
    reports = [r for r in reports if r.get("port") and (port is None or r["port"] == port)]
    return sorted(reports, key=lambda r: (r["attn_cp_rank"], r["rank"]))
