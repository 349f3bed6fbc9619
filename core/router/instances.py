"""The vLLM instances behind the router, and how one is picked for a request."""

from __future__ import annotations

import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpush.errors import ConfigError
from kvpush.identities import InstanceIdentity
from kvpush.layout import block_size_problem, tp_problem
from kvpush.router.pace import Pace

log = logging.getLogger(__name__)


@dataclass
class Instance:
    """One vLLM server, with its kvpush identity once learned (a prefill's, to name it
    in decode legs; either's, to check a pair before sending it a request)."""

    url: str
    role: str  # "prefill" | "decode"
    identity_url: str | None = None
    outstanding: int = 0
    # Prompt tokens its requests in flight compute before their first token (placement
    # weighs them: a prompt sent here waits for them); the router's estimate.
    computing: int = 0
    pace: Pace = field(default_factory=Pace, repr=False)  # how fast it computes them
    # Its kvpush identity by data-parallel rank (each DP rank is an engine of its own).
    ranks: dict[int, InstanceIdentity] = field(default_factory=dict, repr=False)
    ejected_until: float = 0.0  # monotonic time; picked again only after it
    identity_asked: float = float("-inf")  # monotonic time its identity was last asked
    up: bool = True  # as its last /health probe found it (none yet: presumed up)
    draining: bool = False  # takes no new requests; forgotten once none is in flight
    kv_events: str | None = None  # the ZMQ endpoint its vLLM publishes KV-cache events on
    # What it computes on, where instances share one (a GPU, a Neuron core, CPU
    # cores): placement counts their prompt compute as one (`on_device`). None: its own.
    device: str | None = None
    # Its legs still running after the router answered the client (a prefill leg
    # finishing on its own): a drain waits for them too.
    pending: set[Any] = field(default_factory=set, repr=False)
    _turn: int = 0

    def learn(self, identity: InstanceIdentity) -> None:
        self.ranks[identity.dp_rank] = identity

    def forget(self) -> None:
        """It may come back as a new incarnation: learn it afresh."""
        self.ranks.clear()

    def pick_rank(self) -> tuple[int | None, InstanceIdentity]:
        """The DP rank the next prefill leg is pinned to (round robin over the ranks
        learnt) and its identity; rank None when the instance is not data parallel,
        so vLLM's own balancing may place the leg."""
        ranks = sorted(self.ranks)
        rank = ranks[self._turn % len(ranks)]
        self._turn += 1
        identity = self.ranks[rank]
        return (rank if identity.data_parallel else None), identity

    def any_identity(self) -> InstanceIdentity | None:
        """Its identity as far as pairing goes (every DP rank shares its shape)."""
        return next(iter(self.ranks.values()), None)

    def available(self, now: float) -> bool:
        return now >= self.ejected_until

    @classmethod
    def parse(cls, spec: str, role: str) -> Instance:
        """ "http://host:8100" or "http://host:8100,identity=7900" (its identity
        endpoint's port, on the same host; `bootstrap=` is the same option), and
        optionally kv_events=tcp://HOST:PORT and device=LABEL."""
        url, *options = (part.strip() for part in spec.split(","))
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{role} instance {spec!r} is not an http(s) URL")
        try:
            port = parts.port  # urlsplit checks the port only when asked
        except ValueError:  # past 65535, or not a number
            port = 0
        if port == 0:
            raise ConfigError(f"{role} instance {spec!r}: its port must be an integer in 1-65535")
        identity_url = kv_events = device = None
        for option in options:
            key, _, value = option.partition("=")
            if key.strip() == "kv_events":
                kv_events = _zmq_endpoint(value.strip(), spec)
                continue
            if key.strip() == "device":
                device = _device_label(value.strip(), spec)
                continue
            identity_port = _identity_port(option, spec)
            identity_url = f"http://{bracketed(parts.hostname)}:{identity_port}/query"
        instance = cls(_api_base(url.rstrip("/"), role), role, identity_url)
        instance.kv_events, instance.device = kv_events, device
        return instance


# "bootstrap" is an alias of "identity", so that commands already written keep working.
IDENTITY_OPTIONS = ("identity", "bootstrap")


def _identity_port(option: str, spec: str) -> int:
    key, _, value = option.partition("=")
    if key.strip() not in IDENTITY_OPTIONS:
        raise ConfigError(
            f"unknown option {option!r} in {spec!r}; the options are identity=PORT "
            "(the instance's identity_port; bootstrap=PORT is the same), "
            "kv_events=tcp://HOST:PORT (where its vLLM publishes KV-cache events) and "
            "device=LABEL (instances with one label compute on one device)"
        )
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ConfigError(f"{option!r} in {spec!r}: the port must be an integer in 1-65535")
    return port


def _zmq_endpoint(value: str, spec: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("tcp", "ipc") or not (parts.netloc or parts.path):
        raise ConfigError(
            f"kv_events={value!r} in {spec!r}: a ZMQ endpoint such as tcp://host:5557 "
            "(where the instance's --kv-events-config publishes)"
        )
    return value


def _device_label(value: str, spec: str) -> str:
    if not re.fullmatch(r"[\w.:/@-]{1,64}", value):
        raise ConfigError(
            f"device={value!r} in {spec!r}: a label of 1-64 letters, digits and . : / @ - _ "
            "(one name for the accelerator or the CPU cores the instances share)"
        )
    return value


def on_device(instance: Instance, fleet: list[Instance]) -> list[Instance]:
    """The instances computing where `instance` does: itself, and where it names a
    device, every instance naming that device. Their engines take turns on it, so a
    prompt sent to any of them waits for the prompts all of them are computing."""
    if instance.device is None:
        return [instance]
    return [i for i in fleet if i.device == instance.device]


def _api_base(url: str, role: str) -> str:
    """The URL the router adds `/v1/completions` to. The OpenAI base URL a client is
    given ends in /v1, so that is what gets pasted here; kept, every request would
    go to /v1/v1/completions and fail with a 404. Its meaning is not in doubt, so it
    is taken off, and the operator told."""
    if not url.endswith("/v1"):
        return url
    log.warning(
        "kvpush router: %s instance %s: dropping its trailing /v1 (the router adds "
        "/v1/completions itself); using %s",
        role, url, url.removesuffix("/v1"),
    )  # fmt: skip
    return url.removesuffix("/v1")


def bracketed(host: str) -> str:
    """A host as a URL names it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


class Pool:
    """Least outstanding work first; round-robin among equals; ejected instances
    only when nothing else is left; draining instances never."""

    def __init__(self, instances: list[Instance]) -> None:
        if not instances:
            raise ConfigError("a pool needs at least one instance")
        self.instances = instances
        self._turn = itertools.count()

    def candidates(self, avoid: Instance | None = None, fits: Any = None) -> list[Instance]:
        """The instances a request may go to. `fits(instance)`: whether it may take
        this request; instances that do not are offered only when none does (and the
        caller then refuses the request)."""
        now = time.monotonic()
        open_ = [i for i in self.instances if not i.draining]
        if not open_:
            raise NoInstance(f"every {self.what} is draining")
        suited = [i for i in open_ if fits is None or fits(i)] or open_
        others = [i for i in suited if i is not avoid] or suited
        return [i for i in others if i.available(now)] or others

    def pick(self, avoid: Instance | None = None, fits: Any = None) -> Instance:
        candidates = self.candidates(avoid, fits)
        least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        return tied[self.turn() % len(tied)]

    @property
    def what(self) -> str:
        return f"{self.instances[0].role} instance"

    def turn(self) -> int:
        return next(self._turn)

    def has_other(self, instance: Instance) -> bool:
        return any(i is not instance and not i.draining for i in self.instances)

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)


class Pools(Pool):
    """Several pools picked from as one (the instances that may serve a whole
    request: decode's, and prefill's with `--aggregate-on prefill,decode`). Their
    instances are read at each pick, so members added or drained count at once."""

    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools
        self._turn = itertools.count()

    @property  # type: ignore[override]
    def instances(self) -> list[Instance]:
        return [i for pool in self.pools for i in pool.instances]

    @property
    def what(self) -> str:
        return "instance serving whole requests"


class NoInstance(ConfigError):
    """No instance of a role may take requests now."""


def check_listing(
    prefill: list[Instance], decode: list[Instance], aggregate_on: tuple[str, ...]
) -> None:
    """ConfigError where a server is listed twice: it would be two records, each
    counting half its load. Twice under one role is a slip; under both roles it is
    one only where prefill instances serve whole requests too (`aggregate_on`)."""
    for role, listed in (("prefill", prefill), ("decode", decode)):
        urls = [i.url for i in listed]
        if twice := sorted({u for u in urls if urls.count(u) > 1}):
            raise ConfigError(f"{', '.join(twice)} listed twice as a {role} instance")
    both = sorted({i.url for i in prefill} & {i.url for i in decode})
    if both and "prefill" in aggregate_on:
        raise ConfigError(
            f"{', '.join(both)} listed as both a prefill and a decode instance: with "
            "--aggregate-on prefill,decode a prefill instance serves whole requests "
            "already; list it once"
        )


def pairing_problem(prefill: InstanceIdentity, decode: InstanceIdentity) -> str | None:
    """Why a prefill and a decode instance (their identities) cannot exchange KV, or
    None: the rules the two workers' handshake would apply, checked before a request
    is sent to fail there."""
    if prefill.transfer_mode != decode.transfer_mode:
        return (
            f"transfer modes differ: prefill {prefill.transfer_mode}, decode {decode.transfer_mode}"
        )
    if prefill.kv_groups != decode.kv_groups:
        return (
            f"KV cache groups differ: prefill {prefill.kv_groups}, decode {decode.kv_groups} "
            "(another model, or vLLM's hybrid KV cache manager on one side only)"
        )
    if prefill.kv_states != decode.kv_states:
        return (
            f"recurrent-state groups differ: prefill {prefill.kv_states}, decode "
            f"{decode.kv_states} (another model)"
        )
    if prefill.kv_states and prefill.tp_size != decode.tp_size:
        return (
            f"prefill runs TP {prefill.tp_size} and decode TP {decode.tp_size} with "
            "recurrent state (Mamba, gated DeltaNet): such models pair at equal TP only"
        )
    if prefill.block_size and decode.block_size:
        problem = block_size_problem(
            prefill.block_size, decode.block_size, prefill.block_pages, decode.block_pages
        )
        if problem:
            return problem
    return tp_problem(prefill.tp_size, decode.tp_size, 0)
