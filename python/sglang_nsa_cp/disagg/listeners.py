"""Mooncake's listeners, which no setting binds to an interface.

SGLang's `MooncakeTransferEngine` calls `TransferEngine.initialize(host, "P2PHANDSHAKE", protocol,
dev)`, which opens two unauthenticated listeners whatever `host` is (`host` is only the address it
advertises): the handshake/RPC listener (every protocol) and the TCP data listener (protocol
"tcp"), through which a peer reads and writes registered memory, KV pages included.

Mooncake 0.3.13.post1 (the CPU wheel) and its source up to main 3b5a594 have no setting that
binds either one: `findAvailableTcpPort` (transfer_metadata_plugin.cpp:1309-1380) binds
INADDR_ANY / IN6ADDR_ANY and `SocketHandShakePlugin::startDaemon` listens on that socket;
`TcpContext` (tcp_transport/tcp_transport_session_impl.h:769-794) binds asio's dual-stack any
address. Mooncake issue #1938 asks for one. test/disagg/test_listeners.py starts a real engine to
keep this table true: when a Mooncake honours a setting, the test fails and says to record it here.
Mooncake's own log misleads: built with host 127.0.0.1 it says "listening on 127.0.0.1:PORT"
(`CHECKED_BUILDS`) while the socket is on every interface.
"""

from __future__ import annotations

# Each Mooncake listener and the environment variable that binds it; None: Mooncake has none.
MOONCAKE_LISTENERS: dict[str, str | None] = {
    "handshake/RPC listener": None,
    "TCP data listener": None,
}

# Mooncake's settings that sound as if they bind, and what each does instead.
NON_BINDING_SETTINGS: dict[str, str] = {
    "MC_TCP_BIND_ADDRESS": "only the address advertised without P2PHANDSHAKE (transfer_engine_impl.cpp:159)",
    "MC_LEGACY_RPC_PORT_BINDING": "the port, from the host name, without P2PHANDSHAKE (transfer_engine_impl.cpp:120)",
    "MC_RDMA_BIND_ADDRESS": "the address of RDMA NIC paths (rdma_transport.cpp:194)",
}


# The Mooncake wheels test_listeners.py was run with (distribution, version) -> where, and what it
# found; the test fails on a build not listed here and prints the row to add.
CHECKED_BUILDS: dict[tuple[str, str], str] = {
    ("mooncake-transfer-engine-non-cuda", "0.3.13.post1"): "CPU CI: the handshake/RPC listener on 0.0.0.0, "
    "the TCP data listener on [::], with host 127.0.0.1 and with every setting of NON_BINDING_SETTINGS, while the "
    "log says 'RPC using P2P handshake, listening on 127.0.0.1:PORT'",
    ("mooncake-transfer-engine-cuda13", "0.3.14"): "one H200 (the wheel a CUDA 13 node installs; "
    "test_listeners.py there, 4 passed, benchmark/results/test_listeners_1xh200.log): the handshake/RPC listener "
    "on 0.0.0.0, the TCP data listener on [::], with host 127.0.0.1 and with every setting of "
    "NON_BINDING_SETTINGS, while the log says 'RPC using P2P handshake, listening on 127.0.0.1:PORT'",
}
MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
)


def unbound_listeners() -> list[str]:
    """The Mooncake listeners that listen on every interface, whatever the configured host."""
    return [listener for listener, setting in MOONCAKE_LISTENERS.items() if setting is None]


def exposure(confined_setting: str) -> str | None:
    """Why Mooncake's ports are open to anyone who reaches the host, and what a deployer does
    about it (`confined_setting`: the variable that says it was done); None when nothing is."""
    unbound = unbound_listeners()
    if not unbound:
        return None
    return (
        f"Mooncake opens its {' and its '.join(unbound)} on every interface (0.0.0.0 and [::]), "
        "unauthenticated, and has no setting that binds them to the configured host (Mooncake issue "
        "#1938): anyone who reaches those ports can read or overwrite KV pages. Confine them to the PD "
        "peers with a firewall or a network namespace (MC_MIN_RPC_PORT and MC_MAX_RPC_PORT choose the "
        f"range both ports come from), then set {confined_setting}=1"
    )
