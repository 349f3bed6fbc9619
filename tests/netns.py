"""Two simulated hosts on one machine: Linux network namespaces joined by a veth pair.

Each host is a namespace with its own loopback and one end of the link, and a
default route out of that end, so kvpush chooses the link's address there as it
would a machine's. The addresses exist only inside the two namespaces, and a
namespace does not forward, so nothing sent in them can leave the machine. The
root namespace gets no address and no route: what runs outside the namespaces
(a router, a plain reference instance) joins later through a link of its own.

`TwoHosts.close` ends every process it started and deletes both namespaces (which
deletes the link), whatever failed before.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUBNET = "10.241.0"  # a /30 of it per link; it exists only inside the namespaces
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
    """Hosts `a` and `b`, each in its own namespace, joined by one veth link."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}x{next(_names)}"
        self.a = Host(f"kvpush-{tag}-a", f"kvp{tag}a", f"{SUBNET}.1")
        self.b = Host(f"kvpush-{tag}-b", f"kvp{tag}b", f"{SUBNET}.2")
        self._processes: list[subprocess.Popen] = []
        self._made: list[str] = []

    def start(self) -> TwoHosts:
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
        return self

    def popen(
        self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start `argv` inside `host`; close() ends it."""
        process = subprocess.Popen(host.command(argv), env=dict(env or os.environ), **kwargs)
        self._processes.append(process)
        return process

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for namespace in self._made:
            _kill_left_in(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        # A start that failed before moving the link into the namespaces left it here.
        subprocess.run(["ip", "link", "del", self.a.device], capture_output=True)
        self._processes, self._made = [], []


def _kill_left_in(namespace: str) -> None:
    """Kill what still runs in `namespace`, one of ours: children our processes left."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
