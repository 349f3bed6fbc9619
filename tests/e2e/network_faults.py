"""Network faults between the two hosts of tests/e2e/test_vllm_two_hosts.py, under load.

Load: a few clients send fresh prompts through the router back to back, from before
a fault until after it heals, each with a client deadline well past the bound a
request must end within, so a request that hangs is seen as such and not waited on.

The bound: every leg through `kvpush router --timeout T` is cut once it has been idle
T seconds (docs/configuration.md: an idle timer per leg, answering 502), and both legs
of a push request run at once, so a request ends within T of being sent, whatever
the network does; decode's watchdog (`watchdog_s`) ends a transfer that hears nothing
sooner. Prompts are fresh (decode's prefix cache would otherwise need no KV), and
the plain instance answers the same prompts afterwards.

Faults (this kernel has tbf, no netem): a partition (prefill's end of the
host-to-host link down, then up), a slow link (tbf on it), and a host that vanishes
(its processes killed, then its links deleted). Each undoes itself on the way out,
whatever failed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import netns
from conftest import prompt

from kvpush.bench.faults import names_cause
from kvpush.demo.servers import MODEL_NAME

ROUTER_TIMEOUT_S = 20.0  # the router's idle timer per leg: the bound on a request
DEADLINE_S = ROUTER_TIMEOUT_S + 40.0  # the client gives up here: past it, a request hung
# The bound with a slow machine's margin: the router's own work, a queued step.
BOUND_S = ROUTER_TIMEOUT_S + 8.0
LOAD_CLIENTS = 3
MAX_TOKENS = 16


@dataclass
class Sent:
    """One request of the load as its client saw it (monotonic seconds)."""

    tokens: list[int]
    sent: float
    ended: float = 0.0
    status: int = 0  # 0: no HTTP answer (the connection broke, or the deadline)
    answer: list[int] | None = None
    error: str = ""
    named: bool = False  # an OpenAI-shaped error naming a leg or a kvpush reason

    @property
    def seconds(self) -> float:
        return self.ended - self.sent


def ask(http: httpx.Client, url: str, tokens: list[int]) -> Sent:
    """One greedy completion; whatever happens, a Sent that says how it ended."""
    sent = Sent(tokens, time.monotonic())
    body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    try:
        response = http.post(url + "/v1/completions", json=body)
        sent.status = response.status_code
        if sent.status == 200:
            sent.answer = response.json()["choices"][0]["token_ids"]
        else:
            error = response.json().get("error")
            sent.error = str(error.get("message") if isinstance(error, dict) else error)
            sent.named = isinstance(error, dict) and names_cause(sent.error)
    except (httpx.HTTPError, ValueError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"
    sent.ended = time.monotonic()
    return sent


@dataclass
class Load:
    """LOAD_CLIENTS clients sending fresh prompts through `url` back to back, until
    stopped."""

    url: str
    seed: int
    lengths: tuple[int, ...] = (300, 520, 760, 1000)
    sent: list[Sent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(LOAD_CLIENTS)]  # fmt: skip

    def _fresh(self) -> list[int]:
        with self._lock:
            self._next += 1
            n = self._next
        return prompt(self.lengths[n % len(self.lengths)], self.seed + n)

    def _client(self) -> None:
        with httpx.Client(timeout=DEADLINE_S) as http:
            while not self._stop.is_set():
                self.sent.append(ask(http, self.url, self._fresh()))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(DEADLINE_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a load client never returned"


def wrong_outcomes(sent: list[Sent], plain: dict[tuple[int, ...], list[int]]) -> list[str]:
    """Each request that did not end as it must: 200 with the plain instance's answer,
    or an error naming its cause, within BOUND_S."""
    wrong = []
    for s in sent:
        what = f"{len(s.tokens)} tokens, {s.status} after {s.seconds:.1f}s {s.error[:120]!r}"
        if s.seconds > BOUND_S:
            wrong.append(f"past the {BOUND_S:g}s bound: {what}")
        elif s.status == 200 and s.answer != plain[tuple(s.tokens)]:
            wrong.append(f"answered unlike the plain instance: {what}")
        elif s.status != 200 and not s.named:
            wrong.append(f"an error not naming its cause: {what}")
    return wrong


def table_row(fault: str, cut_s: float, sent: list[Sent], recover_s: float, held: str) -> str:
    """A line of the fault table: what each request got, by status and error."""
    got: dict[str, int] = {}
    for s in sent:
        key = "200" if s.status == 200 else f"{s.status or 'no answer'} {s.error[:140]}"
        got[key] = got.get(key, 0) + 1
    longest = max((s.seconds for s in sent), default=0.0)
    outcomes = "; ".join(f"{n} x {k}" for k, n in sorted(got.items()))
    recovered = f"{recover_s:.1f}s" if recover_s < float("inf") else "never"
    cells = [fault, f"{cut_s:.1f}s", f"{outcomes} (longest {longest:.1f}s)", recovered]
    return "| " + " | ".join([*cells, held]) + " |"


# -- the faults -------------------------------------------------------------------------


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@contextlib.contextmanager
def partitioned(host: netns.Host) -> Iterator[None]:
    """`host`'s end of the host-to-host link down for the block, then up again with
    its default route back (a device going down takes its routes with it). The
    root namespace's link to it stays up: the router still reaches both hosts."""
    inside = ("ip", "-n", host.namespace)
    _run(*inside, "link", "set", host.device, "down")
    try:
        yield
    finally:
        _run(*inside, "link", "set", host.device, "up")
        _run(*inside, "route", "replace", "default", "dev", host.device)


@contextlib.contextmanager
def slowed(host: netns.Host, rate: str = "100mbit") -> Iterator[None]:
    """What `host` sends on the host-to-host link held to `rate` (tc's tbf)."""
    qdisc = ("tc", "-n", host.namespace, "qdisc")
    _run(*qdisc, "add", "dev", host.device, "root", "tbf", "rate", rate, "burst", "32kbit",
         "latency", "400ms")  # fmt: skip
    try:
        yield
    finally:
        subprocess.run([*qdisc, "del", "dev", host.device, "root"], capture_output=True)


def links_of(host: netns.Host) -> list[str]:
    """The devices in `host`'s namespace but its loopback: its ends of every link."""
    shown = subprocess.run(["ip", "-j", "-n", host.namespace, "link", "show"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return [link["ifname"] for link in json.loads(shown.stdout) if link["ifname"] != "lo"]


def vanish(host: netns.Host, survivor: netns.Host) -> None:
    """`host` goes as a machine whose power is cut does: its links deleted first (their
    other ends with them, and the root namespace's route to it), so that no FIN or RST
    from its sockets reaches anyone, then every process in its namespace killed. A
    veth link's two ends go together, so `survivor` keeps its address on its link to
    the root namespace, as a machine whose peer vanished keeps its own."""
    for device in links_of(host):
        _run("ip", "-n", host.namespace, "link", "del", device)
    pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                          text=True).stdout.split()  # fmt: skip
    if pids:
        subprocess.run(["kill", "-KILL", *pids], capture_output=True)
    deadline = time.monotonic() + 30
    while subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                         text=True).stdout.split():  # fmt: skip
        assert time.monotonic() < deadline, "the namespace's processes outlived SIGKILL"
        time.sleep(0.2)
    for device in links_of(survivor):
        _run("ip", "-n", survivor.namespace, "addr", "add", f"{survivor.address}/32", "dev", device)


# -- what a fault may not leave behind --------------------------------------------------


def addresses_of(host: netns.Host) -> set[str]:
    """Every address `host` has but loopback's: a host answers on any of them."""
    shown = subprocess.run(["ip", "-j", "-n", host.namespace, "addr", "show"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return {a["local"] for link in json.loads(shown.stdout) for a in link.get("addr_info", [])
            if a.get("family") == "inet" and not a["local"].startswith("127.")}  # fmt: skip


def tcp_between(inside: netns.Host, theirs: set[str]) -> set[tuple[str, str]]:
    """TCP connections established in `inside`'s namespace with any of `theirs` (the
    other host's addresses) at the far end, each as (local, peer) "address:port"."""
    shown = subprocess.run(
        ["ip", "netns", "exec", inside.namespace, "ss", "-H", "-t", "-n", "state", "established"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    ends = set()
    for line in shown.stdout.splitlines():
        parts = [p for p in line.split() if ":" in p]
        if len(parts) >= 2 and parts[-1].rpartition(":")[0] in theirs:
            ends.add((parts[-2], parts[-1]))
    return ends


@dataclass(frozen=True)
class OneSided:
    """A connection one host holds whose other end the other host does not."""

    on: str  # "a" or "b"
    local: str
    peer: str
    owner: str  # the holding process and its TCP timer, as `ss` shows them

    @property
    def kept_alive(self) -> bool:
        """The kernel probes it, so it ends by itself once the other end is gone."""
        return "timer:(keepalive" in self.owner

    def __str__(self) -> str:
        return f"only on {self.on}: {self.local} -> {self.peer} {self.owner}"


def half_open(a: netns.Host, b: netns.Host) -> list[OneSided]:
    """Connections one host holds whose other end the other host does not: a side
    channel or UCX endpoint kept alive on one side only."""
    on_a, on_b = tcp_between(a, addresses_of(b)), tcp_between(b, addresses_of(a))
    mirrored_b = {(peer, local) for local, peer in on_b}
    only_a = [("a", a, *c) for c in sorted(on_a - mirrored_b)]
    only_b = [("b", b, *c) for c in sorted(on_b) if (c[1], c[0]) not in on_a]
    return [OneSided(on, local, peer, _owner(host, local, peer))
            for on, host, local, peer in only_a + only_b]  # fmt: skip


def _owner(inside: netns.Host, local: str, peer: str) -> str:
    shown = subprocess.run(
        ["ip", "netns", "exec", inside.namespace, "ss", "-H", "-t", "-n", "-p", "-o",
         "state", "established", "src", local, "dst", peer],
        capture_output=True, text=True,
    )  # fmt: skip
    return " ".join(part for part in shown.stdout.split() if part.startswith(("users:", "timer:")))


def until(check, seconds: float, step: float = 0.5):
    """`check()` until it returns something falsy or `seconds` ran out; its last result."""
    deadline = time.monotonic() + seconds
    result = check()
    while result and time.monotonic() < deadline:
        time.sleep(step)
        result = check()
    return result
