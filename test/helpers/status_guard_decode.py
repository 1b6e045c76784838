"""A decode manager of the plugin (or SGLang's own) in process, with room ROOM in flight, SGLang's
real receiver and decode thread on it, and the messages its status socket takes: what the
status-guard tests (`test_status_guard.py`) and `benchmark/bench_status_guard.py` drive."""

from __future__ import annotations

import struct
import threading
import time
from types import SimpleNamespace

import numpy as np

SECRET = b"status-guard-test-secret-0123456789"
ROOM, AUX_INDEX = 7, 3  # the room in flight and the aux slot this decode gave it
NOW, EARLIER = b"n" * 16, b"e" * 16  # this use's nonce, an earlier use's
ABORT_GENERATION = 5  # the abort the decode holds ROOM for (SGLang's deferred release)
ITEM_LENS, SLOTS = (8, 4), 16  # the in-process decode's two aux buffers: 16 slots of 8 and of 4 bytes
NEIGHBOR_BYTES = 256  # what lies after them in memory


def aux_message(room, buffer, index, data, declared=None):
    return [b"AUX_DATA", b"%d" % room, b"%d" % buffer, index, struct.pack(">I", len(data) if declared is None else declared), data]  # fmt: skip


def status_message(room, status, rank, *extra):
    return [b"%d" % room, b"%d" % status, b"%d" % rank, *extra]


def rank_claims(rank, pages=4):
    from sglang_nsa_cp.disagg import PageClaims
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RankClaims

    positions = tuple(range(rank, pages, 2))
    claims = PageClaims(rank, 2, pages, positions, tuple(10 + k for k in positions))
    return RankClaims(kv=claims, index=claims)


class AuxBuffers:
    """Two aux buffers of SLOTS slots (ITEM_LENS bytes each) and, after them in the same memory,
    a neighbor region standing for whatever tensor the allocator put next."""

    def __init__(self):
        sizes = [SLOTS * n for n in ITEM_LENS]
        self.backing = np.zeros(sum(sizes) + NEIGHBOR_BYTES, dtype=np.uint8)
        base = self.backing.ctypes.data
        self.kv_args = SimpleNamespace(
            aux_data_ptrs=[base, base + sizes[0]], aux_data_lens=sizes, aux_item_lens=list(ITEM_LENS),
            kv_data_lens=[64 * 1024], kv_item_lens=[1024],
        )  # fmt: skip
        self.neighbor = self.backing[sum(sizes) :]

    def slot(self, buffer, index):
        start = self.kv_args.aux_data_ptrs[buffer] - self.backing.ctypes.data + index * ITEM_LENS[buffer]
        return self.backing[start : start + ITEM_LENS[buffer]]


def decode_manager(secret=None, staging=False, stock=False, aux=None):
    """A decode manager of the plugin (SGLang's, `stock`) with the state SGLang's decode thread and
    the guard read, and room ROOM in flight: aux slot AUX_INDEX, 4 pages from 2 CP ranks, nonce NOW."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import NoncesByRoom, OwnedPageKVManager
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import RoomExpectation
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog

    aux = aux or AuxBuffers()
    mgr = object.__new__(MooncakeKVManager if stock else OwnedPageKVManager)
    mgr.__dict__.update(
        disaggregation_mode=DisaggregationMode.DECODE, kv_args=aux.kv_args, kv_status_msg_tag=None,
        request_status={ROOM: KVPoll.WaitingForInput}, prefill_response_tracker={ROOM: set()},
        required_prefill_response_num_table={ROOM: 2}, failure_records={}, failure_lock=threading.Lock(),
        enable_staging=staging, _staging_handler=object() if staging else None, defer_decode_allocation=False,
        deferred_bootstrap=None, enable_deferred_decode_kv_release=False,
        _deferred_abort_ack_tracker={ROOM: SimpleNamespace(generation=ABORT_GENERATION, prefill_ranks=set())},
        _deferred_ack_targets={}, _deferred_ack_poisoned_rooms=set(), _staging_outstanding={},
        owned_pages_ledger=None, outgoing_manifests={}, manifest_inbox={}, room_manifests={},
        room_expectations={ROOM: RoomExpectation(4, 4, 2)}, room_nonces={ROOM: NOW}, room_aux_indices={ROOM: AUX_INDEX},
        destination_nonces=NoncesByRoom(), pd_secret=secret, dropped_messages=DropLog(),
    )  # fmt: skip
    return mgr


class DecodeThread:
    """SGLang's `MooncakeKVManager.start_decode_thread` on `mgr`, reading a PULL socket on
    127.0.0.1 (its poll-based receive: role switching on, so it can stop); `push` sends to it.
    With `frame_limit`, the socket is built as a plugin decode builds its status socket (SGLang's
    `get_zmq_socket_on_host` through `limit_status_frames`: frames up to `frame_limit` bytes,
    STATUS_RCVHWM messages per connection); else a plain PULL socket."""

    def __init__(self, mgr, frame_limit: int | None = None):
        import zmq
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.utils.network import get_zmq_socket_on_host

        from sglang_nsa_cp.sglang_ext.disaggregation.common import conn as hooks

        self.ctx, self.mgr = zmq.Context(), mgr
        if frame_limit is None:
            pull = self.ctx.socket(zmq.PULL)
            self.port = pull.bind_to_random_port("tcp://127.0.0.1")
        else:
            with hooks.limited_status_frames(frame_limit):
                self.port, pull = hooks.limit_status_frames(
                    get_zmq_socket_on_host, self.ctx, zmq.PULL, host="127.0.0.1"
                )
        mgr.__dict__.update(server_socket=pull, _stopped=False, _worker_threads=[],
                            server_args=SimpleNamespace(enable_pd_role_switch=True))  # fmt: skip
        mgr._start_heartbeat_checker_thread = lambda: threading.Thread(target=lambda: None)
        MooncakeKVManager.start_decode_thread(mgr)
        self.thread = mgr._worker_threads[0]
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")

    def push(self, messages):
        for msg in messages:
            self.sock.send_multipart(msg)

    def close(self):
        self.mgr._stopped = True
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.mgr.server_socket.close(linger=0)
        self.ctx.term()


def wait_for(done, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


PREFILL = "127.0.0.1:8998"  # the bootstrap address the receivers name (nothing is sent to it)


def idle_manager(secret=None, aux=None):
    """`decode_manager` with no room in flight, plus the state SGLang's receiver touches."""
    from collections import defaultdict

    mgr = decode_manager(secret=secret, aux=aux)
    for table in ("request_status", "prefill_response_tracker", "required_prefill_response_num_table",
                  "room_expectations", "room_nonces", "room_aux_indices"):  # fmt: skip
        getattr(mgr, table).clear()
    mgr.__dict__.update(addr_to_rooms_tracker=defaultdict(set), connection_pool={}, connection_lock=threading.Lock(),
                        waiting_timeout=300)  # fmt: skip
    return mgr


def make_receiver(mgr, room=ROOM, metadata=True, owner_sharded=True):
    """SGLang's receiver of the plugin for `room` on `mgr` (its real `__init__`), targeting 2 prefill
    CP ranks (unique ranks 0 and 1) as SGLang's `init` would, of a prefill that advertises
    owner-sharded pages (`owner_sharded`; else a replicated CP prefill); with `metadata`, its real
    `send_metadata` for 4 KV and 4 index-K pages at aux slot AUX_INDEX (no prefill to send to)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import StateType

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import OwnedPageKVReceiver

    receiver = OwnedPageKVReceiver(mgr, PREFILL, room)
    receiver.__dict__.update(
        prefill_info=SimpleNamespace(target_tp_rank=0, target_tp_ranks=[0], target_cp_ranks=[0, 1], target_pp_ranks=[0],
                                     pp_size=1, attn_cp_size=2, enable_kv_cache_sharding=owner_sharded),
        required_dst_info_num=1, bootstrap_infos=[],
    )  # fmt: skip
    mgr.required_prefill_response_num_table[room] = 2
    if metadata:
        mgr.kv_args.state_types = [StateType.DSA]
        receiver.send_metadata(np.arange(4, dtype=np.int32), AUX_INDEX, [np.arange(4, dtype=np.int32)])
    return receiver


def success_message(rank, room=ROOM, secret=SECRET, use=None, claims_rank=None):
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import encode_manifest

    claims = rank_claims(rank if claims_rank is None else claims_rank)
    return status_message(room, 4, rank, b"", encode_manifest(claims, room, rank, secret, uses=[use or NOW]))


def metadata_message(room, session, nonce, destinations=1, pages=1):
    """A decode's request metadata for `room`, built by SGLang's `build_receiver_metadata_message`
    through the plugin's (which appends the use nonce), as decode session `session`."""
    import numpy as np

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import OwnedPageKVManager

    decode = object.__new__(OwnedPageKVManager)
    decode.__dict__.update(local_ip="127.0.0.1", rank_port=17001, room_nonces={room: nonce}, get_session_id=lambda: session)  # fmt: skip
    return decode.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=destinations, kv_indices=np.arange(pages, dtype=np.int32),
        aux_index=0, state_indices=None, decode_prefix_len=None, is_dummy=False,
    )  # fmt: skip


def prefill_manager(stock=False):
    """A shared-KV prefill manager of the plugin (SGLang's, `stock`) with the state SGLang's
    prefill bootstrap thread reads, room ROOM bootstrapping (its sender registered it)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from sglang_nsa_cp.sglang_ext.disaggregation.mooncake.conn import NoncesByRoom, OwnedPageKVManager
    from sglang_nsa_cp.sglang_ext.disaggregation.owned_pages import OwnedPageLedger
    from sglang_nsa_cp.sglang_ext.disaggregation.status_guard import DropLog

    mgr = object.__new__(MooncakeKVManager if stock else OwnedPageKVManager)
    mgr.__dict__.update(
        disaggregation_mode=DisaggregationMode.PREFILL, request_status={ROOM: KVPoll.Bootstrapping},
        transfer_infos={}, req_to_decode_prefix_len={}, is_mla_backend=True, enable_staging=False,
        deferred_bootstrap=None, enable_deferred_decode_kv_release=False, _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(), _staging_outstanding={}, owned_pages_ledger=OwnedPageLedger(0, 2),
        dropped_messages=DropLog(where="the prefill's bootstrap socket"),
    )  # fmt: skip
    mgr.destination_nonces = NoncesByRoom(live=mgr._has_live_sender) if not stock else None
    return mgr


class PrefillThread(DecodeThread):
    """SGLang's `MooncakeKVManager.start_prefill_thread` (its bootstrap thread) on `mgr`, reading a
    PULL socket on 127.0.0.1; `push` sends to it."""

    def __init__(self, mgr):
        import zmq
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        self.ctx, self.mgr = zmq.Context(), mgr
        pull = self.ctx.socket(zmq.PULL)
        self.port = pull.bind_to_random_port("tcp://127.0.0.1")
        mgr.__dict__.update(server_socket=pull, _stopped=False, _worker_threads=[],
                            server_args=SimpleNamespace(enable_pd_role_switch=True))  # fmt: skip
        MooncakeKVManager.start_prefill_thread(mgr)
        self.thread = mgr._worker_threads[0]
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")
