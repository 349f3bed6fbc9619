"""The routing policy: the decision rule (decide.py), the placement and its weights
(placement.py), as `kvpush router` takes them on its command line. No aiohttp here:
the command line reads this before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpush.errors import ConfigError
from kvpush.router.decide import RULES, DecisionRule
from kvpush.router.placement import Weights

PLACEMENTS = ("load", "prefix")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoutingPolicy:
    rule: DecisionRule = field(default_factory=DecisionRule)
    placement: str = "load"  # "load": least loaded; "prefix": scored (placement.py)
    weights: Weights = field(default_factory=Weights)
    # The roles whose instances serve a request that is not disaggregated, whole.
    aggregate_on: tuple[str, ...] = ("decode",)
    pace: bool = False  # prefix placement weighs each instance's tokens by its pace

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}; known: {list(PLACEMENTS)}")
        if not self.aggregate_on or set(self.aggregate_on) - set(ROLES):
            raise ConfigError(f"aggregate on {list(self.aggregate_on)}? name one or both of "
                              f"{list(ROLES)}")  # fmt: skip

    @property
    def needs_tokens(self) -> bool:
        return self.rule.needs_tokens or self.placement == "prefix"


# The numbers `kvpush router` takes: flag, default, what it says.
NUMBERS = (
    ("--min-uncached-tokens", DecisionRule.min_uncached_tokens,
     "auto: a prompt of which decode lacks fewer tokens runs on decode alone"),
    ("--prefill-busier-tokens", DecisionRule.prefill_busier_tokens,
     "auto: decode alone when the least busy prefill has N more prompt tokens to compute"),
    ("--queue-tokens", Weights.queue_tokens,
     "prefix placement: a request in flight weighs as N prompt tokens"),
)  # fmt: skip


def add_options(parser: Any) -> None:
    """`kvpush router`'s options for the decision and placement."""
    parser.add_argument(
        "--disaggregate", choices=RULES, default=DecisionRule.rule,
        help="which requests get a prefill leg: always; never (decode alone); auto: those "
        "whose uncached prompt is long while decode is busy (docs/router.md)",
    )  # fmt: skip
    for flag, default, meaning in NUMBERS:
        parser.add_argument(flag, type=int, default=default, metavar="N", help=meaning)
    parser.add_argument(
        "--no-alone-when-idle", dest="alone_when_idle", action="store_false",
        help="auto: disaggregate a long prompt even when its decode has nothing in flight",
    )  # fmt: skip
    parser.add_argument(
        "--placement", choices=PLACEMENTS, default="load",
        help="load: least loaded instances; prefix: scored by the prefix each holds and "
        "the queues (KV events where an instance names kv_events=, else the router's index)",
    )  # fmt: skip
    parser.add_argument(
        "--pace", action="store_true",
        help="prefix placement: weigh each instance's prompt tokens by how fast it has "
        "been computing them, for fleets whose instances differ in speed (docs/router.md)",
    )  # fmt: skip
    parser.add_argument(
        "--aggregate-on", type=roles, default="decode", metavar="ROLES",
        help="the instances a request not disaggregated runs on: decode, or "
        "prefill,decode (prefill instances serve whole requests too, scored alike)",
    )  # fmt: skip
    parser.add_argument(
        "--instances-file", metavar="PATH",
        help="more instances, 'prefill SPEC' or 'decode SPEC' a line, read again each "
        "health interval: new lines are added, removed ones drained",
    )  # fmt: skip


def roles(text: str) -> tuple[str, ...]:
    """ "decode,prefill" -> ("prefill", "decode"): the roles named, in one order."""
    named = {part.strip() for part in text.split(",") if part.strip()}
    if not named or named - set(ROLES):
        raise ConfigError(f"--aggregate-on takes decode or prefill,decode, not {text!r}")
    return tuple(role for role in ROLES if role in named)


def policy_of(args: Any) -> RoutingPolicy:
    rule = DecisionRule(args.disaggregate, args.min_uncached_tokens, args.alone_when_idle,
                        args.prefill_busier_tokens)  # fmt: skip
    return RoutingPolicy(rule, args.placement, Weights(queue_tokens=args.queue_tokens),
                         args.aggregate_on, args.pace)  # fmt: skip
