"""One request's route: the prompt's tokens (asked of an instance once), whether
it is disaggregated (decide.py), and where it runs (placement.py), from what the
prefix index (prefix.py) says each instance holds and the queues the router sees.

Without a rule that needs tokens and without prefix placement, nothing is asked:
the least loaded instances are picked, as the pools pick them, and every request
is disaggregated.

A request not disaggregated runs whole on one instance: a decode instance, or with
`aggregate_on` naming prefill too, any instance of either role, scored alike (the
prefix it holds, its queue). Each instance's record in the index is kept by the
requests it ran, whatever its role, so a session's next turn finds its prefix
there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpush.metrics import Metrics
from kvpush.router.decide import Decision, decide
from kvpush.router.instances import Instance, Pool, Pools, on_device
from kvpush.router.pace import factors
from kvpush.router.placement import Candidate, place_alone, place_pair
from kvpush.router.policy import RoutingPolicy
from kvpush.router.prefix import PrefixIndex

log = logging.getLogger(__name__)

# Fields of a chat request that shape its prompt, as vLLM's /tokenize takes them.
CHAT_PROMPT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                      "add_special_tokens", "chat_template", "chat_template_kwargs",
                      "tools", "documents")  # fmt: skip


@dataclass
class Route:
    decode: Instance
    prefill: Instance | None  # None: on decode alone
    decision: Decision
    tokens: list[int] | None
    cached: int = 0  # prompt tokens the decode instance holds, as the index says
    computing: int = 0  # prompt tokens its computing instance (prefill's, or decode) lacks

    @property
    def computer(self) -> Instance:
        """The instance that computes the prompt."""
        return self.prefill or self.decode

    def as_dict(self) -> dict[str, Any]:
        """For the request's trace. `decode`: the instance that decodes (on a whole
        request, possibly a prefill instance: `decode_role` says)."""
        return {"path": self.decision.path, "reason": self.decision.reason,
                "decode": self.decode.url, "decode_role": self.decode.role,
                "prefill": self.prefill and self.prefill.url,
                "prompt_tokens": None if self.tokens is None else len(self.tokens),
                "cached_on_decode": self.cached, "computing": self.computing}  # fmt: skip


@dataclass
class Computing:
    """A request's prompt tokens counted on the instance that computes them, from
    dispatch until `done()`: once that instance's part of the first token is out
    (prefill's answer; a whole request's first byte: `answered()`, which also
    charges the instance's pace), or the attempt ended."""

    instance: Instance
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens:
            self.instance.pace.busy(time.monotonic())
        self.instance.computing += self.tokens

    def answered(self) -> None:
        if self.tokens:
            self.instance.pace.answered(self.tokens, time.monotonic())
        self.done()

    def done(self) -> None:
        self.instance.computing -= self.tokens
        self.tokens = 0
        if not self.instance.computing:
            self.instance.pace.idle()


class Planner:
    def __init__(
        self, policy: RoutingPolicy, prefill: Pool, decode: Pool, index: PrefixIndex,
        metrics: Metrics,
    ) -> None:  # fmt: skip
        self.policy, self.prefill, self.decode = policy, prefill, decode
        self.index, self.metrics = index, metrics
        pools = {"prefill": prefill, "decode": decode}
        on = policy.aggregate_on
        # Where a whole request may run; decode's own pool (its turns) when only it.
        self.whole: Pool = decode if on == ("decode",) else Pools([pools[r] for r in on])

    async def tokens(
        self, http: aiohttp.ClientSession, endpoint: str, body: dict[str, Any],
        headers: dict[str, str],
    ) -> list[int] | None:  # fmt: skip
        """The prompt's token ids, from a decode instance's /tokenize (None where it
        cannot be said: a batch of prompts, an instance that will not tell)."""
        if not self.policy.needs_tokens:
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if endpoint.endswith("/chat/completions"):
            asked = {k: body[k] for k in CHAT_PROMPT_FIELDS if k in body}
        elif isinstance(prompt, str):
            asked = {"prompt": prompt}
        else:
            return None
        # The least busy decode; not a pick, which would take a round-robin turn.
        instance = min(self.decode.candidates(), key=lambda i: i.outstanding)
        try:
            async with http.post(
                instance.url + "/tokenize", json={"model": body.get("model"), **asked},
                headers=headers, timeout=aiohttp.ClientTimeout(total=10),
            ) as response:  # fmt: skip
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.metrics.inc("tokenize_failures", instance=instance.url)
            log.warning("kvpush router: %s/tokenize failed: %s", instance.url, exc)
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            self.metrics.inc("tokenize_failures", instance=instance.url)
            return None
        return tokens

    def plan(
        self,
        tokens: list[int] | None,
        avoid: Instance | None,
        pairs: Callable[[Instance, Instance], bool],
    ) -> Route:
        """Where a request goes; counted and logged with its reason."""
        chains: dict[int, list[int]] = {}  # the prompt hashed once per block size
        if self.policy.placement == "prefix" and tokens is not None:
            route = self._scored_route(tokens, avoid, pairs, chains)
        else:
            route = self._loaded_route(tokens, avoid, pairs, chains)
        decision = route.decision
        self.metrics.inc("router_decisions", path=decision.path, reason=decision.reason)
        if not decision.disaggregate:
            self.metrics.inc("router_whole_requests", role=route.decode.role)
        if tokens is not None:
            self.metrics.inc("router_prompt_tokens", len(tokens))
            self.metrics.inc("router_decode_cached_tokens", route.cached)
        log.debug("kvpush router: %s (%s): decode %s, prefill %s", decision.path,
                  decision.reason, route.decode.url,
                  route.prefill and route.prefill.url)  # fmt: skip
        return route

    def _loaded_route(
        self, tokens: list[int] | None, avoid: Instance | None,
        pairs: Callable[[Instance, Instance], bool], chains: dict[int, list[int]],
    ) -> Route:  # fmt: skip
        """The least loaded pair, as the pools pick; the decision from the instance
        a whole request would run on."""
        prefill_instance = self.prefill.pick(avoid=avoid)
        decode_instance = self.decode.pick(avoid=avoid, fits=lambda d: pairs(prefill_instance, d))
        whole_instance = (
            decode_instance if self.whole is self.decode else self.whole.pick(avoid=avoid)
        )
        whole = self._candidate(whole_instance, tokens, chains)
        prefill_backlog = sum(i.computing for i in on_device(prefill_instance, self._fleet()))
        decision = self._decide(tokens, whole, prefill_backlog)
        if not decision.disaggregate:
            return _route(decision, tokens, whole)
        decode = whole
        if whole_instance is not decode_instance:
            decode = self._candidate(decode_instance, tokens, chains)
        return _route(decision, tokens, decode, self._candidate(prefill_instance, tokens, chains))

    def _scored_route(
        self, tokens: list[int], avoid: Instance | None,
        pairs: Callable[[Instance, Instance], bool], chains: dict[int, list[int]],
    ) -> Route:  # fmt: skip
        """The instance for the whole request first; the decision from what it holds
        and its queue; then, if disaggregated, the pair scored jointly."""
        w, size, paces = self.policy.weights, len(tokens), self._paces()
        wholes = self._scored(self.whole.candidates(avoid=avoid), tokens, chains, paces)
        prefills = self._scored(self.prefill.candidates(avoid=avoid), tokens, chains, paces)
        whole = place_alone(w, size, wholes, self.whole.turn())
        decision = self._decide(tokens, whole, min(p.computing for p in prefills))
        if not decision.disaggregate:
            return _route(decision, tokens, whole)
        decodes = wholes
        if self.whole is not self.decode:
            decodes = self._scored(self.decode.candidates(avoid=avoid), tokens, chains, paces)
        prefill, decode = place_pair(w, size, prefills, decodes, pairs, self.prefill.turn())
        return _route(decision, tokens, decode, prefill)

    def _decide(self, tokens: list[int] | None, whole: Candidate, prefill_backlog: int) -> Decision:
        """Disaggregated or not, from the instance a whole request would run on."""
        size = None if tokens is None else len(tokens)
        return decide(self.policy.rule, size, whole.cached, whole.queue,
                      decode_backlog=whole.computing,
                      prefill_backlog=prefill_backlog)  # fmt: skip

    def has_other(self, instance: Instance, route: Route) -> bool:
        """Whether a request that failed on `instance` may be retried elsewhere: on
        an instance of its role, or for a whole request, any that serves them."""
        if route.prefill is None:
            return self.whole.has_other(instance)
        return (self.prefill if instance.role == "prefill" else self.decode).has_other(instance)

    def sent(self, route: Route) -> None:
        """A route was taken: the index learns what its instances now hold."""
        if route.tokens is None:
            return
        for instance in (route.decode, route.prefill):
            if instance is not None:
                self.index.sent(instance.url, route.tokens, _block_size(instance))

    def _candidate(
        self, instance: Instance, tokens: list[int] | None, chains: dict[int, list[int]],
        pace: float = 1.0,
    ) -> Candidate:  # fmt: skip
        cached = 0
        if tokens is not None:
            block_size = _block_size(instance)
            cached = self.index.cached_tokens(instance.url, tokens, block_size, chains)
        sharing = on_device(instance, self._fleet())
        computing = sum(i.computing for i in sharing)
        beside = sum(i.outstanding for i in sharing if i is not instance)
        return Candidate(instance, cached, instance.outstanding, computing, beside, pace)

    def _scored(
        self, instances: list[Instance], tokens: list[int], chains: dict[int, list[int]],
        paces: dict[str, float],
    ) -> list[Candidate]:  # fmt: skip
        return [self._candidate(i, tokens, chains, paces.get(i.url, 1.0)) for i in instances]

    def _fleet(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    def _paces(self) -> dict[str, float]:
        """Each instance's pace over the whole fleet's (pace.py); none without --pace."""
        if not self.policy.pace:
            return {}
        fleet = self._fleet()
        paced = factors((i.pace for i in fleet), time.monotonic())
        return dict(zip((i.url for i in fleet), paced, strict=True))


def _block_size(instance: Instance) -> int:
    identity = instance.any_identity()
    return identity.block_size if identity is not None else 0


def _route(
    decision: Decision, tokens: list[int] | None, decode: Candidate,
    prefill: Candidate | None = None,
) -> Route:  # fmt: skip
    """The route through the chosen candidates: what decode holds of the prompt, and
    what the instance computing it (prefill's, or decode alone) lacks."""
    computing = 0
    if tokens is not None:
        computing = max(len(tokens) - (prefill or decode).cached, 0)
    return Route(decode.key, prefill and prefill.key, decision, tokens, decode.cached,
                 computing)  # type: ignore[arg-type]  # fmt: skip
