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
from kvpush.router.instances import Instance, Pool, Pools
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
        size = None if tokens is None else len(tokens)
        chains: dict[int, list[int]] = {}  # the prompt hashed once per block size
        if self.policy.placement == "prefix" and tokens is not None:
            prefill, decode, decision = self._scored_route(tokens, avoid, pairs, chains)
        else:  # the least loaded pair, as the pools pick
            prefill = self.prefill.pick(avoid=avoid)
            decode = self.decode.pick(avoid=avoid, fits=lambda d: pairs(prefill, d))
            whole = decode if self.whole is self.decode else self.whole.pick(avoid=avoid)
            decision = decide(self.policy.rule, size, self._cached(whole, tokens, chains),
                              whole.outstanding, decode_backlog=whole.computing,
                              prefill_backlog=prefill.computing)  # fmt: skip
            if not decision.disaggregate:
                prefill, decode = None, whole
        cached = self._cached(decode, tokens, chains)
        computing = 0
        if tokens is not None:  # what the instance computing the prompt lacks of it
            held = cached if prefill is None else self._cached(prefill, tokens, chains)
            computing = max(len(tokens) - held, 0)
        self.metrics.inc("router_decisions", path=decision.path, reason=decision.reason)
        if not decision.disaggregate:
            self.metrics.inc("router_whole_requests", role=decode.role)
        if tokens is not None:
            self.metrics.inc("router_prompt_tokens", len(tokens))
            self.metrics.inc("router_decode_cached_tokens", cached)
        log.debug("kvpush router: %s (%s): decode %s, prefill %s", decision.path,
                  decision.reason, decode.url, prefill and prefill.url)  # fmt: skip
        return Route(decode, prefill, decision, tokens, cached, computing)

    def _scored_route(
        self, tokens: list[int], avoid: Instance | None,
        pairs: Callable[[Instance, Instance], bool], chains: dict[int, list[int]],
    ) -> tuple[Instance | None, Instance, Decision]:  # fmt: skip
        """The instance for the whole request first; the decision from what it holds
        and its queue; then, if disaggregated, the pair scored jointly."""
        w, size = self.policy.weights, len(tokens)
        wholes = self._scored(self.whole.candidates(avoid=avoid), tokens, chains)
        prefills = self._scored(self.prefill.candidates(avoid=avoid), tokens, chains)
        whole: Any = place_alone(w, size, wholes, self.whole.turn())
        decision = decide(self.policy.rule, size, self._cached(whole, tokens, chains),
                          whole.outstanding, decode_backlog=whole.computing,
                          prefill_backlog=min(p.computing for p in prefills))  # fmt: skip
        if not decision.disaggregate:
            return None, whole, decision
        decodes = wholes
        if self.whole is not self.decode:
            decodes = self._scored(self.decode.candidates(avoid=avoid), tokens, chains)
        prefill, decode = place_pair(w, size, prefills, decodes, pairs,
                                     self.prefill.turn())  # fmt: skip
        return prefill, decode, decision  # type: ignore[return-value]

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

    def _cached(
        self, instance: Instance, tokens: list[int] | None, chains: dict[int, list[int]]
    ) -> int:
        if tokens is None:
            return 0
        return self.index.cached_tokens(instance.url, tokens, _block_size(instance), chains)

    def _scored(
        self, instances: list[Instance], tokens: list[int], chains: dict[int, list[int]]
    ) -> list[Candidate]:
        paces = self._paces()
        return [Candidate(i, self._cached(i, tokens, chains), i.outstanding, i.computing,
                          paces.get(i.url, 1.0)) for i in instances]  # fmt: skip

    def _paces(self) -> dict[str, float]:
        """Each instance's pace over the whole fleet's (pace.py); none without --pace."""
        if not self.policy.pace:
            return {}
        fleet = self.prefill.instances + self.decode.instances
        paced = factors((i.pace for i in fleet), time.monotonic())
        return dict(zip((i.url for i in fleet), paced, strict=True))


def _block_size(instance: Instance) -> int:
    identity = instance.any_identity()
    return identity.block_size if identity is not None else 0
