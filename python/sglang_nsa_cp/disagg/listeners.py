"""The TCP ports a process listens on, and the environment that binds Mooncake's listeners (issue #32).

SGLang's `MooncakeTransferEngine` calls `TransferEngine.initialize(host, "P2PHANDSHAKE", protocol, dev)`,
which opens two unauthenticated listeners whatever `host` is (`host` is only the address it advertises):

  * the handshake/RPC listener (the port `get_rpc_port()` returns, every protocol), and
  * the TCP data listener (protocol "tcp" only), through which a peer reads and writes registered memory.

Mooncake 0.3.13.post1 (the installed wheel) and its source up to main 3b5a594 have no setting that binds
either one: `findAvailableTcpPort` (transfer_metadata_plugin.cpp:1309-1380) binds INADDR_ANY/IN6ADDR_ANY
and `SocketHandShakePlugin::startDaemon` listens on that socket; `TcpContext`
(tcp_transport/tcp_transport_session_impl.h:769-794) binds asio's dual-stack `tcp::v6()` any address,
or v4 any. So `mooncake_bind_env` refuses every host but a wildcard; test/disagg/test_listeners.py
starts a real engine to keep that claim true.

No sglang, Mooncake or socket import: this module only reads /proc.
"""

from __future__ import annotations

import ipaddress
import os
import sys

_LISTEN = "0A"  # TCP_LISTEN in the `st` column of /proc/net/tcp{,6}

# Each Mooncake listener and the environment variable that binds it; None: Mooncake has none.
MOONCAKE_LISTENERS: dict[str, str | None] = {
    "handshake/RPC listener": None,
    "TCP data listener": None,
}

# Mooncake's settings that sound as if they bind, and what each does instead (why none is above).
NON_BINDING_SETTINGS: dict[str, str] = {
    "MC_TCP_BIND_ADDRESS": "only the address advertised without P2PHANDSHAKE (transfer_engine_impl.cpp:159)",
    "MC_LEGACY_RPC_PORT_BINDING": "the port, from the host name, without P2PHANDSHAKE (transfer_engine_impl.cpp:120)",
    "MC_RDMA_BIND_ADDRESS": "the address of RDMA NIC paths (rdma_transport.cpp:194)",
}


class MooncakeBindError(RuntimeError):
    """Mooncake cannot bind `listeners` to `host`; the caller refuses to start (or names its opt-out)."""

    def __init__(self, host: str, listeners: list[str]):
        self.host = host
        self.listeners = listeners
        others = "; ".join(f"{name} sets {what}" for name, what in NON_BINDING_SETTINGS.items())
        super().__init__(
            f"Mooncake {_mooncake_version()} has no setting that binds its {' or its '.join(listeners)} "
            f"to {host}: they listen on 0.0.0.0 and [::], unauthenticated, so anyone who reaches them can "
            f"read or overwrite KV pages ({others}). Confine the ports with a firewall or a network "
            "namespace; MC_MIN_RPC_PORT and MC_MAX_RPC_PORT choose the range both are taken from"
        )


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket that `pid` holds, IPv4 and IPv6.

    /proc/<pid>/net/tcp lists the whole network namespace, so a row counts only when its inode is
    one of the pid's socket fds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listdir
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as rows:
                lines = rows.readlines()[1:]
        except FileNotFoundError:  # a kernel without IPv6 has no tcp6
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.append((_address(address), int(port, 16)))
    return sorted(found)


def _address(hex_address: str) -> str:
    # The kernel prints each 32-bit word of the network-order address as a host-order integer.
    raw = b"".join(int(hex_address[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:a.b.c.d is reached as a.b.c.d
    return str(mapped or address)


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


def mooncake_bind_env(host: str) -> dict[str, str]:
    """The environment that binds every Mooncake listener to `host`, to set before `initialize()`.

    A wildcard host needs nothing. Raises MooncakeBindError, naming the listeners, when the
    installed Mooncake cannot bind them (every version to date, see MOONCAKE_LISTENERS)."""
    if is_wildcard(host):
        return {}
    unbindable = [listener for listener, setting in MOONCAKE_LISTENERS.items() if setting is None]
    if unbindable:
        raise MooncakeBindError(host, unbindable)
    return {setting: host for setting in MOONCAKE_LISTENERS.values() if setting is not None}


def _mooncake_version() -> str:
    from importlib import metadata

    names = metadata.packages_distributions().get("mooncake", [])
    return next((metadata.version(name) for name in names), "(version unknown)")
