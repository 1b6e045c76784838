"""Every `SGLANG_NSA_CP_*` environment variable, declared once and typed (mirrors SGLang's
`sglang/srt/environ.py`, whose own declarations are sealed once it is imported).

Each variable is read when used, with `.get()`; truth-testing the variable itself raises, so a
forgotten `.get()` cannot pass for "set". Tests change one with `.override(value)`.
docs/deploy.md's table of variables is `python -m sglang_nsa_cp.envs` (test/test_envs.py keeps
them equal).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

_TRUE = ("true", "1", "yes", "y")
_FALSE = ("false", "0", "no", "n")
MIN_SECRET_BYTES = 16


class EnvVar:
    """One variable: its name, default and meaning; `parse` turns a set, non-empty value into
    the typed value or raises ValueError naming the variable and the accepted values."""

    type_name = "str"

    def __init__(self, name: str, default, meaning: str):
        self.name = name
        self.default = default
        self.meaning = meaning

    def parse(self, value: str):
        return value

    def get(self):
        raw = os.environ.get(self.name, "")
        value = raw.strip()
        if value and value != raw:  # ' 1' reads as a typo, not as a confirmation
            raise ValueError(f"{self.name}={raw!r} has spaces around its value; set it to {value!r}")
        return self.default if value == "" else self.parse(value)

    def is_set(self) -> bool:
        return os.environ.get(self.name, "").strip() != ""

    @contextmanager
    def override(self, value):
        """Set the variable to `value` (None: unset) inside the block, as a string the same
        `.get()` reads back."""
        saved = os.environ.get(self.name)
        if value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.unparse(value)
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = saved

    def unparse(self, value) -> str:
        return str(value)

    def __bool__(self):
        raise RuntimeError(f"use {self.name}.get(), not the variable itself")


class EnvBool(EnvVar):
    """SGLang's `EnvBool` spellings; anything else raises."""

    type_name = "bool"

    def parse(self, value: str) -> bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"{self.name}={value!r} is not a boolean; use one of {_TRUE + _FALSE}")

    def unparse(self, value) -> str:
        return "1" if value else "0"


class EnvInt(EnvVar):
    type_name = "int"

    def __init__(self, name: str, default, meaning: str, minimum: int | None = None):
        super().__init__(name, default, meaning)
        self.minimum = minimum

    def parse(self, value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r} is not an integer") from None
        if self.minimum is not None and number < self.minimum:
            raise ValueError(f"{self.name}={value!r}: must be at least {self.minimum}")
        return number


class EnvChoice(EnvVar):
    """One of a fixed set of words, case-insensitive."""

    def __init__(self, name: str, default: str, choices: tuple[str, ...], meaning: str):
        super().__init__(name, default, meaning)
        self.choices = choices
        self.type_name = " \\| ".join(choices)

    def parse(self, value: str) -> str:
        if value.lower() not in self.choices:
            raise ValueError(f"{self.name}={value!r}; expected one of {self.choices}")
        return value.lower()


class EnvSecret(EnvVar):
    """Bytes of the value, or None when unset or empty; at least MIN_SECRET_BYTES long."""

    type_name = "secret"

    def get(self) -> bytes | None:
        """Spaces around the value are refused as for every other variable (a pasted secret with
        a trailing newline on one node would differ from the others'), never shown."""
        raw = os.environ.get(self.name, "")
        value = raw.strip()
        if value and value != raw:
            raise ValueError(
                f"{self.name} has {len(raw) - len(value)} space character(s) around its value; set it "
                "without them, the same on the decode and on every prefill rank"
            )
        return self.parse(value) if value else None

    def parse(self, value: str) -> bytes:
        secret = value.encode()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"{self.name} is {len(secret)} bytes long; it must be at least {MIN_SECRET_BYTES} "
                "(e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`), "
                "the same on the decode and on every prefill rank"
            )
        return secret

    def unparse(self, value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)


class NsaCpEnvs:
    SGLANG_NSA_CP_SHARED_KV = EnvBool(
        "SGLANG_NSA_CP_SHARED_KV",
        False,
        "Turn shared-KV prefill CP on, as `--enable-nsa-prefill-cp-shared-kv` does; for "
        "`sglang.Engine(...)` users, whose keyword arguments cannot carry a flag SGLang does not declare.",
    )
    SGLANG_NSA_CP_SCRATCH_CONTEXTS = EnvInt(
        "SGLANG_NSA_CP_SCRATCH_CONTEXTS",
        1,
        "Cached-prefix capacity of the sharded pool's gather scratch, in full contexts (plus one chunk). "
        "SGLang's default is 8; each context costs KV capacity, and a batch whose cached prefixes exceed "
        "it waits for the next one. At least 1.",
        minimum=1,
    )
    SGLANG_NSA_CP_KERNELS = EnvChoice(
        "SGLANG_NSA_CP_KERNELS",
        "auto",
        ("auto", "triton", "torch"),
        "Kernel implementation: `auto` picks Triton for CUDA tensors and the torch reference "
        "otherwise; `triton` always Triton (failures raise); `torch` always the reference.",
    )
    SGLANG_NSA_CP_PD_SECRET = EnvSecret(
        "SGLANG_NSA_CP_PD_SECRET",
        None,
        "Key of the PD messages (HMAC-SHA256), at least 16 bytes, the same on the decode and every "
        "prefill rank. Without it the flag refuses to start unless SGLANG_NSA_CP_PD_NETWORK_TRUSTED=1.",
    )
    SGLANG_NSA_CP_PD_NETWORK_TRUSTED = EnvBool(
        "SGLANG_NSA_CP_PD_NETWORK_TRUSTED",
        False,
        "Set to 1 to run the flag without SGLANG_NSA_CP_PD_SECRET, once only the PD peers can reach the "
        "prefill's bootstrap and the decode's status ports: PD messages are then not keyed, and anyone who "
        "reaches those ports can forge a room's commit or fail it.",
    )
    SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED = EnvBool(
        "SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED",
        False,
        "Set to 1 once Mooncake's handshake and TCP data ports, which it opens on every interface, "
        "unauthenticated (no setting binds them; MC_MIN_RPC_PORT / MC_MAX_RPC_PORT choose their range), "
        "are reachable only from the PD peers (a firewall or a network namespace). Without it the flag "
        "refuses to start.",
    )
    SGLANG_NSA_CP_TEST_SEED = EnvInt(
        "SGLANG_NSA_CP_TEST_SEED",
        None,
        "Tests only: replay the random inputs of a kernel test run (its failure messages print the seed).",
    )

    def all(self) -> list[EnvVar]:
        return [v for v in vars(type(self)).values() if isinstance(v, EnvVar)]


envs = NsaCpEnvs()


def markdown_table() -> str:
    """The table of variables docs/deploy.md carries."""
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for var in envs.all():
        default = "unset" if var.default is None else f"`{var.unparse(var.default)}`"
        lines.append(f"| `{var.name}` | {var.type_name} | {default} | {var.meaning} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
