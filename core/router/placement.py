"""Where a request runs: its decode instance, and for a disaggregated one the
(prefill, decode) pair, scored jointly.

A pair's cost is counted in prompt tokens:
- compute on prefill: the tokens prefill must compute (the prompt less the prefix
  prefill holds), weighed `compute`;
- transfer to decode: the tokens decode must load (less the prefix it holds:
  decode loads only what it lacks), weighed `transfer`;
- the compute already queued on each: the prompt tokens its requests still
  compute before their first token (the router counts them, as Dynamo's router
  counts active prefill blocks), and those of the instances sharing its device
  (instances.on_device), weighed `compute`, since a new prompt waits for them;
- the queue on each: its requests in flight and those of the instances sharing its
  device, each as `queue_tokens` tokens. A request decoding beside a new prompt on
  its device holds it up at least as much as one on its own instance (`kvpush bench
  inflight`, docs/router.md), so an idle instance beside busy ones is no cheaper.
With `--pace`, what an instance computes and queues is weighed by its pace
(pace.py): 2 where it has been computing tokens twice as slowly as the fleet's
mean. A request on decode alone costs the tokens decode must compute, the compute
queued there and decode's queue, at decode's pace. The lowest cost wins; ties go
round robin. A session's next turn shares its prefix, so the instance that holds
it wins unless what waits there outweighs the prefix: one long prompt being
computed does, as a count of requests would not say. vLLM's router takes the least
loaded instance when loads differ by more than a threshold; here the queue terms
do that, in the same units as the prefix saved.

Pure: candidates (instances with their cached tokens and queues) in, the chosen
candidates out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpush.errors import ConfigError


@dataclass(frozen=True)
class Weights:
    compute: float = 1.0  # a prompt token prefill computes
    transfer: float = 0.25  # a prompt token decode loads (a write, not a compute)
    queue_tokens: int = 64  # a request in flight, in prompt tokens

    def __post_init__(self) -> None:
        if min(self.compute, self.transfer, self.queue_tokens) < 0:
            raise ConfigError(f"placement weights must be >= 0: {self}")


@dataclass(frozen=True)
class Candidate:
    """An instance as scoring sees it."""

    key: object  # what the caller picks (an Instance)
    cached: int  # prompt tokens it holds
    queue: int  # requests in flight there
    computing: int = 0  # prompt tokens its requests in flight compute before a first token
    beside: int = 0  # requests in flight on the other instances sharing its device
    pace: float = 1.0  # its seconds per prompt token over the fleet's mean (pace.py)


def alone_cost(w: Weights, prompt: int, decode: Candidate) -> float:
    return decode.pace * _own(w, max(prompt - decode.cached, 0), decode)


def pair_cost(w: Weights, prompt: int, prefill: Candidate, decode: Candidate) -> float:
    # Decode's own queued compute counts too: its next step, the one that takes the
    # KV and samples, runs with the prompts it is computing.
    on_prefill = prefill.pace * _own(w, max(prompt - prefill.cached, 0), prefill)
    on_decode = decode.pace * _own(w, 0, decode)
    return on_prefill + on_decode + w.transfer * max(prompt - decode.cached, 0)


def _own(w: Weights, computed: int, instance: Candidate) -> float:
    """An instance's share of a cost at the fleet's mean pace: what it computes of
    the prompt, what it and its device compute already, and their queues."""
    queued = instance.queue + instance.beside
    return w.compute * (computed + instance.computing) + w.queue_tokens * queued


T = TypeVar("T")


def cheapest(costs: list[tuple[float, T]], turn: int) -> T:
    """What the lowest cost was paid for; among equals the `turn`-th (round robin)."""
    least = min(cost for cost, _ in costs)
    tied = [key for cost, key in costs if cost == least]
    return tied[turn % len(tied)]


def place_alone(w: Weights, prompt: int, decodes: list[Candidate], turn: int) -> Candidate:
    return cheapest([(alone_cost(w, prompt, d), d) for d in decodes], turn)


def place_pair(
    w: Weights,
    prompt: int,
    prefills: list[Candidate],
    decodes: list[Candidate],
    pairs: Callable[[Any, Any], bool] | None = None,
    turn: int = 0,
) -> tuple[Candidate, Candidate]:
    """The cheapest (prefill, decode); `pairs(p.key, d.key)`: whether the two may
    pair (where none may, every pair is scored and the caller refuses the pick)."""
    every = [(pair_cost(w, prompt, p, d), (p, d)) for p in prefills for d in decodes]
    allowed = [c for c in every if pairs is None or pairs(c[1][0].key, c[1][1].key)]
    return cheapest(allowed or every, turn)
