"""CPU (importing SGLang): the live-server helpers' port picking (test/helpers/sglang_servers.py).

A server binds its port a minute or more after the test picks it; meanwhile outgoing connections
take ports from the kernel's ephemeral range. Ports are therefore picked below that range, free
when picked, and never handed out twice by one process; the partitions of a run that run at once
(scripts/run_suite.py) pick from disjoint slices."""

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


def test_partitions_take_disjoint_slices_of_the_ports_and_of_mooncakes_range(monkeypatch):
    """scripts/run_suite.py runs partition I of N with NSA_CP_TEST_PARTITION=I/N: the N partitions'
    servers, started at once, pick from disjoint port ranges, Mooncake's included."""
    top = S._ephemeral_low()
    slices = {}
    for part in range(3):
        monkeypatch.setenv(S.PARTITION_ENV, f"{part}/3")
        low, high = S.port_slice(10000, top)
        assert all(low <= p < high for p in S.free_ports(5)), (part, low, high)
        slices[part] = (low, high), S.port_slice(*S.MOONCAKE_PORTS)
    for ranges in zip(*slices.values()):
        ranges = sorted(ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges  # disjoint
        assert ranges[0][1] > ranges[0][0] + 100, ranges  # each slice room for a cluster's ports
    monkeypatch.delenv(S.PARTITION_ENV)
    assert S.port_slice(10000, top) == (10000, top)
    monkeypatch.setenv(S.PARTITION_ENV, "2/2")
    with pytest.raises(ValueError, match="must be I/N with 0 <= I < N"):
        S.free_ports(1)


def test_the_servers_mooncake_range_is_this_partitions_slice():
    """SERVER_ENV's MC_MIN/MAX_RPC_PORT (inclusive) lie in Mooncake's slice for this process's
    partition, below free_ports' range (read at import, as a partitioned run sets it)."""
    low, high = S.port_slice(*S.MOONCAKE_PORTS)
    assert (int(S.SERVER_ENV["MC_MIN_RPC_PORT"]), int(S.SERVER_ENV["MC_MAX_RPC_PORT"])) == (low, high - 1)
    assert high <= 10000


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
