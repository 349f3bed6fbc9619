"""The soak's faults: which to inject when, how, and which requests each explains.

Kinds (`--faults`, taken in turn, one every `--fault-interval` seconds):

  kill-prefill, kill-decode   kill -9 an instance's whole process tree, then start it
                              again (a new incarnation: new epoch, new side channel)
  stop-prefill, stop-decode   SIGSTOP its process tree for longer than the protocol's
                              timers, then SIGCONT
  cut                         close a prefill instance's side-channel TCP connections
                              under both ends (`ss -K`, which needs root and a kernel
                              with INET_DIAG_DESTROY; where it is refused, the kind is
                              dropped for the rest of the run and the fault log says so)
  partition                   take a prefill instance's host off the network it shares
                              with decode (`ip link set DEV down` in its namespace) for
                              as long as a stop, then up again; needs the servers in
                              network namespaces, as the soak puts them when it runs as
                              root with this kind (skipped otherwise, as a refused cut)
  drain-prefill, drain-decode,  drain an instance at the router, or start a new one and
  add-prefill, add-decode       add it (bench/membership_faults.py)

A fault's window runs from its start until the instance serves again (restarted and
healthy, resumed, healed, or at once for a cut), plus a grace for what it leaves behind (the
protocol's timers, the router's cooldown). A failed request that was in flight
during a window is explained by that fault.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvpush.errors import KVPushError
from kvpush.identities import fetch_query, parse_identity
from kvpush.protocol.messages import REASONS

if TYPE_CHECKING:
    from kvpush.demo.cluster import Cluster

MEMBERSHIP_KINDS = ("drain-prefill", "drain-decode", "add-prefill", "add-decode")
KINDS = ("kill-prefill", "kill-decode", "stop-prefill", "stop-decode", "cut", "partition",
         *MEMBERSHIP_KINDS)  # fmt: skip
DEFAULT_FAULTS = ("kill-prefill", "stop-decode", "cut", "kill-decode", "stop-prefill")

# Words an error must carry to name its cause: the instance's role (the router says
# which leg failed and where), or a kvpush failure reason.
CAUSE_WORDS = ("prefill", "decode", *REASONS)


@dataclass
class Fault:
    """One fault as it happened (seconds since the run started)."""

    id: int
    kind: str
    target: str  # the instance's name in the cluster
    start: float
    end: float | None = None  # when it served again; None: it never did
    note: str = ""
    skipped: bool = False  # could not be injected (the note says why)
    held: bool | None = None  # a membership fault: whether its checks held

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The fault as a line of the fault log."""
        end = "never" if self.end is None else f"{self.end:.1f}s"
        state = "SKIPPED" if self.skipped else f"{self.start:.1f}s -> {end}"
        checks = {None: "", True: "checks held; ", False: "CHECKS FAILED; "}[self.held]
        return f"#{self.id} {self.kind} {self.target}: {state}  {checks}{self.note}".rstrip()


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise KVPushError(f"unknown fault kind(s) {unknown}; known: {list(KINDS)}")
    return kinds


def schedule(
    kinds: tuple[str, ...], prefill: list[str], decode: list[str], seed: int
) -> Callable[[int], tuple[str, str]]:
    """Fault i's kind and target instance: the kinds in turn, each on an instance of
    its role drawn from `seed` (a cut or a partition is on a prefill instance). An add
    names the instance it will start: the role's next number, `prefill` or `decode`
    being the names so far, which an add extends."""

    def pick(i: int) -> tuple[str, str]:
        kind = kinds[i % len(kinds)]
        role = "decode" if kind.endswith("decode") else "prefill"
        pool = decode if role == "decode" else prefill
        if kind.startswith("add-"):
            return kind, f"{role}{len(pool)}"
        return kind, pool[(seed + i // len(kinds)) % len(pool)]

    return pick


def attribute(
    sent: float, ended: float, faults: list[Fault], grace_s: float
) -> Fault | None:  # fmt: skip
    """The first fault whose window, widened by `grace_s`, overlaps a request that was
    in flight from `sent` to `ended`; None if none does."""
    for fault in faults:
        if fault.skipped:
            continue
        until = float("inf") if fault.end is None else fault.end + grace_s
        if sent <= until and ended >= fault.start:
            return fault
    return None


def names_cause(error: str) -> bool:
    """Whether an error message says what failed: which leg or instance, or why."""
    text = error.lower()
    return any(re.search(rf"\b{re.escape(word)}\b", text) for word in CAUSE_WORDS)


class Injector:
    """Injects faults into a running cluster; every call leaves the instance serving
    (or says in the fault's note why it could not)."""

    def __init__(self, cluster: Cluster, stop_s: float, clock: Callable[[], float]) -> None:
        self.cluster = cluster
        self.stop_s = stop_s
        self.clock = clock
        self.refused: set[str] = set()  # kinds the machine cannot do, with why in the log

    async def inject(self, fault: Fault) -> Fault:
        action, _, _ = fault.kind.partition("-")
        if fault.kind in self.refused:
            fault.skipped, fault.note = True, "skipped: refused earlier in this run"
            return fault
        fault.start = self.clock()
        try:
            if action == "kill":
                await self._kill_and_restart(fault)
            elif action == "stop":
                await self._stop_and_resume(fault)
            elif action == "partition":
                await self._partition(fault)
            else:
                await asyncio.to_thread(self._cut, fault)
        except KVPushError as exc:
            fault.note += f" failed: {exc}"
        return fault

    async def _kill_and_restart(self, fault: Fault) -> None:
        self.cluster.servers[fault.target].kill()
        fault.note = "killed (SIGKILL to the process group); restarting"
        await asyncio.to_thread(self.cluster.start, fault.target)
        fault.end = self.clock()
        fault.note = f"killed; restarted and healthy after {fault.end - fault.start:.1f}s"

    async def _stop_and_resume(self, fault: Fault) -> None:
        server = self.cluster.servers[fault.target]
        server.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.stop_s)
        finally:  # never leave a server stopped, whatever happens to the run
            server.send_signal(signal.SIGCONT)
        fault.end = self.clock()
        fault.note = f"SIGSTOP for {self.stop_s:g}s, then SIGCONT"

    async def _partition(self, fault: Fault) -> None:
        link = host_link(self.cluster.servers[fault.target].spec.launcher)
        if isinstance(link, str):
            self.refused.add(fault.kind)
            fault.end, fault.skipped = self.clock(), True
            fault.note = f"SKIPPED, and every later partition: {link}"
            return
        namespace, device = link
        set_link(namespace, device, up=False)
        try:
            await asyncio.sleep(self.stop_s)
        finally:  # never leave a host cut off, whatever happens to the run
            set_link(namespace, device, up=True)
        fault.end = self.clock()
        fault.note = f"{device} down in {namespace} for {self.stop_s:g}s, then up"

    def _cut(self, fault: Fault) -> None:
        ports = side_channel_ports(self.cluster.identity_url(fault.target))
        cut, why = cut_connections(ports)
        fault.end = self.clock()
        if why:
            self.refused.add(fault.kind)
            fault.skipped = True
            fault.note = f"SKIPPED, and every later cut: {why}"
        else:
            fault.note = f"ss -K closed {cut} socket(s) on side-channel port(s) {ports}"


def instance_state(cluster: Cluster, name: str) -> dict[str, Any]:
    """Instance `name`'s /kvpush/state (transfers in flight, blocks held), or why not."""
    import json
    import urllib.request

    try:
        url = cluster.identity_url(name) + "/kvpush/state"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}


def side_channel_ports(identity_url: str) -> list[int]:
    """The side-channel ports an instance's identity names, one per TP rank."""
    identity = parse_identity(fetch_query(identity_url, timeout=5), identity_url)
    return [int(address.rsplit(":", 1)[1]) for address in identity.addresses]


def cut_connections(ports: list[int]) -> tuple[int, str]:
    """Close every established TCP connection to or from `ports` under both ends: how
    many sockets were closed, and why it could not be done ("" when it was)."""
    match = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    try:
        result = subprocess.run(
            ["ss", "-K", "-t", "-n", "-H", f"( {match} )"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"ss -K could not run: {exc}"
    if result.returncode != 0:
        return 0, f"ss -K failed ({result.returncode}): {result.stderr.strip()[:200]}"
    closed = [line for line in result.stdout.splitlines() if line.strip()]
    # A kernel without socket destroy lists the sockets and leaves them be.
    time.sleep(0.2)
    still = subprocess.run(
        ["ss", "-t", "-n", "-H", "state", "established", f"( {match} )"],
        capture_output=True, text=True, timeout=10,
    ).stdout.splitlines()  # fmt: skip
    survivors = {_ends(line) for line in still} & {_ends(line) for line in closed}
    if survivors:
        return 0, f"the kernel did not close {len(survivors)} socket(s) (no INET_DIAG_DESTROY?)"
    return len(closed), ""


def _ends(line: str) -> tuple[str, ...]:
    """An `ss` line's local and peer address (its last two address columns)."""
    return tuple(part for part in line.split() if ":" in part)[-2:]


def host_link(launcher: list[str]) -> tuple[str, str] | str:
    """The namespace a server runs in (its launcher is `ip netns exec NS`) and the
    device its default route leaves by: the link to the other host. Or why none."""
    if launcher[:3] != ["ip", "netns", "exec"] or len(launcher) < 4:
        return "the servers run in no network namespace (the soak puts them in one as root)"
    namespace = launcher[3]
    shown = subprocess.run(["ip", "-n", namespace, "-o", "route", "show", "default"],
                           capture_output=True, text=True)  # fmt: skip
    words = shown.stdout.split()
    if shown.returncode != 0 or "dev" not in words:
        return f"no default route in namespace {namespace}: {shown.stderr.strip()[:200]}"
    return namespace, words[words.index("dev") + 1]


def set_link(namespace: str, device: str, up: bool) -> None:
    """`device` in `namespace` down (a partition) or up; up puts the default route
    back, which going down removed with every route over the device."""
    inside = ["ip", "-n", namespace]
    commands = [[*inside, "link", "set", device, "up" if up else "down"]]
    if up:
        commands.append([*inside, "route", "replace", "default", "dev", device])
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise KVPushError(f"{' '.join(command)} failed: {done.stderr.strip()[:200]}")
