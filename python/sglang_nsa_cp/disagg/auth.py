"""The shared secret of a PD deployment and the keyed MACs built on it (HMAC-SHA256).

The SGLang plugin (sglang_ext/disaggregation/) reads one secret from the environment,
`SGLANG_NSA_CP_PD_SECRET` (declared in `envs.py`, read here only, through `pd_secret`): the
manifest frame of every Success status carries HMAC(secret, room | prefill rank | manifest), and a
decode with the secret commits only rooms whose every Success carries a valid one; every other
status of a shared-KV rank carries a status signature (`sglang_ext/disaggregation/status_guard.py`),
without which a decode with the secret drops it.

Without a secret nothing is keyed (the MAC frame is empty; the plugin's PD managers say so once
per process at start-up). A secret on one side only fails the request with a message naming the
variable.
"""

from __future__ import annotations

import hashlib
import hmac

from sglang_nsa_cp.envs import MIN_SECRET_BYTES, envs

MAC_BYTES = 32  # HMAC-SHA256
FROM_ENV = "from-env"  # default of every `secret=` argument: read SGLANG_NSA_CP_PD_SECRET
SGLANG_NSA_CP_PD_SECRET = envs.SGLANG_NSA_CP_PD_SECRET


def pd_secret(secret=FROM_ENV) -> bytes | None:
    """Resolve a `secret=` argument: FROM_ENV reads the environment; None turns keying off."""
    if secret == FROM_ENV:
        secret = SGLANG_NSA_CP_PD_SECRET.get()
    elif secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__  # never the value
        raise ValueError(f"secret must be None or bytes, at least {MIN_SECRET_BYTES} of them; got {got}")
    return secret


def sign(key: bytes | None, label: bytes, body: bytes) -> bytes:
    """The MAC frame of `body`: HMAC(key, label | body), or b"" when keying is off. `label` keeps
    one direction's or one room's messages from being replayed as another's."""
    if key is None:
        return b""
    return hmac.new(key, label + b"|" + body, hashlib.sha256).digest()


def verify(key: bytes | None, label: bytes, body: bytes, mac: bytes) -> str | None:
    """None if `mac` is right for `body`, else why not (for a log line or a failure reason)."""
    if key is None:
        if mac:
            return (
                f"the peer signs its messages but this side has no secret; set "
                f"{SGLANG_NSA_CP_PD_SECRET.name} on both sides or on neither"
            )
        return None
    if not mac:
        return (
            f"the peer does not sign its messages but this side has a secret; set "
            f"{SGLANG_NSA_CP_PD_SECRET.name} on both sides or on neither"
        )
    if not hmac.compare_digest(mac, sign(key, label, body)):
        return f"bad MAC: the peer's {SGLANG_NSA_CP_PD_SECRET.name} differs, or the message was altered"
    return None
