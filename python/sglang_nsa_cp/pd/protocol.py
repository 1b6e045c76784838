"""Messages between prefill senders and the decode receiver: typed, bounded, keyed (ZMQ, msgpack).

The decode side binds one ROUTER socket; each prefill rank connects a DEALER. Every message is two
frames, [MAC, body]: the body one of the msgspec Structs below (msgpack, strict: a field of the
wrong type, a list past its bound or an unknown type is a `ProtocolError`, never a crash), the MAC
`auth.sign(K, direction, body)` with the connection's session key (empty when keying is off).
Per connection, then per use of a request id::

    prefill rank r                                     decode receiver
    hello    {rank, cp_size, client_nonce}      ->
                                                <-     challenge {server_nonce}      (unkeyed)
    auth     {layout}, keyed with K             ->     nothing about the pool before this
                                                <-     welcome {session_id, epoch, layout,
                                                                dst_ptrs, num_pages}
                                                       (or reject {code, reason})
    want     {request_id, nonce, cp_size,       ->     "ready": starts the transfer deadline;
              num_pages, num_owned}                    held until receiver.expect(request, nonce)
                                                <-     dest {request_id, nonce, epoch, dst_pages}
                                                       (empty for a rank owning no page)
    batch_transfer_sync_write: owned pages, every layer, kv + index, straight into dst pages
    manifest {request_id, nonce, claims:        ->     commit when all N manifests cover 0..n-1
              PageClaims with checksums, ...}          exactly once from the owners, sums match
    abort    {request_id, nonce, reason,        ->     instead of a manifest: a write error
              drained}                                 (drained False) or a cancel (True)
                                                <-     cancel {request_id, nonce, reason}: the
                                                       request failed; answer with abort/manifest

`nonce` names one use of a request id: the decode's `expect()` and every rank's `send()` get the
same one (from whoever routes the request: SGLang's bootstrap room plays that role), and every
message of that use echoes it, so nothing of an earlier use of the id is taken for this one.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Optional, Union

import msgspec
from msgspec import Meta, Struct

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.manifest import (
    MAX_REQUEST_PAGES,
    MAX_TEXT,
    Count,
    CpSize,
    Int64,
    NumPages,
    PageClaims,
    Pages,
    Rank,
    cut,
)

VERSION = 3  # 3: the manifest carries the shared PageClaims
MAX_BUFFERS = 4096  # kv + index per layer
TO_DECODE, TO_PREFILL = b"to-decode", b"to-prefill"  # MAC labels of the two directions

RequestId = Union[Int64, Annotated[str, Meta(max_length=256)]]
Nonce = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Nonce16 = Annotated[bytes, Meta(min_length=16, max_length=16)]


class ProtocolError(ValueError):
    """A message that does not follow the protocol: undecodable, wrongly typed, unkeyed or
    mis-keyed. Its text is bounded (MAX_TEXT) so it can be logged as it is."""


class _Msg(Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class Layout(Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: Annotated[int, Meta(ge=1, le=MAX_BUFFERS // 2)]
    page_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    kv_page_bytes: Count
    index_page_bytes: Count


class Hello(_Msg, tag="hello"):
    rank: Rank
    cp_size: CpSize
    client_nonce: Nonce16
    version: int = VERSION


class Challenge(_Msg, tag="challenge"):
    server_nonce: Nonce16


class Auth(_Msg, tag="auth"):
    layout: Layout


class Welcome(_Msg, tag="welcome"):
    session_id: Annotated[str, Meta(max_length=256)]
    epoch: Nonce  # one per receiver instance: a restarted decode has another
    layout: Layout
    dst_ptrs: Annotated[tuple[Count, ...], Meta(max_length=MAX_BUFFERS)]
    num_pages: Count


class Want(_Msg, tag="want"):
    request_id: RequestId
    nonce: Nonce
    cp_size: CpSize
    num_pages: NumPages
    num_owned: Count


class Dest(_Msg, tag="dest"):
    request_id: RequestId
    nonce: Nonce
    epoch: Nonce
    dst_pages: Pages


class Manifest(_Msg, tag="manifest"):
    """What one prefill rank says it wrote for one use of a request: its claims (with a checksum
    per page, `checksum.page_checksums` over all layers and both kinds) and what it cost."""

    request_id: RequestId
    nonce: Nonce
    claims: PageClaims
    nbytes: Count
    num_transfers: Count


class Abort(_Msg, tag="abort"):
    request_id: RequestId
    nonce: Nonce
    reason: Text
    drained: bool  # False: a write may still be landing in the destination pages


class Cancel(_Msg, tag="cancel"):
    request_id: RequestId
    nonce: Nonce
    reason: Text


class Reject(_Msg, tag="reject"):
    code: Annotated[str, Meta(max_length=32)]  # REJECT_CODES
    reason: Text
    request_id: Optional[RequestId] = None
    nonce: Optional[Nonce] = None
    layout: Optional[Layout] = None


REJECT_CODES = ("version", "auth", "layout", "unknown-peer", "request", "busy")
_TO_DECODE = msgspec.msgpack.Decoder(Union[Hello, Auth, Want, Manifest, Abort])
_TO_PREFILL = msgspec.msgpack.Decoder(Union[Challenge, Welcome, Dest, Reject, Cancel])
_ENCODER = msgspec.msgpack.Encoder()


def new_nonce() -> int:
    """A fresh nonce for one use of a request id (or for a receiver's epoch)."""
    return secrets.randbits(62) + 1


def check_request_id(request_id) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        raise TypeError(f"request_id must be an int or str, got {type(request_id).__name__}")
    if isinstance(request_id, int) and not -(1 << 63) <= request_id < 1 << 63:
        raise ValueError(f"request_id {request_id} does not fit in int64")
    if isinstance(request_id, str) and len(request_id) > 256:
        raise ValueError(f"request_id is {len(request_id)} characters long; at most 256")


def check_nonce(nonce) -> None:
    if isinstance(nonce, bool) or not isinstance(nonce, int) or not 1 <= nonce < 1 << 63:
        raise ValueError(f"nonce must be an int in [1, 2**63), got {nonce!r:.40}; use protocol.new_nonce()")


def max_message_bytes(num_pages: int) -> int:
    """ZMQ_MAXMSGSIZE for a side whose requests have at most `num_pages` pages: a manifest is
    3 ints per page (at most 9 msgpack bytes each) plus a few hundred bytes; a larger frame
    closes the connection that sent it before anything parses it."""
    return 4096 + 32 * min(num_pages, MAX_REQUEST_PAGES)


def pack(key: bytes | None, label: bytes, msg: _Msg) -> list[bytes]:
    body = _ENCODER.encode(msg)
    return [auth.sign(key, label, body), body]


def unpack(frames: list, key: bytes | None, label: bytes, keyed: bool = True):
    """The message of [MAC, body] `frames`; ProtocolError (bounded text) when anything is off.
    keyed=False skips the MAC check (hello and challenge, which come before any key)."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (MAC, body), got {len(frames)}")
    mac, body = frames
    # The MAC first: an unauthenticated body is never parsed past its frame count.
    if keyed and (problem := auth.verify(key, label, body, mac)) is not None:
        raise ProtocolError(problem)
    decoder = _TO_DECODE if label == TO_DECODE else _TO_PREFILL
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(cut(f"undecodable message ({len(body)} B): {e}", 300)) from None
