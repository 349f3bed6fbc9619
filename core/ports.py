"""Choosing TCP ports for servers started later (the demo, the tests, Ray's replicas)."""

from __future__ import annotations

import os
import random
import socket

from kvpush.errors import KVPushError

# "LOW-HIGH": choose only from these ports (what a firewall opens, or one slice of the
# range per test worker, so that two runs on one host never pick the same port).
ENV_PORTS = "KVPUSH_PORTS"


def free_port(span: int = 1) -> int:
    """A port free now that no process will be handed by the kernel meanwhile (with
    `span` > 1, the first of that many free ports in a row).

    Servers bind their ports a minute after they are chosen; a port from the
    kernel's ephemeral range can be given to someone else's connection or port-0
    listener (vLLM's, NIXL's, kvpush's own) in between. So pick below that range,
    and never the same one twice in this process. KVPUSH_PORTS narrows the choice.
    """
    low, high = port_range()
    if high - low + 1 < span:
        raise KVPushError(f"{span} ports in a row do not fit in {low}-{high}")
    for _ in range(1000):
        first = random.randrange(low, high - span + 1)
        ports = range(first, first + span)
        if any(port in _handed_out or not _bindable(port) for port in ports):
            continue
        _handed_out.update(ports)
        return first
    raise KVPushError(f"no {span} free port(s) in a row in {low}-{high}")


def port_range() -> tuple[int, int]:
    """The ports free_port chooses from, both ends included."""
    spec = os.environ.get(ENV_PORTS, "").strip()
    if not spec:
        ephemeral_low, _ = _ephemeral_range()
        return max(1024, ephemeral_low - 12000), ephemeral_low - 1
    try:
        low, high = (int(end) for end in spec.split("-"))
    except ValueError:
        low = high = 0
    if not 1024 <= low < high <= 65535:
        raise KVPushError(
            f"{ENV_PORTS}={spec!r}: expected LOW-HIGH, two ports from 1024 to 65535, LOW < HIGH"
        )
    return low, high


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
