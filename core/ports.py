"""Choosing TCP ports for servers started later (the demo, the tests, Ray's replicas)."""

from __future__ import annotations

import random
import socket

from kvpush.errors import KVPushError


def free_port(span: int = 1) -> int:
    """A port free now that no process will be handed by the kernel meanwhile (with
    `span` > 1, the first of that many free ports in a row).

    Servers bind their ports a minute after they are chosen; a port from the
    kernel's ephemeral range can be given to someone else's connection or port-0
    listener (vLLM's, NIXL's, kvpush's own) in between. So pick below that range,
    and never the same one twice in this process.
    """
    low, _ = _ephemeral_range()
    for _ in range(1000):
        first = random.randrange(max(1024, low - 12000), low - span)
        ports = range(first, first + span)
        if any(port in _handed_out or not _bindable(port) for port in ports):
            continue
        _handed_out.update(ports)
        return first
    raise KVPushError("no free port below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = (int(x) for x in ports.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999
