"""The decode's status socket with a frame-size limit and a bounded receive queue. Mirrors
`sglang/srt/disaggregation/common/conn.py`.

Target: `get_zmq_socket_on_host` (AROUND), as `CommonKVManager.__init__` calls it to bind the
manager's status socket. While a decode manager of the plugin is being built
(`limited_status_frames`, `../mooncake/conn.py`), that socket alone (never SGLang's shared context)
gets, after it is created and before it binds (libzmq copies options to a listener at bind time,
so setting them later does nothing):
- ZMQ_MAXMSGSIZE: a larger frame closes the connection that sent it before anyone parses it;
- ZMQ_RCVHWM = STATUS_RCVHWM instead of SGLang's 0 (unlimited): each connection queues at most
  that many whole messages here; a sender past it waits. A prefill's status socket (SGLang's
  PUSH, ZMQ's default SNDHWM of 1,000) drops a status after waiting 30 s, so the limit is set
  far above what a genuine decode falls behind by (64 held a prefill's statuses back: measured in
  docs/disagg.md, "Size limits", `benchmark/bench_status_guard.py`'s stalled decode).
What neither bounds: the frames of one message (ZMQ has no such limit), so one message is
received whole, at up to MAXMSGSIZE a frame, before the guard sees it (docs/disagg.md, "Size
limits"). Every other call passes through.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import zmq

STATUS_RCVHWM = 1 << 16  # whole messages queued per connection on the decode's status socket
_STATUS_FRAME_LIMIT = threading.local()  # MAXMSGSIZE for the status socket SGLang is creating


@contextmanager
def limited_status_frames(limit: int):
    """Within this block, sockets this thread's `get_zmq_socket_on_host` calls bind refuse frames
    over `limit` bytes and queue at most STATUS_RCVHWM messages per connection."""
    _STATUS_FRAME_LIMIT.bytes = limit
    try:
        yield
    finally:
        _STATUS_FRAME_LIMIT.bytes = None


class _ShortQueueSocket(zmq.Socket):
    """A socket whose RCVHWM never exceeds STATUS_RCVHWM (SGLang's `config_socket` sets 0,
    unlimited, between creating and binding it)."""

    def setsockopt(self, option, value):
        if option == zmq.RCVHWM and not 0 < value <= STATUS_RCVHWM:
            value = STATUS_RCVHWM
        return super().setsockopt(option, value)


class _ShortQueueContext:
    """The manager's context, whose `.socket` (all `get_zmq_socket_on_host` calls on it) makes a
    `_ShortQueueSocket` with ZMQ_MAXMSGSIZE set on that socket alone (never on the shared context,
    whose other sockets, made by any thread meanwhile, keep SGLang's options); everything else is
    the context's."""

    def __init__(self, context, max_msg_bytes: int):
        self._context = context
        self._max_msg_bytes = max_msg_bytes

    def __getattr__(self, name):
        return getattr(self._context, name)

    def socket(self, socket_type, **kwargs):
        kwargs.setdefault("socket_class", _ShortQueueSocket)
        sock = self._context.socket(socket_type, **kwargs)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
        sock.setsockopt(zmq.RCVHWM, STATUS_RCVHWM)
        return sock


def limit_status_frames(original, context, socket_type, *args, **kwargs):
    """AROUND `get_zmq_socket_on_host`."""
    limit = getattr(_STATUS_FRAME_LIMIT, "bytes", None)
    if limit is None:
        return original(context, socket_type, *args, **kwargs)
    return original(_ShortQueueContext(context, limit), socket_type, *args, **kwargs)
