"""Which address an instance advertises to its peers, and where loopback leads.

`choose_host` picks the address peers reach this instance on, as vLLM picks its own:
$VLLM_HOST_IP, else the IPv4 address of the interface the default route leaves by.
vLLM finds that interface by opening a UDP socket toward 8.8.8.8; kvpush reads the
kernel's routing table instead, so choosing an address sends nothing anywhere.
A machine without a default route gets 127.0.0.1, said once in the log.

`network_id` names the network stack this process's loopback addresses lead into:
two processes reach each other's 127.0.0.1 exactly when they share a kernel and a
network namespace. `loopback_problem` uses it to refuse dialling a loopback
address a producer on another host (or namespace) advertised: that dial would
reach this host's own loopback, never the producer.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

ENV_HOST_IP = "VLLM_HOST_IP"
LOOPBACK = "127.0.0.1"
ROUTE_TABLE = Path("/proc/net/route")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # this kernel's, new at every boot
RTF_UP = 0x1
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
LOOPBACK_NAMES = ("localhost", "localhost.localdomain")

_said: set[str] = set()  # log lines given once per process


def read_route_table() -> str:
    """The kernel's IPv4 routing table of this network namespace ("" if unreadable)."""
    try:
        return ROUTE_TABLE.read_text()
    except OSError:
        return ""


def default_interface(table: str) -> str | None:
    """The interface the default route leaves by, in /proc/net/route's format (the
    lowest metric wins where several default routes are up), or None."""
    best: tuple[int, str] | None = None
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        name, destination, flags, metric, mask = (fields[i] for i in (0, 1, 3, 6, 7))
        try:
            up = int(flags, 16) & RTF_UP
            default = int(destination, 16) == 0 and int(mask, 16) == 0
            rank = int(metric)
        except ValueError:
            continue
        if up and default and (best is None or rank < best[0]):
            best = (rank, name)
    return best[1] if best else None


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None. An ioctl on a socket that is
    never connected or bound: nothing is sent."""
    request = struct.pack("256s", name.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
    except OSError:
        return None
    return socket.inet_ntoa(answer[20:24])


def choose_host(
    environ: Mapping[str, str] | None = None,
    routes: Callable[[], str] = read_route_table,
    address_of: Callable[[str], str | None] = interface_address,
) -> str:
    """The address to advertise when `host` is not set: $VLLM_HOST_IP, else the
    default route's interface's IPv4 address, else 127.0.0.1 (logged once)."""
    chosen = (os.environ if environ is None else environ).get(ENV_HOST_IP, "").strip()
    if chosen:
        return chosen
    interface = default_interface(routes())
    address = address_of(interface) if interface else None
    if address:
        return address
    why = (
        f"its default route's interface {interface} has no IPv4 address"
        if interface
        else "this host has no default route"
    )
    _once(
        why,
        f"kvpush: advertising {LOOPBACK}, which only this host reaches: {why}. "
        f"Set the 'host' setting or ${ENV_HOST_IP} to an address peers on other hosts reach",
    )
    return LOOPBACK


def wildcard(host: str) -> str:
    """The every-interface address of `host`'s family."""
    return "::" if ":" in host else "0.0.0.0"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or localhost by name) is a loopback address."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.cache
def network_id() -> str:
    """Where this process's loopback addresses lead: a digest of the kernel's boot id
    and the network namespace (the host name where /proc does not say). Equal for
    two processes exactly when one's 127.0.0.1 is the other's."""
    try:
        namespace = os.stat("/proc/self/ns/net")
        where = f"{BOOT_ID.read_text().strip()}/{namespace.st_dev}/{namespace.st_ino}"
    except OSError:
        where = socket.gethostname()
    return _digest(where)


@functools.cache
def machine_id() -> str:
    """Which machine this process runs on: a digest of the kernel's boot id (the host
    name where /proc does not say). Equal for two processes of one kernel, whatever
    their network namespaces."""
    try:
        where = BOOT_ID.read_text().strip()
    except OSError:
        where = socket.gethostname()
    return _digest(f"machine/{where}")


def _digest(where: str) -> str:
    return hashlib.sha256(where.encode()).hexdigest()[:16]


def loopback_problem(peer: str, theirs: str, ours: str) -> str | None:
    """Why a consumer must not dial the producer side channel `peer` (host:port),
    advertised by a producer whose network is `theirs`, from network `ours`; or None.
    Unknown networks ("") are not judged: the dial says what it finds."""
    host = peer.rpartition(":")[0]
    if not theirs or not ours or theirs == ours or not is_loopback(host):
        return None
    return (
        f"the producer advertises its side channel at {peer}, a loopback address, but "
        "runs on another host (or network namespace), where that address does not lead: "
        f"set the producer's 'host' setting (kv_connector_extra_config) or ${ENV_HOST_IP} "
        "to an address this host reaches, or leave both unset to advertise its routable one"
    )


def _once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message)
