"""Whether a request runs on its decode instance alone or disaggregated.

Disaggregation pays for the prompt tokens decode lacks: prefill computes them on
another instance, so decode's batch of running requests is not held up by that
compute. It costs a router hop, a second request, and the KV's writes, all on the
first token's path. Measured here at 1 request/s (docs/benchmarks.md), push's TTFT
p50 was 1.26-1.44x a plain instance's at 1,024 prompt tokens and 1.14-1.15x at 3,072:
the fixed cost shrinks with the prompt, and at low load it never paid. So by
default (`auto`) a request runs on decode alone when what decode lacks of its
prompt is under `min_uncached_tokens` (2,048: between the two measured lengths,
and Dynamo's default), or when decode has nothing else in flight (nothing for
prefill's compute to hold up); else it is disaggregated, unless the least busy
prefill instance has at least `prefill_busier_tokens` (1,024) more prompt tokens
still to compute than decode: the prompt would wait behind them there, and a burst
of long prompts would pile onto the prefill instances while decode computes none.
The backlog is counted in tokens, not requests, since one long prompt being computed
holds up the next as a dozen short ones would. llm-d (`nonCachedTokens`) and vLLM's
router (`kv_aware`, 256) decide on the uncached part alone; Dynamo adds a ratio.

Pure: numbers in, a `Decision` with its reason out (the reason is a metric's label).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.errors import ConfigError

RULES = ("always", "auto", "never")


@dataclass(frozen=True)
class DecisionRule:
    """`always`: every request disaggregated (the router's behaviour without a rule);
    `never`: every request on its decode instance alone; `auto`: as the module says."""

    rule: str = "always"
    min_uncached_tokens: int = 2048
    alone_when_idle: bool = True
    prefill_busier_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"unknown disaggregation rule {self.rule!r}; known: {list(RULES)}")
        if self.min_uncached_tokens < 0:
            raise ConfigError(f"min_uncached_tokens must be >= 0, not {self.min_uncached_tokens}")
        if self.prefill_busier_tokens < 1:
            raise ConfigError(
                f"prefill_busier_tokens must be >= 1, not {self.prefill_busier_tokens}"
            )

    @property
    def needs_tokens(self) -> bool:
        """Whether deciding needs the prompt's tokens (asked of an instance)."""
        return self.rule == "auto"


@dataclass(frozen=True)
class Decision:
    disaggregate: bool
    reason: str

    @property
    def path(self) -> str:
        return "disaggregated" if self.disaggregate else "decode_alone"


def decide(
    rule: DecisionRule,
    prompt_tokens: int | None,
    cached_on_decode: int,
    decode_queue: int,
    *,
    decode_backlog: int = 0,
    prefill_backlog: int = 0,
) -> Decision:
    """The path for one request. `prompt_tokens` None: the prompt could not be
    tokenized (then it is disaggregated, as without a rule); `cached_on_decode`:
    tokens of its prefix the chosen decode instance holds; `decode_queue`: requests
    in flight there; the backlogs: prompt tokens still to compute before a first
    token at the chosen decode and at the least busy prefill instance."""
    if rule.rule == "always":
        return Decision(True, "rule_always")
    if rule.rule == "never":
        return Decision(False, "rule_never")
    if prompt_tokens is None:
        return Decision(True, "untokenized")
    uncached = max(prompt_tokens - cached_on_decode, 0)
    if uncached < rule.min_uncached_tokens:
        covered = cached_on_decode and prompt_tokens >= rule.min_uncached_tokens
        return Decision(False, "cached_on_decode" if covered else "short")
    if rule.alone_when_idle and decode_queue == 0:
        return Decision(False, "decode_idle")
    if prefill_backlog - decode_backlog >= rule.prefill_busier_tokens:
        return Decision(False, "prefill_busier")
    return Decision(True, "long_uncached")
