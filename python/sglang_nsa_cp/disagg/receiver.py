"""Decode side: register the pool, serve bootstrap and manifests, commit or fail each request.

    receiver = OwnedPageReceiver(KVBuffers(kv_pool, index_pool, page_size))
    dst_pages = receiver.expect(request_id, num_pages, cp_size)   # allocates, serves prefill
    ...
    receiver.poll(request_id)  -> Pending | Committed(dst_pages) | Failed(reason, report)
    receiver.release(request_id)                                   # frees a committed request

One background thread owns the ZMQ ROUTER socket (ZMQ sockets are single-threaded): it answers
hello and want messages, collects manifests, applies commit.py's rule once all N are in, and
fails requests past their deadline. Public methods only touch shared state under the lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from sglang_nsa_cp.disagg import protocol
from sglang_nsa_cp.disagg.allocator import PageAllocator
from sglang_nsa_cp.disagg.buffers import KVBuffers, check_same_layout
from sglang_nsa_cp.disagg.checksum import page_checksums
from sglang_nsa_cp.disagg.commit import CoverageReport, check_coverage, find_corrupt
from sglang_nsa_cp.disagg.engine import EngineConfig, MooncakeEngine
from sglang_nsa_cp.disagg.status import Committed, Failed, Pending, RankStats, ReceiverStats

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: int | str
    num_pages: int
    cp_size: int
    dst_pages: list[int]
    deadline: float
    status: Pending | Committed | Failed
    manifests: dict = field(default_factory=dict)  # rank -> Manifest
    fetched_by: set = field(default_factory=set)  # ranks that were given dst_pages
    aborted_by: set = field(default_factory=set)


class OwnedPageReceiver:
    def __init__(
        self,
        buffers: KVBuffers,
        *,
        bind: str = "tcp://127.0.0.1:*",
        engine: MooncakeEngine | None = None,
        engine_config: EngineConfig = EngineConfig(),
        allocator: PageAllocator | None = None,
        timeout_s: float = 30.0,
        quarantine_s: float | None = None,
        poll_interval_s: float = 0.01,
    ):
        if not isinstance(buffers, KVBuffers):
            raise TypeError(f"buffers must be KVBuffers, got {type(buffers).__name__}")
        self.buffers = buffers
        self.timeout_s = timeout_s
        # Pages a silent rank may still be writing into wait this long before reuse.
        self.quarantine_s = timeout_s if quarantine_s is None else quarantine_s
        self.allocator = allocator or PageAllocator(buffers.num_pages)
        self.engine = engine or MooncakeEngine(engine_config)
        self.engine.register((b.data_ptr, b.nbytes) for b in buffers.flat())
        self.stats = ReceiverStats()
        self._requests: dict[int | str, _Request] = {}
        self._waiting: list[tuple[bytes, dict, float]] = []  # wants that came before expect()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread_error: BaseException | None = None
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._context = zmq.Context()
        bound = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(bind, bound), name="owned-page-receiver", daemon=True
        )
        self._thread.start()
        if not bound.wait(10) or self._thread_error is not None:
            raise RuntimeError(f"receiver could not bind {bind}") from self._thread_error

    # ---- public API (any thread) ------------------------------------------------------------

    def expect(self, request_id: int | str, num_pages: int, cp_size: int) -> list[int]:
        """Allocate decode pages for a request and start serving its prefill ranks."""
        protocol.check_request_id(request_id)
        if num_pages < 1 or cp_size < 1:
            raise ValueError(f"need num_pages >= 1 and cp_size >= 1, got {num_pages}, {cp_size}")
        with self._lock:
            self._raise_if_dead()
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already expected; release it first")
            dst_pages = self.allocator.alloc(num_pages)
            self._requests[request_id] = _Request(
                request_id, num_pages, cp_size, dst_pages, time.monotonic() + self.timeout_s,
                Pending(request_id, tuple(range(cp_size))),
            )
        return list(dst_pages)

    def poll(self, request_id: int | str) -> Pending | Committed | Failed:
        with self._lock:
            self._raise_if_dead()
            if request_id not in self._requests:
                raise KeyError(f"unknown request {request_id!r}: never expected, or released")
            request = self._requests[request_id]
            if isinstance(request.status, Pending):
                request.status = Pending(request_id, tuple(
                    r for r in range(request.cp_size) if r not in request.manifests))
            return request.status

    def wait(
        self, request_id: int | str, timeout_s: float | None = None
    ) -> Pending | Committed | Failed:
        """poll() until the request is no longer Pending (or `timeout_s` passes)."""
        deadline = time.monotonic() + (self.timeout_s + 5 if timeout_s is None else timeout_s)
        while isinstance(status := self.poll(request_id), Pending) and time.monotonic() < deadline:
            time.sleep(self._poll_ms / 1000)
        return status

    def release(self, request_id: int | str) -> None:
        """Forget a finished request, freeing a committed one's pages; cancel a pending one."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise KeyError(f"unknown request {request_id!r}: never expected, or released")
            if isinstance(request.status, Pending):
                self._fail(request, "cancelled by the decode side")
            elif isinstance(request.status, Committed):
                self.allocator.free(request.dst_pages)
            del self._requests[request_id]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.engine.unregister(b.data_ptr for b in self.buffers.flat())

    # ---- the serving thread -----------------------------------------------------------------

    def _serve(self, bind: str, bound: threading.Event) -> None:
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # what senders connect to
            bound.set()
            while not self._stop.is_set():
                replies = []
                if sock.poll(self._poll_ms):
                    # Bounded drain, so deadlines are checked even under a stream of messages.
                    for _ in range(64):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        with self._lock:
                            replies += self._handle(frames[0], frames[-1])
                with self._lock:
                    replies += self._answer_waiting()
                    self._expire()
                for reply in replies:
                    sock.send_multipart(reply)
        except BaseException as e:  # surfaced by the next public call, never swallowed
            self._thread_error = e
            bound.set()
            raise
        finally:
            sock.close()
            self._context.term()

    def _raise_if_dead(self) -> None:
        if self._thread_error is not None:
            raise RuntimeError("the receiver thread died") from self._thread_error

    def _handle(self, identity: bytes, payload: bytes) -> list[list[bytes]]:
        try:
            msg = protocol.parse(protocol.decode(payload), {
                protocol.HELLO, protocol.WANT, protocol.MANIFEST, protocol.ABORT})
        except protocol.ProtocolError as e:
            logger.warning("dropping a malformed message: %s", e)
            return []
        kind = msg["type"]
        if kind == protocol.HELLO:
            return [self._welcome(identity, msg)]
        if kind == protocol.WANT:
            self._waiting.append((identity, msg, time.monotonic()))
            return self._answer_waiting()
        request = self._requests.get(msg.get("request_id"))
        if request is None or not isinstance(request.status, Pending):
            logger.info("ignoring %s for request %r: not pending", kind, msg.get("request_id"))
            return []
        if kind == protocol.ABORT:
            rank = msg.get("rank")
            if isinstance(rank, int):
                request.aborted_by.add(rank)
            self._fail(request, f"rank {rank!r} aborted: {msg.get('reason')}")
        else:
            self._take_manifest(request, msg)
        return []

    def _welcome(self, identity: bytes, msg: dict) -> list[bytes]:
        try:
            layout = msg.get("layout") if isinstance(msg.get("layout"), dict) else {}
            check_same_layout(layout, self.buffers.layout(), "prefill", "decode")
        except ValueError as e:
            logger.warning("refusing prefill rank %s: %s", msg.get("rank"), e)
            return [identity, protocol.encode({"type": protocol.REJECT, "request_id": None,
                                               "reason": str(e), "layout": self.buffers.layout()})]
        return [identity, protocol.encode({
            "type": protocol.WELCOME, "request_id": None, "session_id": self.engine.session_id,
            "layout": self.buffers.layout(), "num_pages": self.buffers.num_pages,
            "dst_ptrs": [b.data_ptr for b in self.buffers.flat()],
        })]

    def _answer_waiting(self) -> list[list[bytes]]:
        replies, still_waiting = [], []
        for identity, msg, since in self._waiting:
            request = self._requests.get(msg.get("request_id"))
            if request is None:
                if time.monotonic() - since < self.timeout_s:
                    still_waiting.append((identity, msg, since))
                else:
                    replies.append(self._reject(identity, msg, "the decode never expected it"))
            elif not isinstance(request.status, Pending):
                replies.append(self._reject(identity, msg, _status_text(request.status)))
            elif (problem := self._check_want(request, msg)) is not None:
                self._fail(request, problem)
                replies.append(self._reject(identity, msg, problem))
            else:
                request.fetched_by.add(msg["rank"])
                replies.append([identity, protocol.encode({
                    "type": protocol.DEST, "request_id": request.request_id,
                    "dst_pages": request.dst_pages})])
        self._waiting = still_waiting
        return replies

    def _check_want(self, request: _Request, msg: dict) -> str | None:
        rank, cp_size, num_pages = (msg.get(k) for k in ("rank", "cp_size", "num_pages"))
        if cp_size != request.cp_size or num_pages != request.num_pages:
            return (f"rank {rank} asked for a request of {num_pages} pages from a CP group of "
                    f"{cp_size}; the decode expected {request.num_pages} pages from "
                    f"{request.cp_size}")
        if not isinstance(rank, int) or not 0 <= rank < request.cp_size:
            return f"rank {rank!r} is not in a CP group of {request.cp_size}"
        return None

    def _take_manifest(self, request: _Request, msg: dict) -> None:
        try:
            manifest = protocol.Manifest.from_message(msg)
        except protocol.ProtocolError as e:
            self._fail(request, f"malformed manifest: {e}")
            return
        if manifest.cp_size != request.cp_size or manifest.num_pages != request.num_pages:
            self._fail(request, f"rank {manifest.rank} reports a request of {manifest.num_pages} "
                       f"pages from a CP group of {manifest.cp_size}; the decode expected "
                       f"{request.num_pages} pages from {request.cp_size}")
        elif not 0 <= manifest.rank < request.cp_size:
            last = request.cp_size - 1
            self._fail(request, f"manifest from rank {manifest.rank}, outside ranks 0..{last}")
        elif manifest.rank in request.manifests:
            self._fail(request, f"rank {manifest.rank} sent two manifests")
        else:
            request.manifests[manifest.rank] = manifest
            if len(request.manifests) == request.cp_size:
                self._decide(request)

    def _decide(self, request: _Request) -> None:
        report = check_coverage(request.num_pages, request.cp_size, request.manifests)
        # Recompute over what landed, on the pool's device; one host copy of n ints.
        landed = page_checksums(self.buffers, request.dst_pages).tolist()
        report = dataclasses.replace(report, corrupt=find_corrupt(request.manifests, landed))
        if not report.ok:
            self._fail(request, report.describe(), report)
            return
        request.status = Committed(request.request_id, tuple(request.dst_pages))
        self.stats.committed += 1
        for rank, manifest in request.manifests.items():
            stats = self.stats.per_rank.setdefault(rank, RankStats())
            stats.requests += 1
            stats.pages += len(manifest.positions)
            stats.nbytes += manifest.nbytes
            stats.transfers += manifest.num_transfers

    def _expire(self) -> None:
        now = time.monotonic()
        for request in self._requests.values():
            if isinstance(request.status, Pending) and now >= request.deadline:
                report = check_coverage(request.num_pages, request.cp_size, request.manifests)
                reason = f"timed out after {self.timeout_s} s: {report.describe()}"
                self._fail(request, reason, report)

    def _fail(self, request: _Request, reason: str, report=CoverageReport()) -> None:
        request.status = Failed(request.request_id, reason, report)
        self.stats.failed += 1
        # A rank that got the destinations and has not reported may still be writing into them.
        in_flight = request.fetched_by - set(request.manifests) - request.aborted_by
        self.allocator.free(request.dst_pages, hold_s=self.quarantine_s if in_flight else 0.0)
        logger.warning("request %r failed: %s", request.request_id, reason)

    def _reject(self, identity: bytes, msg: dict, reason: str) -> list[bytes]:
        return [identity, protocol.encode({"type": protocol.REJECT,
                                           "request_id": msg.get("request_id"), "reason": reason})]


def _status_text(status) -> str:
    if isinstance(status, Failed):
        return f"the request already failed: {status.reason}"
    return "the request is already committed"
