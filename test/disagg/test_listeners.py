"""Mooncake's listeners (issue #32): `listening_sockets` reads a process's own listeners; a Mooncake
TransferEngine started as SGLang starts it listens on every interface, whatever its own log says;
the plugin's table of Mooncake settings that bind a listener (`disagg/listeners.py`, none today)
is true: with every bind-sounding setting a listener is still on a wildcard address, so the flag's
refusal stands; the installed Mooncake build is a row of `CHECKED_BUILDS` (CPU, three engine
subprocesses; on a GPU node with its CUDA wheel the same file checks that wheel)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import selectors
import socket
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from helpers.listeners import is_wildcard, listening_sockets

from sglang_nsa_cp.disagg.listeners import (
    CHECKED_BUILDS,
    MOONCAKE_DISTRIBUTIONS,
    NON_BINDING_SETTINGS,
    exposure,
    unbound_listeners,
)

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

HOST = "127.0.0.1"

# SGLang's MooncakeTransferEngine.initialize, with protocol "tcp" (the one that opens a data port);
# the engine lives until the test closes stdin.
_ENGINE = f"""
import sys
from mooncake.engine import TransferEngine
engine = TransferEngine()
ret = engine.initialize({HOST!r}, "P2PHANDSHAKE", "tcp", "")
print(ret, engine.get_rpc_port(), flush=True)
sys.stdin.read()
"""

needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake not installed")


def _engine_listeners(env: dict[str, str], log: list | None = None) -> tuple[int, list[tuple[str, int]]]:
    """Start an engine with `env` over a clean MC_* environment; its rpc port and listeners (and
    its log lines appended to `log`)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")} | env
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE],
        env=child_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=60)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            pytest.fail(f"the engine did not start: {proc.communicate()[1][-2000:]}")
        ret, rpc_port = map(int, line.split())
        assert ret == 0, f"TransferEngine.initialize returned {ret}"
        return rpc_port, listening_sockets(proc.pid)
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not None:
            log += proc.stderr.read().splitlines()


def test_listening_sockets_reads_only_this_process():
    with socket.socket() as loop, socket.socket() as anywhere, socket.socket() as bound_only:
        loop.bind((HOST, 0))
        loop.listen()
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        bound_only.bind((HOST, 0))  # bound, not listening: not reported
        mine = listening_sockets(os.getpid())
        assert (HOST, loop.getsockname()[1]) in mine, mine
        assert ("0.0.0.0", anywhere.getsockname()[1]) in mine, mine
        assert all(port != bound_only.getsockname()[1] for _, port in mine), mine
        if socket.has_ipv6:  # where the machine has an IPv6 loopback; the checks below run either way
            with socket.socket(socket.AF_INET6) as six:
                try:
                    six.bind(("::1", 0))
                except OSError:
                    six = None
                if six is not None:
                    six.listen()
                    assert ("::1", six.getsockname()[1]) in listening_sockets(os.getpid())
        # Another process's listener is in the same /proc/<pid>/net/tcp but not ours.
        other = subprocess.Popen(
            [sys.executable, "-c", "import socket,sys; s=socket.create_server(('127.0.0.1',0)); "
             "print(s.getsockname()[1], flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            port = int(other.stdout.readline())
            assert (HOST, port) in listening_sockets(other.pid)
            assert (HOST, port) not in listening_sockets(os.getpid())
        finally:
            other.stdin.close()
            other.wait(timeout=30)


def _installed_build() -> tuple[str, str] | None:
    for name in MOONCAKE_DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@needs_mooncake
def test_control_mooncake_listens_on_every_interface():
    """Without a setting the handshake port (and the data port) listen on 0.0.0.0 / ::, though the
    engine's host is 127.0.0.1, whatever Mooncake's log says: what the test below must prevent or
    refuse. Prints the installed build's row for `CHECKED_BUILDS`."""
    log = []
    rpc_port, listeners = _engine_listeners({}, log)
    exposed = [(address, port) for address, port in listeners if is_wildcard(address)]
    claims = sorted({m.group(0) for line in log if (m := re.search(r"listening on \S+", line))})
    print(f"\nMooncake {_installed_build()}: listeners {sorted(listeners)}, rpc port {rpc_port}; its log: {claims}")
    assert any(port == rpc_port for _, port in exposed), listeners
    assert len(exposed) >= 2, f"expected the handshake and the TCP data listener on a wildcard: {listeners}"
    for claim in claims:  # the row warns of the log line that says otherwise
        address = claim.removeprefix("listening on ").rsplit(":", 1)[0]
        if not is_wildcard(address):
            assert f"listening on {address}:PORT" in CHECKED_BUILDS.get(_installed_build(), ""), (claim, listeners)


@needs_mooncake
def test_the_installed_mooncake_build_is_a_checked_row():
    """The table names every Mooncake build these tests ran with, so an operator reading it (or
    Mooncake's log) knows which builds were found open; a new build needs its row."""
    build = _installed_build()
    assert build is not None, f"mooncake is importable but none of {MOONCAKE_DISTRIBUTIONS} is installed"
    assert build in CHECKED_BUILDS, (
        f"Mooncake {build[0]} {build[1]} has no row in sglang_nsa_cp/disagg/listeners.py CHECKED_BUILDS: run "
        "this file with -s, and add a row with the listeners and log line "
        "test_control_mooncake_listens_on_every_interface prints"
    )


@needs_mooncake
def test_no_mooncake_setting_binds_its_listeners():
    """The refusal (`exposure`) stands only while no setting binds: with every bind-sounding one set,
    a listener is still on a wildcard. If this fails, the installed Mooncake binds; record the
    setting in `MOONCAKE_LISTENERS` and set it from the plugin."""
    assert unbound_listeners() == ["handshake/RPC listener", "TCP data listener"]
    message = exposure("SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED")
    assert all(name in message for name in unbound_listeners()) and "0.0.0.0" in message, message
    tried = {name: ("1" if name == "MC_LEGACY_RPC_PORT_BINDING" else HOST) for name in NON_BINDING_SETTINGS}
    _, listeners = _engine_listeners(tried)
    assert any(is_wildcard(address) for address, _ in listeners), (tried, listeners)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
