"""CPU, ~10 s (importing SGLang): the live-server helpers' port picking (test/helpers/sglang_servers.py).

A server binds its port a minute or more after the test picks it; meanwhile outgoing connections
take ports from the kernel's ephemeral range. Ports are therefore picked below that range, free
when picked, and never handed out twice by one process."""

import socket
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from helpers import sglang_servers as S

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    ports = S.free_ports(6) + S.free_ports(6)
    assert len(set(ports)) == 12, ports
    assert all(10000 <= p < S._ephemeral_low() for p in ports), (ports, S._ephemeral_low())
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing in this process holds them


class _Draws:
    """Stands in for random.Random: draws the given ports in order."""

    def __init__(self, ports):
        self.ports = iter(ports)

    def randrange(self, low, high):
        return next(self.ports)


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch):
    (given,) = S.free_ports(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # a port some other socket holds
        in_use = held.getsockname()[1]
        (free,) = [p for p in range(20000, 20100) if p not in S._PORTS_GIVEN and _bindable(p)][:1]
        monkeypatch.setattr(S.random, "Random", lambda: _Draws([in_use, given, free]))
        assert S.free_ports(1) == [free]


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
