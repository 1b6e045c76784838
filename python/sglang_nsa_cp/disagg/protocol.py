"""Bootstrap and manifest messages between prefill senders and the decode receiver (ZMQ, JSON).

The decode side binds one ROUTER socket; each prefill rank connects a DEALER. Per connection,
then per request::

    prefill rank r                                decode receiver
    hello    {rank, cp_size, layout}        ->
                                            <-    welcome {session_id, layout, dst_ptrs, num_pages}
                                                  (or reject {reason}: layouts differ)
    want     {request_id, rank, cp_size,    ->    held until receiver.expect(request_id, ...)
              num_pages}                    <-    dest {request_id, dst_pages}  (request order)
              (skipped by a rank that owns none of the request's pages)
                                                  (or reject {request_id, reason})
    batch_transfer_sync_write: owned pages, every layer, kv + index, straight into dst pages
    manifest {request_id, rank, cp_size,    ->    commit when all N manifests cover 0..n-1
              num_pages, positions,               exactly once, each from its owner, and the
              logical_pages, checksums,           checksums match what landed
              nbytes, num_transfers}
    abort    {request_id, rank, reason}     ->    (instead of a manifest, if the write failed)

JSON keeps an int request id an int (SGLang's bootstrap_room) and a str a str.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

HELLO, WELCOME, WANT, DEST, MANIFEST, ABORT, REJECT = (
    "hello",
    "welcome",
    "want",
    "dest",
    "manifest",
    "abort",
    "reject",
)


class ProtocolError(ValueError):
    """A message that does not follow the protocol (wrong type or missing field)."""


def check_request_id(request_id: Any) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        raise TypeError(f"request_id must be an int or str, got {type(request_id).__name__}")


def int_list_field(msg: dict, key: str) -> tuple[int, ...]:
    value = msg.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ProtocolError(f"field {key!r} must be a list of ints")
    return tuple(value)


def int_field(msg: dict, key: str) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class Manifest:
    """What one prefill rank says it wrote for one request.

    positions[i] is a request page position; logical_pages[i] the prefill's logical page id there
    (so the receiver can check owner == logical_pages[i] % cp_size == rank); checksums[i] the
    checksum.page_checksums value of that page over all layers and both kinds.
    """

    request_id: int | str
    rank: int
    cp_size: int
    num_pages: int  # pages in the whole request, as this rank sees it
    positions: tuple[int, ...]
    logical_pages: tuple[int, ...]
    checksums: tuple[int, ...]
    nbytes: int
    num_transfers: int

    def to_message(self) -> dict:
        msg = asdict(self)
        for key in ("positions", "logical_pages", "checksums"):
            msg[key] = list(msg[key])
        return {"type": MANIFEST, **msg}

    @classmethod
    def from_message(cls, msg: dict) -> "Manifest":
        parse(msg, {MANIFEST})
        manifest = cls(
            request_id=msg["request_id"],
            rank=int_field(msg, "rank"),
            cp_size=int_field(msg, "cp_size"),
            num_pages=int_field(msg, "num_pages"),
            positions=int_list_field(msg, "positions"),
            logical_pages=int_list_field(msg, "logical_pages"),
            checksums=int_list_field(msg, "checksums"),
            nbytes=int_field(msg, "nbytes"),
            num_transfers=int_field(msg, "num_transfers"),
        )
        lengths = {len(manifest.positions), len(manifest.logical_pages), len(manifest.checksums)}
        if len(lengths) != 1:
            raise ProtocolError(
                f"manifest of rank {manifest.rank}: positions, logical_pages and checksums have "
                f"different lengths ({len(manifest.positions)}, {len(manifest.logical_pages)}, "
                f"{len(manifest.checksums)})"
            )
        return manifest


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"not a JSON message: {e}") from None


def parse(msg: Any, expected: set[str]) -> dict:
    """Check that `msg` is a dict of one of the `expected` types with a valid request_id."""
    if not isinstance(msg, dict) or msg.get("type") not in expected:
        got = msg.get("type") if isinstance(msg, dict) else type(msg).__name__
        raise ProtocolError(f"expected a message of type {sorted(expected)}, got {got!r}")
    if msg["type"] in (WANT, DEST, MANIFEST, ABORT):
        try:
            check_request_id(msg.get("request_id"))
        except TypeError as e:
            raise ProtocolError(f"{msg['type']}: {e}") from None
    return msg
