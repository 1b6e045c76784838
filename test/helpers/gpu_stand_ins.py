"""Import-time stand-ins for the two SGLang 0.5.23 dependencies that cannot load on the GPU machine.

SGLang 0.5.23 pins torch 2.14.1. The GPU machine has torch 2.11.0+cu130, and two of SGLang's
compiled dependencies are built against torch's unstable C++ ABI, so they do not load there:

- `sgl_kernel` (wheel `sglang-kernel` 0.4.10): its pure-Python package imports, but
  `load_utils._load_architecture_specific_ops()` loads `sm90/common_ops.abi3.so`, which registers
  the `torch.ops.sgl_kernel.*` ops. The bundle (docs/gpu_bundle.md) ships the Python files only.
- `deep_gemm` (DeepGEMM's `_C.so`): not in the bundle at all.

SGLang imports both at module import time, so the stand-ins must be in place before the first
`import sglang...`: call `install()` first. After that:

- `import sgl_kernel` works; its op library is an object whose attributes are functions that
  raise `StandInCalled` (a NotImplementedError) naming the op.
- `torch.ops.sgl_kernel.<op>` raises `MissingSglKernelOp`, both an AttributeError (so SGLang's
  own `hasattr(torch.ops.sgl_kernel, ...)` probes answer False, as on a machine without the
  library) and a NotImplementedError whose message names the op and the audit doc.
- `import deep_gemm` (and any `deep_gemm.*` submodule) works; every attribute is a function that
  raises `StandInCalled` naming it. Because the module now imports, SGLang would think DeepGEMM
  is usable: `install()` therefore sets `SGLANG_ENABLE_JIT_DEEPGEMM=0` when it is unset (SGLang
  reads it at import) and refuses to run when it is set to a true value.

Every stand-in records each use with its caller's `file:line`; `uses()` returns them and
`report()` formats them, so a harness can list exactly what it needed and where.
docs/sglang_gpu_forward.md says what replaces each op on the DSA forward path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

AUDIT_DOC = "docs/sglang_gpu_forward.md"


class _Uses(list):
    """(stand-in name, caller "file:line", kind) in the order they happened; kind is "call" or
    "lookup". `on_first_use`, when set, sees each distinct use once, as it happens (a server logs
    it: its processes are killed, not asked for a report)."""

    on_first_use = None

    def append(self, use) -> None:
        if self.on_first_use is not None and use not in self:
            self.on_first_use(use)
        super().append(use)


_USES = _Uses()
_INSTALLED: set[str] = set()


class StandInCalled(NotImplementedError):
    """A stand-in function was called: the real kernel is not loadable on this machine."""


class MissingSglKernelOp(NotImplementedError, AttributeError):
    """`torch.ops.sgl_kernel.<op>` looked up while sgl_kernel's op library is not loaded."""


def _caller(depth: int) -> str:
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _StandIn:
    """A stand-in function: calling it records the call and raises `StandInCalled`. Its
    attributes are stand-ins too, so `deep_gemm.utils.layout.f(...)` and
    `from deep_gemm.utils import layout` work as far as the call."""

    def __init__(self, name: str):
        self._name = name
        self.__name__ = self.__qualname__ = name.rsplit(".", 1)[-1]

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _USES.append((self._name, _caller(2), "call"))
        raise StandInCalled(f"{self._name} is a stand-in (its compiled library cannot load on torch {_torch_version()}); "
                            f"replace this call site as {AUDIT_DOC} says")  # fmt: skip

    def __repr__(self):
        return f"<stand-in {self._name}>"


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return torch.__version__ if torch is not None else "?"


def _sgl_kernel_op_namespace():
    import torch

    class SglKernelOps(torch._ops._OpNamespace):
        """`torch.ops.sgl_kernel`: real ops if any are registered, else a recorded miss."""

        def __getattr__(self, op_name: str):
            try:
                return super().__getattr__(op_name)
            except AttributeError:
                if op_name.startswith("__"):
                    raise
                _USES.append((f"torch.ops.sgl_kernel.{op_name}", _caller(2), "lookup"))
                raise MissingSglKernelOp(f"torch.ops.sgl_kernel.{op_name} is not loaded (sgl_kernel's op library cannot "
                                         f"load on torch {torch.__version__}); replace this call site as {AUDIT_DOC} says") from None  # fmt: skip

    return SglKernelOps("sgl_kernel")


def _install_sgl_kernel() -> None:
    if "sgl_kernel" in sys.modules:
        raise RuntimeError("gpu_stand_ins.install() must run before anything imports sgl_kernel "
                           "(SGLang does at import time): call it before the first `import sglang...`")  # fmt: skip
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sgl_kernel's Python package is not on sys.path: unpack the bundle with "
                          "`source scripts/gpu_unpack.sh` (it exports PYTHONPATH), see docs/gpu_bundle.md")  # fmt: skip
    path = os.path.join(list(spec.submodule_search_locations)[0], "load_utils.py")
    lu_spec = importlib.util.spec_from_file_location("sgl_kernel.load_utils", path)
    load_utils = importlib.util.module_from_spec(lu_spec)
    lu_spec.loader.exec_module(load_utils)
    # sgl_kernel/__init__.py calls this at import; the real one loads sm90/common_ops.abi3.so.
    load_utils._load_architecture_specific_ops = lambda: _StandIn("sgl_kernel.common_ops")
    sys.modules["sgl_kernel.load_utils"] = load_utils

    import torch

    # The op library would have registered torch.ops.sgl_kernel.*; set the namespace before
    # anything looks it up (torch.ops caches a namespace on first access).
    setattr(torch.ops, "sgl_kernel", _sgl_kernel_op_namespace())


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import <root>` and `import <root>.<anything>` with a `_StandInModule`."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _install_deep_gemm() -> None:
    flag = os.environ.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "0")
    if flag.strip().lower() not in ("0", "false"):
        raise ValueError(f"SGLANG_ENABLE_JIT_DEEPGEMM={flag!r} would send SGLang to the deep_gemm stand-in; "
                         "unset it or set it to 0, or call install(deep_gemm=False)")  # fmt: skip
    if "deep_gemm" in sys.modules:
        raise RuntimeError("gpu_stand_ins.install() must run before anything imports deep_gemm "
                           "(SGLang does at import time): call it before the first `import sglang...`")  # fmt: skip
    sys.meta_path.insert(0, _StandInFinder("deep_gemm"))


def install(sgl_kernel: bool = True, deep_gemm: bool = True) -> None:
    """Install the stand-ins (idempotent). Call before the first `import sglang...`."""
    if sgl_kernel and "sgl_kernel" not in _INSTALLED:
        _install_sgl_kernel()
        _INSTALLED.add("sgl_kernel")
    if deep_gemm and "deep_gemm" not in _INSTALLED:
        _install_deep_gemm()
        _INSTALLED.add("deep_gemm")


def uses() -> list[tuple[str, str, str]]:
    """Every stand-in use so far: (name, caller file:line, "call" or "lookup")."""
    return list(_USES)


def report() -> str:
    """One line per distinct (name, caller, kind) with its count, in first-use order."""
    counts: dict[tuple[str, str, str], int] = {}
    for use in _USES:
        counts[use] = counts.get(use, 0) + 1
    if not counts:
        return "stand-ins: none used"
    lines = [f"stand-ins used ({len(counts)} distinct):"]
    lines += [f"  {kind:6} {name}  x{n}  at {caller}" for (name, caller, kind), n in counts.items()]
    return "\n".join(lines)


def record_call(name: str) -> None:
    """A torch stand-in written here (not an import-time one) was called: recorded like the others."""
    _USES.append((name, _caller(3), "call"))
