"""Decode side: register the pool, serve handshakes and transfers, commit or fail each request.

    receiver = OwnedPageReceiver(KVBuffers(kv_pool, index_pool, page_size))
    nonce = protocol.new_nonce()                    # one per use of a request id, given to prefill too
    dst_pages = receiver.expect(request_id, num_pages, cp_size, nonce=nonce)
    receiver.poll(request_id)  -> Pending | Committed(dst_pages) | Failed(reason, report)
    receiver.release(request_id)                    # frees a committed one, cancels a pending one

Threads: one owns the ZMQ ROUTER socket (ZMQ sockets are single-threaded): it authenticates
connections (protocol.py), feeds the typed messages of authenticated ranks to the bookkeeping
(transfers.py), sends what that queues, expires deadlines and probes the ranks that fenced pages
wait for. A second verifies checksums, off the lock, so a 2048-page verify does not stall anyone's
poll(). Public methods only touch shared state under the lock. A frame that does not decode, is
not keyed right, or comes from a connection that did not authenticate is dropped with a logged,
bounded reason; nothing a peer sends stops either thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import msgspec
import zmq

from sglang_nsa_cp.disagg import auth
from sglang_nsa_cp.disagg.buffers import KVBuffers, check_same_layout
from sglang_nsa_cp.disagg.checksum import page_checksums
from sglang_nsa_cp.disagg.manifest import MAX_CP_SIZE, MAX_REQUEST_PAGES
from sglang_nsa_cp.layout.ownership import OwnerClassedAllocator
from sglang_nsa_cp.pd import protocol
from sglang_nsa_cp.pd.engine import EngineConfig, MooncakeEngine
from sglang_nsa_cp.pd.protocol import TO_DECODE, TO_PREFILL, Auth, Challenge, Hello, Reject, Want, Welcome
from sglang_nsa_cp.pd.status import Committed, Failed, Pending, ReceiverStats
from sglang_nsa_cp.pd.transfers import TransferTable

logger = logging.getLogger(__name__)

HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2000, 20000  # libzmq answers pings even mid-write


@dataclass(eq=False)
class _Peer:
    rank: int
    cp_size: int
    key: bytes | None
    since: float
    authenticated: bool = False


class OwnedPageReceiver:
    def __init__(
        self,
        buffers: KVBuffers,
        *,
        bind: str = "tcp://127.0.0.1:*",
        engine: MooncakeEngine | None = None,
        engine_config: EngineConfig = EngineConfig(),
        allocator: OwnerClassedAllocator | None = None,
        timeout_s: float = 30.0,
        ready_timeout_s: float = 300.0,
        secret=auth.FROM_ENV,
        max_early: int = 1024,
        max_peers: int = 1024,
        handshake_timeout_s: float = 10.0,
        probe_interval_s: float = 0.5,
        poll_interval_s: float = 0.01,
    ):
        """timeout_s: a transfer's deadline, from the first rank's "ready" (its want);
        ready_timeout_s: how long expect() waits for that. Pages of a failed request are never
        reused on a timer: see transfers.py (fences)."""
        if not isinstance(buffers, KVBuffers):
            raise TypeError(f"buffers must be KVBuffers, got {type(buffers).__name__}")
        self.buffers = buffers
        self.timeout_s = timeout_s
        self._secret = auth.pd_secret(secret)
        self.allocator = allocator or OwnerClassedAllocator(buffers.num_pages, cp_size=1)
        if self.allocator.cp_size != 1 or self.allocator.num_pages > buffers.num_pages:
            raise ValueError(
                f"the decode allocator hands out {self.allocator.num_pages} pages in {self.allocator.cp_size} owner "
                f"classes; the decode pool has {buffers.num_pages} pages and no CP: use "
                "OwnerClassedAllocator(num_pages, cp_size=1) with num_pages <= the pool's"
            )
        self.engine = engine or MooncakeEngine(engine_config)
        self.engine.register((b.data_ptr, b.nbytes) for b in buffers.flat())
        self.stats = ReceiverStats()
        self.epoch = protocol.new_nonce()
        self._table = TransferTable(
            self.allocator,
            self.stats,
            timeout_s=timeout_s,
            ready_timeout_s=ready_timeout_s,
            max_early=max_early,
            epoch=self.epoch,
        )
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()  # least recently heard first
        self._max_peers, self._handshake_timeout_s = max_peers, handshake_timeout_s
        self._probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread_error: BaseException | None = None
        self._drop_log: deque = deque(maxlen=20)  # times of the last logged drops
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._verify_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._context = zmq.Context()
        bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(bind, bound), name="owned-page-receiver", daemon=True)
        self._verifier = threading.Thread(target=self._verify_loop, name="owned-page-verifier", daemon=True)
        self._thread.start()
        self._verifier.start()
        if not bound.wait(10) or self._thread_error is not None:
            self.close()
            raise RuntimeError(f"receiver could not bind {bind}") from self._thread_error

    # ---- public API (any thread) ------------------------------------------------------------

    def expect(self, request_id: int | str, num_pages: int, cp_size: int, *, nonce: int) -> list[int]:
        """Allocate decode pages for one use of a request id and serve its prefill ranks; `nonce`
        is this use's (every rank's send() gets the same). Returns the destination page of each
        request position."""
        protocol.check_request_id(request_id)
        protocol.check_nonce(nonce)
        if not 1 <= num_pages <= MAX_REQUEST_PAGES or not 1 <= cp_size <= MAX_CP_SIZE:
            raise ValueError(
                f"need 1 <= num_pages <= {MAX_REQUEST_PAGES} and 1 <= cp_size <= "
                f"{MAX_CP_SIZE}, got {num_pages}, {cp_size}"
            )
        with self._lock:
            self._raise_if_dead()
            return self._table.expect(request_id, nonce, num_pages, cp_size, time.monotonic())

    def poll(self, request_id: int | str) -> Pending | Committed | Failed:
        with self._lock:
            self._raise_if_dead()
            return self._table.status(request_id)

    def wait(self, request_id: int | str, timeout_s: float | None = None) -> Pending | Committed | Failed:
        """poll() until the request is no longer Pending (or `timeout_s` passes)."""
        deadline = time.monotonic() + (self.timeout_s + 5 if timeout_s is None else timeout_s)
        while isinstance(status := self.poll(request_id), Pending) and time.monotonic() < deadline:
            time.sleep(self._poll_ms / 1000)
        return status

    def release(self, request_id: int | str) -> None:
        """Forget a finished request, freeing a committed one's pages; cancel a pending one (its
        pages wait until every rank given them has reported or is dead)."""
        with self._lock:
            self._table.release(request_id, time.monotonic())

    @property
    def num_fenced_pages(self) -> int:
        """Pages of failed requests still waiting for a rank to report or to be declared dead."""
        with self._lock:
            return self._table.num_fenced_pages

    def close(self) -> None:
        self._stop.set()
        self._verify_queue.put(None)
        for thread in (self._thread, self._verifier):
            thread.join(timeout=10)
            if thread.is_alive():
                logger.error("%s did not stop within 10 s", thread.name)
        self.engine.unregister(b.data_ptr for b in self.buffers.flat())

    # ---- the serving thread -----------------------------------------------------------------

    def _serve(self, bind: str, bound: threading.Event) -> None:
        sock = self._context.socket(zmq.ROUTER)
        try:
            # Before bind: options are copied to each connection when it is accepted.
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unreachable peer -> EHOSTUNREACH (probes)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.max_message_bytes(self.buffers.num_pages))
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.bind(bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # what senders connect to
            bound.set()
            next_probe = 0.0
            while not self._stop.is_set():
                if sock.poll(self._poll_ms):
                    for _ in range(64):  # bounded, so deadlines are checked under a stream of messages
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        with self._lock:
                            self._handle(frames[0], frames[1:], time.monotonic())
                now = time.monotonic()
                if self._tick(sock, now, probe=now >= next_probe):
                    next_probe = now + self._probe_interval_s
        except BaseException as e:  # a bug, never a peer's message: surfaced by the next public call
            self._thread_error = e
            bound.set()
            raise
        finally:
            sock.close()
            self._context.term()

    def _tick(self, sock: zmq.Socket, now: float, probe: bool) -> bool:
        """Deadlines, then what the bookkeeping queued: replies, verifies and (when `probe`) the
        cancels that find out whether the ranks fenced pages wait for are still connected.
        Sends happen outside the lock. Returns whether it probed."""
        with self._lock:
            self._table.expire(now)
            self._expire_peers(now)
            probes = self._table.probes() if probe else []
            outbox = [(ident, self._pack(ident, msg)) for ident, msg in self._table.outbox]
            self._table.outbox.clear()
            for use in self._table.to_verify:
                self._verify_queue.put(use)
            self._table.to_verify.clear()
        for identity, frames in outbox:
            self._send(sock, identity, frames)
        dead = [(key, rank) for ident, msg, key, rank in probes if not self._send(sock, ident, self._pack(ident, msg))]
        if dead:
            with self._lock:
                for key, rank in dead:
                    self._table.declare_dead(key, rank)
        return bool(probes)

    def _verify_loop(self) -> None:
        try:
            while (use := self._verify_queue.get()) is not None:
                # Every rank reported, so nothing writes these pages now; one host copy of n ints.
                landed = page_checksums(self.buffers, use.dst_pages).tolist()
                with self._lock:
                    self._table.finish_verify(use, landed)
        except BaseException as e:
            self._thread_error = e
            raise

    def _raise_if_dead(self) -> None:
        if self._thread_error is not None:
            raise RuntimeError("a receiver thread died") from self._thread_error

    def _handle(self, identity: bytes, frames: list, now: float) -> None:
        try:
            msg = protocol.unpack(frames, None, TO_DECODE, keyed=False)
        except protocol.ProtocolError as e:
            return self._drop(identity, str(e))
        if isinstance(msg, Hello):
            return self._hello(identity, msg, now)
        peer = self._peers.get(identity)
        if peer is None:
            self._table.outbox.append(
                (
                    identity,
                    Reject(
                        "unknown-peer",
                        "this decode does not know the connection (it restarted, or forgot it); say hello again",
                    ),
                )
            )
            return None
        self._peers.move_to_end(identity)
        if (problem := auth.verify(peer.key, TO_DECODE, frames[1], frames[0])) is not None:
            if isinstance(msg, Auth):
                self._table.outbox.append((identity, Reject("auth", problem)))
            return self._drop(identity, f"{type(msg).__name__.lower()} from rank {peer.rank}: {problem}")
        if isinstance(msg, Auth):
            return self._auth(identity, peer, msg)
        if not peer.authenticated:
            return self._drop(identity, f"{type(msg).__name__.lower()} before the handshake finished")
        if isinstance(msg, Want):
            self._table.on_want(identity, peer.rank, msg, now)
        else:
            self._table.on_report(identity, peer.rank, msg, now)
        return None

    def _hello(self, identity: bytes, hello: Hello, now: float) -> None:
        if hello.version != protocol.VERSION:
            reason = f"prefill speaks protocol version {hello.version}, this decode {protocol.VERSION}"
            self._table.outbox.append((identity, Reject("version", reason)))
            return
        if hello.rank >= hello.cp_size:
            return self._drop(identity, f"hello from rank {hello.rank} of a CP group of {hello.cp_size}")
        self._peers.pop(identity, None)
        while len(self._peers) >= self._max_peers:
            self._peers.popitem(last=False)  # least recently heard; it will be told to say hello again
        server_nonce = os.urandom(16)
        key = auth.session_key(self._secret, hello.client_nonce, server_nonce, hello.rank, hello.cp_size)
        self._peers[identity] = _Peer(hello.rank, hello.cp_size, key, now)
        self._table.outbox.append((identity, Challenge(server_nonce)))

    def _auth(self, identity: bytes, peer: _Peer, msg: Auth) -> None:
        layout = self.buffers.layout()
        try:
            check_same_layout(msgspec.structs.asdict(msg.layout), layout, "prefill", "decode")
        except ValueError as e:
            logger.warning("refusing prefill rank %d: %s", peer.rank, e)
            self._table.outbox.append((identity, Reject("layout", str(e), layout=protocol.Layout(**layout))))
            return
        peer.authenticated = True
        self._table.outbox.append(
            (
                identity,
                Welcome(
                    self.engine.session_id,
                    self.epoch,
                    protocol.Layout(**layout),
                    tuple(b.data_ptr for b in self.buffers.flat()),
                    self.buffers.num_pages,
                ),
            )
        )

    def _expire_peers(self, now: float) -> None:
        stale = [i for i, p in self._peers.items() if not p.authenticated and now - p.since > self._handshake_timeout_s]
        for identity in stale:
            del self._peers[identity]

    def _pack(self, identity: bytes, msg) -> list[bytes]:
        # Keyed once the connection proved it holds the secret (its auth checked out); challenges
        # and the rejects of a handshake that failed go unkeyed.
        peer = self._peers.get(identity)
        keyed = peer is not None and (
            peer.authenticated or isinstance(msg, Welcome) or (isinstance(msg, Reject) and msg.code == "layout")
        )
        return protocol.pack(peer.key if keyed else None, TO_PREFILL, msg)

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[bytes]) -> bool:
        """False when the peer's connection is gone (ROUTER_MANDATORY)."""
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: alive but not reading (a stalled rank's resent cancels)
            logger.debug("not sent to connection %s: its send queue is full", identity.hex()[:16])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def _drop(self, identity: bytes, reason: str) -> None:
        self.stats.dropped += 1
        now = time.monotonic()
        if len(self._drop_log) < self._drop_log.maxlen or now - self._drop_log[0] > 10:
            self._drop_log.append(now)
            logger.warning("dropping a message from connection %s: %s", identity.hex()[:16], protocol.cut(reason, 300))
