"""Prefill side: each CP rank sends the pages it owns of a request, then a manifest.

    rank r of N, shard = KVBuffers(kv_shards, index_shards, page_size)   (local pages)
    sender = OwnedPageSender(shard, rank=r, cp_size=N)
    sender.send(decode_address, request_id, logical_pages)   # req_to_token[req][::ps] // ps

send() = plan (positions k with logical_pages[k] % N == r) -> fetch the decode's destination
pages -> checksum the owned pages -> one batched write of every coalesced run, all layers, kv and
index -> manifest. The steps are public so the SGLang hook can split them across its
bootstrap and transfer threads, and tests can inject faults between them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import zmq

from sglang_nsa_cp.disagg import protocol
from sglang_nsa_cp.disagg.buffers import KVBuffers, check_same_layout
from sglang_nsa_cp.disagg.checksum import page_checksums
from sglang_nsa_cp.disagg.engine import EngineConfig, MooncakeEngine, TransferError
from sglang_nsa_cp.disagg.plan import (
    OwnedPages,
    build_transfer_batch,
    coalesce_runs,
    plan_owned_pages,
)

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
class SenderStats:
    requests: int = 0
    pages: int = 0
    nbytes: int = 0
    transfers: int = 0
    batches: int = 0

    def add(self, result: SendResult) -> None:
        self.requests += 1
        self.pages += result.num_pages
        self.nbytes += result.nbytes
        self.transfers += result.num_transfers
        self.batches += result.num_batches


@dataclass
class DecodePeer:
    """One decode receiver as learned from its welcome message."""

    address: str
    socket: zmq.Socket
    session_id: str
    dst_ptrs: list[int]  # per buffer, KVBuffers.flat() order
    num_pages: int  # pages in the decode pool


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
    ):
        if not isinstance(buffers, KVBuffers):
            raise TypeError(f"buffers must be KVBuffers, got {type(buffers).__name__}")
        if cp_size < 1 or not 0 <= rank < cp_size:
            raise ValueError(f"need 0 <= rank < cp_size, got rank={rank}, cp_size={cp_size}")
        self.buffers, self.rank, self.cp_size, self.timeout_s = buffers, rank, cp_size, timeout_s
        self.engine = engine or MooncakeEngine(engine_config)
        self.engine.register((b.data_ptr, b.nbytes) for b in buffers.flat())
        self.stats = SenderStats()
        self._context = zmq.Context()
        self._peers: dict[str, DecodePeer] = {}

    def send(
        self, decode_address: str, request_id: int | str, logical_pages: Sequence[int]
    ) -> SendResult:
        """Send this rank's owned pages of one request and its manifest; raise on failure.

        logical_pages: the request's logical page ids in position order (all ranks pass the
        same list); decode_address: the receiver's ZMQ endpoint (OwnedPageReceiver.address).
        """
        owned = self.plan(logical_pages)
        peer = self.connect(decode_address)
        # A rank owning none of the pages skips `want` but still reports, so the decode knows
        # it is done.
        dst_pages = []
        if owned.positions:
            dst_pages = self.fetch_destination(peer, request_id, owned.num_pages)
        checksums = self.checksum(owned)
        result = self.write(peer, request_id, owned, dst_pages)
        self.send_manifest(peer, request_id, owned, checksums, result)
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
        return owned

    def connect(self, address: str) -> DecodePeer:
        """Handshake with a decode receiver once; later calls reuse the connection."""
        if address in self._peers:
            return self._peers[address]
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, int(self.timeout_s * 1000))  # flush a last manifest on close
        sock.connect(address)
        hello = {"type": protocol.HELLO, "rank": self.rank, "cp_size": self.cp_size,
                 "layout": self.buffers.layout()}
        try:
            reply = self._ask(sock, hello, protocol.WELCOME, None, f"handshake with {address}",
                              return_reject=True)
            # Checked here too, so a layout mismatch is a ValueError on the prefill side.
            layout = reply.get("layout") if isinstance(reply.get("layout"), dict) else {}
            check_same_layout(self.buffers.layout(), layout, "prefill", "decode")
            if reply["type"] == protocol.REJECT:
                raise TransferError(f"decode at {address} refused the handshake: {reply['reason']}")
            dst_ptrs = list(protocol.int_list_field(reply, "dst_ptrs"))
            if len(dst_ptrs) != len(self.buffers.flat()):
                raise protocol.ProtocolError(f"welcome lists {len(dst_ptrs)} decode buffers")
            peer = DecodePeer(address, sock, str(reply["session_id"]), dst_ptrs,
                              protocol.int_field(reply, "num_pages"))
        except BaseException:
            sock.close(linger=0)
            raise
        self._peers[address] = peer
        return peer

    def fetch_destination(
        self, peer: DecodePeer, request_id: int | str, num_pages: int
    ) -> list[int]:
        """The decode's destination page for every request position (request order)."""
        protocol.check_request_id(request_id)
        want = {"type": protocol.WANT, "request_id": request_id, "rank": self.rank,
                "cp_size": self.cp_size, "num_pages": num_pages}
        reply = self._ask(peer.socket, want, protocol.DEST, request_id,
                          f"destination pages of request {request_id!r}")
        return list(protocol.int_list_field(reply, "dst_pages"))

    def checksum(self, owned: OwnedPages) -> list[int]:
        """checksum.page_checksums of the owned pages, in owned.positions order."""
        return page_checksums(self.buffers, owned.local_pages).tolist()

    def write(
        self, peer: DecodePeer, request_id, owned: OwnedPages, dst_pages: Sequence[int]
    ) -> SendResult:
        """One batched write of the owned pages; on failure tell the decode, then raise."""
        start = time.monotonic()
        if not owned.positions:
            return SendResult(request_id, 0, 0, 0, 0, 0.0)
        self._check_destination(peer, owned, dst_pages)
        dst = [dst_pages[k] for k in owned.positions]
        runs = coalesce_runs(owned.local_pages, dst)
        batch = build_transfer_batch(self.buffers, peer.dst_ptrs, runs)
        try:
            num_batches = self.engine.write(peer.session_id, batch)
        except TransferError as e:
            self._send(peer.socket, {"type": protocol.ABORT, "request_id": request_id,
                                     "rank": self.rank, "reason": str(e)})
            raise
        result = SendResult(request_id, len(owned.positions), batch.nbytes, len(batch),
                            num_batches, time.monotonic() - start)
        self.stats.add(result)
        return result

    def send_manifest(self, peer: DecodePeer, request_id, owned: OwnedPages,
                      checksums: Sequence[int], result: SendResult) -> None:
        manifest = protocol.Manifest(
            request_id=request_id, rank=owned.rank, cp_size=owned.cp_size,
            num_pages=owned.num_pages, positions=owned.positions,
            logical_pages=owned.logical_pages, checksums=tuple(checksums),
            nbytes=result.nbytes, num_transfers=result.num_transfers,
        )
        self._send(peer.socket, manifest.to_message())

    def close(self) -> None:
        for peer in self._peers.values():
            peer.socket.close(linger=1000)  # a last manifest gets a second, a dead peer no more
        self._peers.clear()
        self.engine.unregister(b.data_ptr for b in self.buffers.flat())
        self._context.term()

    def _check_destination(self, peer: DecodePeer, owned: OwnedPages, dst_pages) -> None:
        if len(dst_pages) != owned.num_pages:
            raise ValueError(
                f"decode gave {len(dst_pages)} destination pages for a request of "
                f"{owned.num_pages} pages; it needs one per request page position"
            )
        bad = [q for q in dst_pages if not 0 <= q < peer.num_pages]
        if bad:
            raise ValueError(
                f"destination pages {bad[:8]} outside the decode pool of {peer.num_pages}"
            )

    def _send(self, sock: zmq.Socket, msg: dict) -> None:
        sock.send(protocol.encode(msg))

    def _ask(self, sock: zmq.Socket, msg: dict, reply_type: str, request_id, what: str,
             return_reject: bool = False) -> dict:
        """Send `msg`, wait for the matching reply; replies to older requests are dropped."""
        self._send(sock, msg)
        deadline = time.monotonic() + self.timeout_s
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not sock.poll(left_ms):
                break
            reply = protocol.parse(protocol.decode(sock.recv()), {reply_type, protocol.REJECT})
            if reply.get("request_id") != request_id:
                logger.debug("stale %s of request %r dropped", reply["type"], reply["request_id"])
                continue
            if reply["type"] == protocol.REJECT and not return_reject:
                raise TransferError(f"decode rejected {what}: {reply.get('reason')}")
            return reply
        raise TransferError(f"no answer from the decode for {what} within {self.timeout_s} s")
