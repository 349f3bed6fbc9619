"""Two simulated hosts on one machine: Linux network namespaces joined by a veth pair
(the two-host tests, and `kvpush bench transfer --across-namespaces`).

Each host is a namespace with its own loopback and one end of the link, and a
default route out of that end, so kvpush chooses the link's address there as it
would a machine's. The addresses exist only inside the two namespaces, and a
namespace does not forward, so nothing sent in them can leave the machine.

By default the root namespace gets no address and no route. `TwoHosts(reachable=True)`
lets what runs outside (a router, a plain reference instance) reach both hosts at
their advertised addresses: each host gets a second veth link, to the root
namespace, and the root namespace a route to the host's address over it. The
host-to-host link then carries what the two hosts send each other and nothing
else, so its byte counters measure the KV that crossed. Such a pair claims a /24 of
10.241.0.0/16 of its own in the root namespace (an `unreachable` route, which also
keeps any stray packet for an unused address of it from leaving the machine).

`TwoHosts.close` ends every process it started, deletes both namespaces (which
deletes the links) and the root namespace's routes, whatever failed before.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

SUBNET = "10.241.0"  # a /30 of it per link; it exists only inside the namespaces
# Reachable pairs: 10.241.N.0/24 for N in 1..254, the first not claimed in the root namespace.
REACHABLE_SUBNETS = range(1, 255)
_names = itertools.count()


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its end of the link, its address there."""

    namespace: str
    device: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def sent_bytes(self) -> int:
        """Bytes this host has sent on its end of the host-to-host link."""
        shown = subprocess.run(
            ["ip", "-j", "-s", "-n", self.namespace, "link", "show", "dev", self.device],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"]


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"kvpush-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """Hosts `a` and `b`, each in its own namespace, joined by one veth link;
    `reachable`: each also linked to the root namespace (the module's docstring)."""

    def __init__(self, reachable: bool = False) -> None:
        self._tag = tag = f"{os.getpid() % 100000}x{next(_names)}"
        self.reachable = reachable
        self.a = Host(f"kvpush-{tag}-a", f"kvp{tag}a", f"{SUBNET}.1")
        self.b = Host(f"kvpush-{tag}-b", f"kvp{tag}b", f"{SUBNET}.2")
        self._processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._claimed: str | None = None  # the root namespace's route for our /24

    def start(self) -> TwoHosts:
        if self.reachable:
            subnet = self._claim_subnet()
            self.a = replace(self.a, address=f"{subnet}.1")
            self.b = replace(self.b, address=f"{subnet}.2")
        for host in (self.a, self.b):
            _ip("netns", "add", host.namespace)
            self._made.append(host.namespace)
        _ip("link", "add", self.a.device, "type", "veth", "peer", "name", self.b.device)
        for host in (self.a, self.b):
            _ip("link", "set", host.device, "netns", host.namespace)
            inside = ["-n", host.namespace]
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{host.address}/30", "dev", host.device)
            _ip(*inside, "link", "set", host.device, "up")
            # The link is the way out, as a machine's uplink is: its address is the
            # one an instance there advertises by default.
            _ip(*inside, "route", "add", "default", "dev", host.device)
        if self.reachable:
            for index, host in enumerate((self.a, self.b)):
                self._link_to_root(host, index)
        return self

    def cap_link(self, rate_bits: int | None) -> None:
        """Hold the host-to-host link to `rate_bits` a second each way (tc's `tbf`; this
        kernel has no `netem`), in place of any cap before; None: uncapped."""
        # A bucket of 10 ms at the rate, at least one 64 KiB GSO packet: a packet larger
        # than the bucket would never be sent.
        for host in (self.a, self.b):
            qdisc = ["tc", "-n", host.namespace, "qdisc"]
            if rate_bits is None:
                # No cap to remove is no error: the link is as asked.
                subprocess.run([*qdisc, "del", "dev", host.device, "root"], capture_output=True)
                continue
            burst = max(rate_bits // 8 // 100, 64 * 1024)
            _ip_tool(
                *qdisc, "replace", "dev", host.device, "root", "tbf",
                "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "50ms",
            )  # fmt: skip

    def _claim_subnet(self) -> str:
        """A /24 no other reachable pair holds: adding its route fails if one does."""
        for third in REACHABLE_SUBNETS:
            subnet = f"10.241.{third}"
            route = ["unreachable", f"{subnet}.0/24"]
            if subprocess.run(["ip", "route", "add", *route], capture_output=True).returncode == 0:
                self._claimed = " ".join(route)
                return subnet
        raise RuntimeError("every 10.241.N.0/24 is claimed in the root namespace")

    def _link_to_root(self, host: Host, index: int) -> None:
        """A veth link from the root namespace into `host` (its own /30), and a root
        route to the host's address over it. The host's default route stays on the
        host-to-host link, so its advertised address is still that link's."""
        subnet = host.address.rpartition(".")[0]
        outside, inside = f"{subnet}.{5 + 4 * index}", f"{subnet}.{6 + 4 * index}"
        root_end, host_end = self._root_device(host), f"kvp{self._tag}u{index}"
        _ip("link", "add", root_end, "type", "veth", "peer", "name", host_end)
        _ip("link", "set", host_end, "netns", host.namespace)
        _ip("addr", "add", f"{outside}/30", "dev", root_end)
        _ip("link", "set", root_end, "up")
        _ip("-n", host.namespace, "addr", "add", f"{inside}/30", "dev", host_end)
        _ip("-n", host.namespace, "link", "set", host_end, "up")
        _ip("route", "add", f"{host.address}/32", "dev", root_end)

    def _root_device(self, host: Host) -> str:
        return f"kvp{self._tag}r{host.namespace[-1]}"

    def popen(
        self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start `argv` inside `host`; close() ends it."""
        process = subprocess.Popen(host.command(argv), env=dict(env or os.environ), **kwargs)
        self._processes.append(process)
        return process

    def close(self) -> None:
        # Every one killed before any is waited for: none is left to report that
        # another went away.
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for namespace in self._made:
            _kill_left_in(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        # A start that failed before moving a link into the namespaces left it here;
        # a root route goes with its link.
        for device in (self.a.device, self._root_device(self.a), self._root_device(self.b)):
            subprocess.run(["ip", "link", "del", device], capture_output=True)
        if self._claimed:
            subprocess.run(["ip", "route", "del", *self._claimed.split()], capture_output=True)
        self._processes, self._made, self._claimed = [], [], None


def _kill_left_in(namespace: str) -> None:
    """Kill what still runs in `namespace`, one of ours: children our processes left."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _ip(*args: str) -> None:
    _ip_tool("ip", *args)


def _ip_tool(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
