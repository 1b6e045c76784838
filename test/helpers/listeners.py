"""The TCP ports a process listens on, read from /proc (what the listener tests assert on)."""

from __future__ import annotations

import ipaddress
import os
import sys

_LISTEN = "0A"  # TCP_LISTEN in the `st` column of /proc/net/tcp{,6}


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
