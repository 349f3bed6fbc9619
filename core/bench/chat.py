"""The chat workload (`kvpush bench serve --workload chat`): a seeded mix of
multi-turn sessions, short prompts and long prompts, the traffic where deciding per
request and placing by prefix pay.

- Sessions: each opens with a system prompt every session shares, then turns; a
  turn's prompt is the previous turn's, the assistant's reply to it and the user's
  next message, so each session's prefix grows and its next turn finds it cached
  where the last one ran. Turns of one session come in order, a think time apart.
- Short prompts: fresh, a few dozen to a few hundred tokens.
- Long prompts: fresh, about the grid's prompt length.

Requests are token ids (the completions endpoint), so a plain instance answers
them token for token alike and the grid's comparison holds. Arrivals are Poisson at
the cell's rate, each arrival a session's next turn, a short or a long prompt by
the shares below; the same seed gives the same requests in the same order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("fresh", "chat")
SESSION_SHARE = 0.5  # of arrivals: a session's turn
SHORT_SHARE = 0.3  # of arrivals: a short prompt (the rest: long)
TURNS = (2, 6)  # turns per session, inclusive
SYSTEM_TOKENS = 192  # the system prompt every session opens with
USER_TOKENS = (24, 96)
REPLY_TOKENS = (24, 64)  # the assistant's reply a next turn carries
SHORT_TOKENS = (32, 256)
THINK_S = 2.0  # mean seconds between a session's turns (exponential)
FIRST_ID, VOCAB = 6, 2040  # token ids above the tiny model's special tokens


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the start
    tokens: list[int]
    kind: str  # "turn", "short", "long"
    session: int | None = None


def requests(count: int, rate: float, seed: int, long_tokens: int) -> list[Request]:
    """`count` requests at `rate` a second; no prompt longer than `long_tokens`."""
    rng = random.Random(seed)
    system = _tokens(rng, min(SYSTEM_TOKENS, long_tokens // 4))
    sessions: list[_Session] = []
    out: list[Request] = []
    now = 0.0
    while len(out) < count:
        now += rng.expovariate(rate)
        draw = rng.random()
        if draw < SESSION_SHARE:
            out.append(_next_turn(rng, sessions, system, now, long_tokens))
        elif draw < SESSION_SHARE + SHORT_SHARE:
            out.append(Request(now, _tokens(rng, rng.randint(*SHORT_TOKENS)), "short"))
        else:
            length = rng.randint(long_tokens * 3 // 4, long_tokens)
            out.append(Request(now, _tokens(rng, length), "long"))
    return sorted(out, key=lambda r: r.at)


@dataclass
class _Session:
    index: int
    history: list[int]
    turns_left: int
    ready_at: float  # the next turn not before (the user reads, thinks, types)


def _next_turn(
    rng: random.Random, sessions: list[_Session], system: list[int], now: float, limit: int
) -> Request:
    """The next turn of a session ready for one, or the first of a new session."""
    ready = [s for s in sessions if s.turns_left and s.ready_at <= now]
    if ready:
        session = rng.choice(ready)
        reply = _tokens(rng, rng.randint(*REPLY_TOKENS))
        session.history = session.history + reply + _tokens(rng, rng.randint(*USER_TOKENS))
    else:
        session = _Session(len(sessions), system + _tokens(rng, rng.randint(*USER_TOKENS)),
                           rng.randint(*TURNS), now)  # fmt: skip
        sessions.append(session)
    if len(session.history) > limit:  # the context is full: the session ends here
        session.history = session.history[:limit]
        session.turns_left = 1
    session.turns_left -= 1
    session.ready_at = now + rng.expovariate(1 / THINK_S)
    return Request(now, list(session.history), "turn", session.index)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ID, FIRST_ID + VOCAB) for _ in range(count)]


def batch(
    count: int, rate: float, seed: int, long_tokens: int
) -> tuple[list[list[int]], list[float]]:
    """The prompts and send times `kvpush bench serve` takes for a cell."""
    chosen = requests(count, rate, seed, long_tokens)
    return [r.tokens for r in chosen], [r.at for r in chosen]
