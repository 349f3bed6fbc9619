"""How fast each instance computes prompt tokens, as the router sees it: the prompt
tokens its requests had it compute, over the time it had any to compute.

Placement counts work in prompt tokens (placement.py). That is right only where
every instance computes a token in the same time. In a fleet it often does not: a
newer accelerator beside an older one, an instance sharing its chips or cores
with others, one whose running decodes hold up each step. Such an instance's
queue is longer than its tokens say, and a prompt sent there waits longer.

The router learns each instance's pace from what it already watches. An instance
is busy from the moment a request with prompt tokens to compute is sent to it
until none remains. Each time one of its requests reaches its first token (a
whole request's first byte; a prefill leg's answer), the busy time since the last
such moment is charged to it with that request's tokens. Older charges fade by
`KEEP` at each new one, so the pace follows a change of load within a few dozen
requests, and by half every `HALF_LIFE_S` seconds, so the pace of an instance the
router stopped sending to is forgotten within a minute or so and it is tried again.
Time spent on an attempt that failed is charged to nothing.

Placement weighs an instance's tokens by its `factor`: its seconds per token over
the fleet's mean. A factor is 1 until the instance has been charged `LEARNT`
tokens (after fading), and it stays within [1/`BOUND`, `BOUND`], so a few slow
requests cannot take an instance out of use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

KEEP = 0.9  # the weight an older charge keeps at each new one
LEARNT = 4096  # prompt tokens charged (after fading) before a pace is used
BOUND = 2.0  # the most an instance's factor moves from 1, either way
HALF_LIFE_S = 20.0  # how fast charges fade with age


@dataclass
class Pace:
    tokens: float = 0.0  # prompt tokens charged, older ones faded
    seconds: float = 0.0  # busy seconds charged, faded alike
    _since: float | None = None  # monotonic time busy time is counted from; None: idle
    _at: float = 0.0  # monotonic time of the last charge

    def busy(self, now: float) -> None:
        """A request with prompt tokens to compute was sent to the instance."""
        if self._since is None:
            self._since = now

    def answered(self, tokens: int, now: float) -> None:
        """One of its requests reached its first token, having had it compute `tokens`."""
        if self._since is None:
            return
        keep = KEEP * self._faded(now)
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + (now - self._since)
        self._since = self._at = now

    def idle(self) -> None:
        """Nothing is left for it to compute: busy time stops counting, and what was
        counted since its last answer (an attempt that failed) is dropped."""
        self._since = None

    def seconds_per_token(self, now: float) -> float | None:
        """None until learnt, or once what was learnt has faded."""
        if self.tokens * self._faded(now) < LEARNT or self.seconds <= 0:
            return None
        return self.seconds / self.tokens

    def _faded(self, now: float) -> float:
        return 0.5 ** ((now - self._at) / HALF_LIFE_S)


def factors(paces: Iterable[Pace], now: float) -> list[float]:
    """Each pace's weight on its tokens: its seconds per token over the mean of those
    learnt, within the bound; 1 where not learnt, or where none is."""
    paces = list(paces)
    learnt = [p.seconds_per_token(now) for p in paces]
    known = [s for s in learnt if s is not None]
    if not known:
        return [1.0] * len(paces)
    mean = sum(known) / len(known)
    return [1.0 if s is None else min(max(s / mean, 1 / BOUND), BOUND) for s in learnt]
