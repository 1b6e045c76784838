"""The decode's status socket with a frame-size limit. Mirrors
`sglang/srt/disaggregation/common/conn.py`.

Target: `get_zmq_socket_on_host` (AROUND), as `CommonKVManager.__init__` calls it to bind the
manager's status socket. While a decode manager of the plugin is being built
(`limited_status_frames`, `../mooncake/conn.py`), that socket gets ZMQ_MAXMSGSIZE before it binds
(libzmq copies options to a listener at bind time, so setting it later does nothing): a larger
frame closes the connection that sent it before anyone parses it. Every other call passes through.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_STATUS_FRAME_LIMIT = threading.local()  # MAXMSGSIZE for the status socket SGLang is creating


@contextmanager
def limited_status_frames(limit: int):
    """Within this block, sockets this thread's `get_zmq_socket_on_host` calls bind refuse frames
    over `limit` bytes."""
    _STATUS_FRAME_LIMIT.bytes = limit
    try:
        yield
    finally:
        _STATUS_FRAME_LIMIT.bytes = None


def limit_status_frames(original, context, socket_type, *args, **kwargs):
    """AROUND `get_zmq_socket_on_host`."""
    limit = getattr(_STATUS_FRAME_LIMIT, "bytes", None)
    if limit is None:
        return original(context, socket_type, *args, **kwargs)
    import zmq

    context.setsockopt(zmq.MAXMSGSIZE, limit)  # the default of sockets this context makes next
    try:
        return original(context, socket_type, *args, **kwargs)
    finally:
        context.sockopts.pop(zmq.MAXMSGSIZE, None)
