"""Environment variables of the SGLang plugin, declared once and typed. Mirrors `sglang/srt/environ.py`.

SGLang seals its own `EnvField` declarations once `sglang.srt.environ` is imported
(`EnvField._allow_set_name = False`), so the plugin keeps a minimal equivalent with the same
parsing and the same `.get()` / `.override()` surface.
The PD secret, `SGLANG_NSA_CP_PD_SECRET`, is the core's (declared in `disagg/auth.py`, where the
standalone protocol reads it); the plugin's Mooncake hooks read it through `auth.pd_secret()`.
TODO(lead): move to `sglang_nsa_cp/envs.py` once that registry exists.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

_TRUE = ("true", "1", "yes", "y")
_FALSE = ("false", "0", "no", "n")


class EnvBool:
    """A boolean env var read with `.get()`: SGLang's `EnvBool` spellings; an invalid value raises."""

    def __init__(self, name: str, default: bool):
        self.name = name
        self.default = default

    def get(self) -> bool:
        value = os.environ.get(self.name)
        if value is None or value == "":
            return self.default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"{self.name}={value!r} is not a boolean; use one of {_TRUE + _FALSE}")

    @contextmanager
    def override(self, value: bool):
        saved = os.environ.get(self.name)
        os.environ[self.name] = "1" if value else "0"
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = saved

    def __bool__(self):
        raise RuntimeError(f"use {self.name}.get(), not the variable itself")


class NsaCpEnvs:
    # Turns shared-KV prefill CP on for `sglang.Engine(...)` users, whose keyword arguments cannot
    # carry a flag ServerArgs does not declare. Same as `--enable-nsa-prefill-cp-shared-kv`.
    SGLANG_NSA_CP_SHARED_KV = EnvBool("SGLANG_NSA_CP_SHARED_KV", False)
    # One-layer-ahead history prefetch in the shared-KV pool. Off (0): each layer's history is
    # all-gathered when the layer is first written, on the writing stream. For diagnosis only.
    SGLANG_NSA_CP_PREFETCH = EnvBool("SGLANG_NSA_CP_PREFETCH", True)


envs = NsaCpEnvs()
