"""A thin wrapper over mooncake.engine.TransferEngine: initialize, register, batched write; and
the batch of (src, dst, length) entries one request's owned pages become.

Tests and CPU CI use protocol "tcp" with the "P2PHANDSHAKE" metadata mode (no metadata server:
a peer's session id "<host>:<rpc_port>" is enough to reach it). Production uses "rdma" with the
NIC names in `device_name`, the same call SGLang's MooncakeTransferEngine makes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from sglang_nsa_cp.disagg.buffers import KVBuffers

logger = logging.getLogger(__name__)
_warned_listening = False


class TransferError(RuntimeError):
    """A Mooncake transfer (or the handshake around it) failed."""


@dataclass(frozen=True)
class EngineConfig:
    hostname: str = "127.0.0.1"  # address peers use to reach this process
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"  # "rdma" on GPU nodes
    device_name: str = ""  # RDMA NICs, e.g. "mlx5_0,mlx5_1"; "" lets Mooncake choose
    # Split batched writes into at most this many entries (0: one batch). Mooncake's TCP transport
    # takes about 2048 transfers in flight per peer by default: past that batch_transfer_sync_write
    # returns -1 (measured with mooncake-transfer-engine-non-cuda: one batch of 2049, or two
    # concurrent ones of 2048; MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=16384 lifts it). A 4096-page
    # request with rotating owners needs 8192 entries per rank; 1024 leaves room for a second sender.
    max_batch_entries: int = 1024


@dataclass(frozen=True)
class TransferBatch:
    """Arguments of TransferEngine.batch_transfer_sync_write: parallel lists of entries."""

    src_ptrs: list[int]
    dst_ptrs: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)


def build_transfer_batch(
    src: KVBuffers,
    dst_ptrs: Sequence[int],
    runs: Sequence[tuple[int, int, int]],
) -> TransferBatch:
    """One entry per (buffer, run), buffers in KVBuffers.flat() order.

    dst_ptrs: the decode pool's data pointer per buffer, in the same flat order.
    """
    flat = src.flat()
    if len(dst_ptrs) != len(flat):
        raise ValueError(f"{len(dst_ptrs)} destination buffers for {len(flat)} source buffers")
    batch = TransferBatch([], [], [])
    for buf, dst_ptr in zip(flat, dst_ptrs):
        step = buf.page_bytes
        for src_page, dst_page, count in runs:
            batch.src_ptrs.append(buf.data_ptr + src_page * step)
            batch.dst_ptrs.append(dst_ptr + dst_page * step)
            batch.lengths.append(count * step)
    return batch


class MooncakeEngine:
    """One TransferEngine per process; a region must be registered before it is read or written."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(
                f"mooncake.engine is not importable ({e}); install mooncake-transfer-engine "
                "(GPU) or mooncake-transfer-engine-non-cuda (CPU; also apt-get install libibverbs1)"
            ) from e
        self.config = config
        self._engine = TransferEngine()
        rc = self._engine.initialize(config.hostname, config.metadata_server, config.protocol, config.device_name)
        if rc != 0:
            raise TransferError(f"TransferEngine.initialize{config} returned {rc}")
        self.session_id = f"{config.hostname}:{self._engine.get_rpc_port()}"
        self._registered: set[int] = set()
        _warn_listening(config.hostname, self._engine.get_rpc_port())

    def register(self, regions: Iterable[tuple[int, int]]) -> None:
        """Register (ptr, nbytes) regions not registered yet."""
        for ptr, nbytes in regions:
            if ptr in self._registered:
                continue
            rc = self._engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(f"register_memory(0x{ptr:x}, {nbytes}) returned {rc}")
            self._registered.add(ptr)

    def unregister(self, ptrs: Iterable[int]) -> None:
        for ptr in ptrs:
            if ptr in self._registered:
                self._engine.unregister_memory(ptr)
                self._registered.discard(ptr)

    def write(self, session_id: str, batch: TransferBatch) -> int:
        """Write every entry of `batch` to the peer; returns how many batched calls it took."""
        step = self.config.max_batch_entries or max(1, len(batch))
        calls = 0
        for start in range(0, len(batch), step):
            end = start + step
            rc = self._engine.batch_transfer_sync_write(
                session_id,
                batch.src_ptrs[start:end],
                batch.dst_ptrs[start:end],
                batch.lengths[start:end],
            )
            calls += 1
            if rc != 0:
                raise TransferError(
                    f"batch_transfer_sync_write to {session_id} returned {rc} "
                    f"(entries {start}..{min(end, len(batch)) - 1} of {len(batch)})"
                )
        return calls


def _warn_listening(hostname: str, rpc_port: int) -> None:
    # Measured with mooncake-transfer-engine-non-cuda: hostname 127.0.0.1 (and MC_TCP_BIND_ADDRESS)
    # still leave both listeners on 0.0.0.0. Nothing here can narrow them; say so once.
    global _warned_listening
    if _warned_listening:
        return
    _warned_listening = True
    logger.warning(
        "Mooncake's TransferEngine listens on all interfaces whatever its hostname (%s here): its "
        "handshake port %d and its TCP data port accept connections from any host that can reach "
        "this one, and a peer that knows a registered buffer's address can write into it; keep "
        "these ports behind a firewall (docs/disagg.md, threat model)",
        hostname,
        rpc_port,
    )
