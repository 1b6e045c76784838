"""Prefill side: each CP rank sends the pages it owns of a request, then a manifest.

    rank r of N, shard = KVBuffers(kv_shards, index_shards, page_size)   (local pages)
    sender = OwnedPageSender(shard, rank=r, cp_size=N)
    sender.send(decode_address, request_id, logical_pages)   # req_to_token[req][::ps] // ps

send() = plan (positions k with logical_pages[k] % N == r) -> connect (the keyed handshake,
once per decode, again after a write error or a decode restart) -> fetch the decode's destination
pages -> checksum the owned pages -> one batched write of every coalesced run, all layers, kv and
index -> manifest. The steps are public so tests can inject faults between them. One sender may
be shared by threads: every public method holds its lock, so their requests take turns (the
socket is ZMQ's, single-threaded).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import msgspec
import zmq

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.buffers import KVBuffers, check_same_layout
from sglang_nsa_cp.disagg.checksum import page_checksums
from sglang_nsa_cp.disagg.manifest import MAX_CP_SIZE, MAX_REQUEST_PAGES
from sglang_nsa_cp.disagg.plan import OwnedPages, coalesce_runs, plan_owned_pages
from sglang_nsa_cp.pd import protocol
from sglang_nsa_cp.pd.engine import EngineConfig, MooncakeEngine, TransferError, build_transfer_batch
from sglang_nsa_cp.pd.protocol import (
    TO_DECODE,
    TO_PREFILL,
    Abort,
    Auth,
    Cancel,
    Challenge,
    Dest,
    Hello,
    Manifest,
    Reject,
    Want,
    Welcome,
)
from sglang_nsa_cp.pd.status import RankStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendResult:
    request_id: int | str
    num_pages: int  # owned pages sent
    nbytes: int
    num_transfers: int  # batch entries (coalesced runs x buffers)
    num_batches: int  # batch_transfer_sync_write calls
    elapsed_s: float


@dataclass
class SenderStats(RankStats):
    """What one sender wrote, over all its requests (the receiver counts the same per rank)."""

    batches: int = 0  # batch_transfer_sync_write calls

    def add(self, result: SendResult) -> None:
        self.requests += 1
        self.pages += result.num_pages
        self.nbytes += result.nbytes
        self.transfers += result.num_transfers
        self.batches += result.num_batches


@dataclass(eq=False)
class DecodePeer:
    """One decode receiver: the connection, and what its last welcome said."""

    address: str
    socket: zmq.Socket
    key: bytes | None = None  # session key of the current handshake
    session_id: str = ""
    epoch: int = 0
    dst_ptrs: list[int] = field(default_factory=list)  # per buffer, KVBuffers.flat() order
    num_pages: int = 0  # pages in the decode pool
    fresh: bool = False  # False: handshake (again) before the next request


class _Rehandshake(Exception):
    """The decode forgot this connection (it restarted) or answered from another epoch."""


_UNKEYED_REJECTS = ("version", "auth", "unknown-peer")  # sent before, or without, a session key
_MAX_CANCELLED = 4096


class OwnedPageSender:
    def __init__(
        self,
        buffers: KVBuffers,
        rank: int,
        cp_size: int,
        *,
        engine: MooncakeEngine | None = None,
        engine_config: EngineConfig = EngineConfig(),
        timeout_s: float = 30.0,
        secret=auth.FROM_ENV,
    ):
        if not isinstance(buffers, KVBuffers):
            raise TypeError(f"buffers must be KVBuffers, got {type(buffers).__name__}")
        if not 1 <= cp_size <= MAX_CP_SIZE or not 0 <= rank < cp_size:
            raise ValueError(f"need 0 <= rank < cp_size <= {MAX_CP_SIZE}, got rank={rank}, cp_size={cp_size}")
        self.buffers, self.rank, self.cp_size, self.timeout_s = buffers, rank, cp_size, timeout_s
        self._secret = auth.pd_secret(secret)
        self.engine = engine or MooncakeEngine(engine_config)
        self.engine.register((b.data_ptr, b.nbytes) for b in buffers.flat())
        self.stats = SenderStats()
        self._lock = threading.RLock()
        self._context = zmq.Context()
        self._peers: dict[str, DecodePeer] = {}
        self._cancelled: OrderedDict[tuple, str] = OrderedDict()  # (request_id, nonce) -> reason
        self._closed = False

    def send(
        self, decode_address: str, request_id: int | str, logical_pages: Sequence[int], *, nonce: int
    ) -> SendResult:
        """Send this rank's owned pages of one use of a request and its manifest; raise on failure.

        logical_pages: the request's logical page ids in position order (all ranks pass the
        same list); nonce: this use's, as the decode's expect() got it; decode_address: the
        receiver's ZMQ endpoint (OwnedPageReceiver.address).
        """
        with self._lock:
            owned = self.plan(logical_pages)
            peer = self.connect(decode_address)
            dst_pages = self.fetch_destination(peer, request_id, nonce, owned)
            checksums = self.checksum(owned)
            result = self.write(peer, request_id, nonce, owned, dst_pages)
            self.send_manifest(peer, request_id, nonce, owned, checksums, result)
            return result

    def plan(self, logical_pages: Sequence[int]) -> OwnedPages:
        owned = plan_owned_pages(logical_pages, self.rank, self.cp_size)
        limit = self.buffers.num_pages
        beyond = [p for p, q in zip(owned.logical_pages, owned.local_pages) if q >= limit]
        if beyond:
            raise ValueError(
                f"rank {self.rank}/{self.cp_size}: logical pages {beyond[:8]} map past this "
                f"shard's {self.buffers.num_pages} local pages (local page = page // cp_size)"
            )
        if not 1 <= owned.num_pages <= MAX_REQUEST_PAGES:
            raise ValueError(f"a request has 1 to {MAX_REQUEST_PAGES} pages, got {owned.num_pages}")
        return owned

    def connect(self, address: str) -> DecodePeer:
        """The decode receiver at `address`, handshaken: once, and again after a write error, a
        timeout or a decode restart (the decode's new session and pointers)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this OwnedPageSender is closed")
            peer = self._peers.get(address)
            if peer is None:
                sock = self._context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, int(self.timeout_s * 1000))  # flush a last manifest on close
                sock.setsockopt(zmq.MAXMSGSIZE, protocol.max_message_bytes(MAX_REQUEST_PAGES))
                sock.connect(address)
                peer = self._peers[address] = DecodePeer(address, sock)
            if not peer.fresh:
                self._handshake(peer)
            return peer

    def fetch_destination(self, peer: DecodePeer, request_id: int | str, nonce: int, owned: OwnedPages) -> list[int]:
        """The decode's destination page for every request position (request order); empty for a
        rank that owns none of the request's pages. Sending the want tells the decode this
        rank is ready."""
        protocol.check_request_id(request_id)
        protocol.check_nonce(nonce)
        want = Want(request_id, nonce, self.cp_size, owned.num_pages, len(owned.positions))
        what = f"destination pages of request {request_id!r}"
        with self._lock:
            for attempt in range(2):
                try:
                    dest = self._ask(peer, want, (Dest, Reject), (request_id, nonce), what)
                    if dest.epoch != peer.epoch:
                        raise _Rehandshake(f"the decode answered from epoch {dest.epoch}, not {peer.epoch}")
                    return list(dest.dst_pages)
                except _Rehandshake as e:
                    logger.info("rank %d: handshake with %s again: %s", self.rank, peer.address, e)
                    peer.fresh = False
                    if attempt:
                        raise TransferError(f"decode at {peer.address} keeps forgetting this rank: {e}") from None
                    self.connect(peer.address)
                except TransferError as e:
                    # Destinations that come after this rank gave up must not wait for its manifest.
                    self._abort(peer, request_id, nonce, f"rank {self.rank} gave up: {e}", drained=True)
                    raise
            raise AssertionError("unreachable")

    def checksum(self, owned: OwnedPages) -> list[int]:
        """checksum.page_checksums of the owned pages, in owned.positions order."""
        return page_checksums(self.buffers, owned.local_pages).tolist()

    def write(
        self, peer: DecodePeer, request_id, nonce: int, owned: OwnedPages, dst_pages: Sequence[int]
    ) -> SendResult:
        """One batched write of the owned pages; on failure tell the decode, then raise."""
        start = time.monotonic()
        if not owned.positions:
            return SendResult(request_id, 0, 0, 0, 0, 0.0)
        with self._lock:
            try:
                self._check_destination(peer, owned, dst_pages)
            except ValueError as e:
                self._abort(peer, request_id, nonce, f"rank {self.rank} wrote nothing: {e}", drained=True)
                raise
            self._absorb(peer)
            if (reason := self._cancelled.get((request_id, nonce))) is not None:
                self._abort(peer, request_id, nonce, "cancelled before any byte was written", drained=True)
                raise TransferError(f"the decode cancelled request {request_id!r}: {reason}")
            dst = [dst_pages[k] for k in owned.positions]
            batch = build_transfer_batch(self.buffers, peer.dst_ptrs, coalesce_runs(owned.local_pages, dst))
            try:
                num_batches = self.engine.write(peer.session_id, batch)
            except TransferError as e:
                # A failed sync write may still have slices in flight: not drained. The next
                # request handshakes again (the decode may have restarted: new session, pointers).
                self._abort(peer, request_id, nonce, str(e), drained=False)
                peer.fresh = False
                logger.error(
                    "rank %d: request %r failed mid-write; the decode keeps its pages fenced until "
                    "this sender closes (nothing shows the write drained)",
                    self.rank,
                    request_id,
                )
                raise
            result = SendResult(
                request_id, len(owned.positions), batch.nbytes, len(batch), num_batches, time.monotonic() - start
            )
            self.stats.add(result)
            return result

    def send_manifest(
        self, peer: DecodePeer, request_id, nonce: int, owned: OwnedPages, checksums: Sequence[int], result: SendResult
    ) -> None:
        manifest = Manifest(
            request_id=request_id,
            nonce=nonce,
            claims=owned.claims(checksums),
            nbytes=result.nbytes,
            num_transfers=result.num_transfers,
        )
        with self._lock:
            self._send(peer, manifest)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self._peers.values():
                peer.socket.close(linger=1000)  # a last manifest gets a second, a dead peer no more
            self._peers.clear()
            self.engine.unregister(b.data_ptr for b in self.buffers.flat())
            self._context.term()

    # ---- helpers ------------------------------------------------------------------------------

    def _handshake(self, peer: DecodePeer) -> None:
        what = f"handshake with {peer.address}"
        client_nonce = os.urandom(16)
        peer.key = None
        try:
            challenge = self._ask(peer, Hello(self.rank, self.cp_size, client_nonce), (Challenge, Reject), None, what)
            peer.key = auth.session_key(self._secret, client_nonce, challenge.server_nonce, self.rank, self.cp_size)
            layout = self.buffers.layout()
            welcome = self._ask(peer, Auth(protocol.Layout(**layout)), (Welcome, Reject), None, what)
        except _Rehandshake as e:
            raise TransferError(f"decode at {peer.address} refused the handshake: {e}") from None
        # Checked here too, so a layout mismatch is a ValueError on the prefill side.
        check_same_layout(layout, msgspec.structs.asdict(welcome.layout), "prefill", "decode")
        if len(welcome.dst_ptrs) != len(self.buffers.flat()):
            raise TransferError(
                f"decode at {peer.address} lists {len(welcome.dst_ptrs)} buffers, this "
                f"rank has {len(self.buffers.flat())}"
            )
        peer.session_id, peer.epoch = welcome.session_id, welcome.epoch
        peer.dst_ptrs, peer.num_pages, peer.fresh = list(welcome.dst_ptrs), welcome.num_pages, True

    def _check_destination(self, peer: DecodePeer, owned: OwnedPages, dst_pages) -> None:
        if len(dst_pages) != owned.num_pages:
            raise ValueError(
                f"decode gave {len(dst_pages)} destination pages for a request of "
                f"{owned.num_pages} pages; it needs one per request page position"
            )
        bad = [q for q in dst_pages if not 0 <= q < peer.num_pages]
        if bad:
            raise ValueError(f"destination pages {bad[:8]} outside the decode pool of {peer.num_pages}")

    def _abort(self, peer: DecodePeer, request_id, nonce: int, reason: str, drained: bool) -> None:
        if peer.session_id:  # a handshake finished once: keyed with that session's key
            self._send(peer, Abort(request_id, nonce, protocol.cut(reason), drained=drained))

    def _send(self, peer: DecodePeer, msg) -> None:
        peer.socket.send_multipart(protocol.pack(peer.key, TO_DECODE, msg))

    def _receive(self, peer: DecodePeer, frames: list):
        """A reply from the decode, or None (logged) when it is not a valid one."""
        try:
            msg = protocol.unpack(frames, None, TO_PREFILL, keyed=False)
            unkeyed = isinstance(msg, Challenge) or (isinstance(msg, Reject) and msg.code in _UNKEYED_REJECTS)
            if (
                not (unkeyed and not frames[0])
                and (problem := auth.verify(peer.key, TO_PREFILL, frames[1], frames[0])) is not None
            ):
                raise protocol.ProtocolError(problem)
        except protocol.ProtocolError as e:
            logger.warning("rank %d: dropping a message from %s: %s", self.rank, peer.address, e)
            return None
        if isinstance(msg, Cancel):
            self._cancelled[(msg.request_id, msg.nonce)] = msg.reason
            while len(self._cancelled) > _MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            return None
        return msg

    def _absorb(self, peer: DecodePeer) -> None:
        """Read what already arrived (cancels) without waiting."""
        while peer.socket.poll(0):
            self._receive(peer, peer.socket.recv_multipart())

    def _ask(self, peer: DecodePeer, msg, reply_types: tuple, use: tuple | None, what: str):
        """Send `msg`, wait for the reply of `use` (request_id, nonce; None in the handshake);
        replies to older requests are dropped. A reject raises."""
        self._send(peer, msg)
        deadline = time.monotonic() + self.timeout_s
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not peer.socket.poll(left_ms):
                break
            reply = self._receive(peer, peer.socket.recv_multipart())
            if reply is None or not isinstance(reply, reply_types):
                continue
            if isinstance(reply, Reject) and reply.code == "unknown-peer":
                raise _Rehandshake(reply.reason)
            if use is None and isinstance(reply, Reject) and reply.request_id is not None:
                continue  # a late reject of some request, not of this handshake
            if use is not None and (reply.request_id, reply.nonce) != use:
                logger.debug("stale %s of request %r dropped", type(reply).__name__, reply.request_id)
                continue
            if isinstance(reply, Reject):
                if reply.code == "layout" and reply.layout is not None:
                    check_same_layout(self.buffers.layout(), msgspec.structs.asdict(reply.layout), "prefill", "decode")
                raise TransferError(f"decode rejected {what}: {reply.reason}")
            return reply
        peer.fresh = False
        raise TransferError(f"no answer from the decode for {what} within {self.timeout_s} s")
