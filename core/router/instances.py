"""The vLLM instances behind the router, and how one is picked for a request."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpush.errors import ConfigError


@dataclass
class Instance:
    """One vLLM server. Prefill instances carry their kvpush identity once learned."""

    url: str
    role: str  # "prefill" | "decode"
    identity_url: str | None = None
    outstanding: int = 0
    # Its kvpush identity by data-parallel rank (each DP rank is an engine of its own).
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    ejected_until: float = 0.0  # monotonic time; picked again only after it
    _turn: int = 0

    def learn(self, identity: dict[str, Any]) -> None:
        self.ranks[int(identity.get("dp_rank", 0))] = identity

    def forget(self) -> None:
        """It may come back as a new incarnation: learn it afresh."""
        self.ranks.clear()

    def pick_rank(self) -> tuple[int | None, dict[str, Any]]:
        """The DP rank the next prefill leg is pinned to (round robin over the ranks
        learnt) and its identity; rank None when the instance is not data parallel,
        so vLLM's own balancing may place the leg."""
        ranks = sorted(self.ranks)
        rank = ranks[self._turn % len(ranks)]
        self._turn += 1
        identity = self.ranks[rank]
        return (rank if identity.get("data_parallel") else None), identity

    def available(self, now: float) -> bool:
        return now >= self.ejected_until

    @classmethod
    def parse(cls, spec: str, role: str) -> Instance:
        """ "http://host:8100" or "http://host:8100,bootstrap=8998" (identity endpoint port)."""
        url, *options = (part.strip() for part in spec.split(","))
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{role} instance {spec!r} is not an http(s) URL")
        identity_url = None
        for option in options:
            key, _, value = option.partition("=")
            if key != "bootstrap" or not value.isdigit():
                raise ConfigError(
                    f"unknown option {option!r} in {spec!r}; the only option is bootstrap=PORT"
                )
            identity_url = f"http://{parts.hostname}:{value}/query"
        if identity_url and role != "prefill":
            raise ConfigError(f"bootstrap= belongs to prefill instances, not {spec!r}")
        return cls(url.rstrip("/"), role, identity_url)


class Pool:
    """Least outstanding work first; round-robin among equals; ejected instances
    only when nothing else is left."""

    def __init__(self, instances: list[Instance]) -> None:
        if not instances:
            raise ConfigError("a pool needs at least one instance")
        self.instances = instances
        self._turn = itertools.count()

    def pick(self, avoid: Instance | None = None) -> Instance:
        now = time.monotonic()
        others = [i for i in self.instances if i is not avoid] or self.instances
        candidates = [i for i in others if i.available(now)] or others
        least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def has_other(self, instance: Instance) -> bool:
        return any(i is not instance for i in self.instances)
