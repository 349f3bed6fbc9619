"""Prefill KV that the router says no decode will claim, let go at its word.

Decode announces a transfer when its engine takes the decode leg in, and cancels it if
the leg ends before it claims the KV; a leg that never reaches decode's engine (decode
refused it, was unreachable, or the client left first) tells prefill nothing, and
prefill would hold the KV for its whole lease. Only the router knows, so prefill's
answer carries a release token (kvpush.protocol.auth.release_token: this boot's,
for this transfer) and the router hands it back:

    POST /kvpush/release {"transfer_id": T, "token": "..."}   on the identity endpoint

A good token has the workers release T's held KV unless a consumer claimed or
announced it (kvpush.protocol.producer.Producer.release_unclaimed), through the
engine's own step plan. The endpoint's thread never touches the engine's state: it
hands the ask over, rings the doorbell so that an idle engine steps at once, and
waits at most ANSWER_WAIT_S for the workers' verdicts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvpush.engine.ledger import Ledger
from kvpush.protocol.auth import release_key, release_token, release_token_ok
from kvpush.vllm.wake import Ringer

ANSWER_WAIT_S = 2.0  # the endpoint answers within this, the engine's step permitting
MAX_ASKS = 1024  # asks in flight at once; more are refused, not queued
FORGET_S = 60.0  # an ask whose verdicts never came is dropped after this
RELEASED = "released"  # a worker rank's verdict when it let the KV go
_FIELD_CHARS = 1024  # longer than any transfer id or token

Answer = tuple[int, dict[str, Any]]


@dataclass
class _Ask:
    """One POST: the dispatch it names, and each held leg's verdict per worker rank."""

    transfer_id: str
    made: float = field(default_factory=time.monotonic)
    verdicts: dict[str, dict[int, str]] = field(default_factory=dict)  # engine transfer id
    answer: Answer | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, answer: Answer) -> None:
        self.answer = answer
        self.done.set()


def _error(status: int, reason: str, message: str) -> Answer:
    return status, {"error": message, "reason": reason}


class Releases:
    """The release tokens this instance hands out, and the asks that bring them back.

    `ask` runs on the identity endpoint's threads; `plan` and `heard` on the engine's
    (vLLM's scheduler calls). Between them only a locked list of new asks, and each
    ask's event, cross."""

    def __init__(self, legs: Ledger, world: int, doorbell_port: int, secret: bytes) -> None:
        self._legs = legs
        self._world = world  # worker ranks: each gives its verdict
        self._key = release_key(secret) if secret else b""  # insecure: no tokens at all
        self._ringer = Ringer(doorbell_port)
        self._lock = threading.Lock()
        self._new: list[_Ask] = []  # handed over, not yet planned
        self._open: list[_Ask] = []  # planned, waiting for the workers (engine thread only)
        self._in_flight = 0  # asks not yet answered, for MAX_ASKS

    def token(self, epoch: str, transfer_id: str) -> str | None:
        """The token a prefill answer for `transfer_id` carries (None when insecure)."""
        return release_token(self._key, epoch, transfer_id) if self._key else None

    # -- the identity endpoint's threads ------------------------------------------------

    def ask(self, body: Any, epoch: str) -> Answer:
        """A POST /kvpush/release, answered: (HTTP status, JSON body)."""
        if not isinstance(body, dict):
            return _error(400, "bad_request", "the body must be a JSON object")
        transfer_id, token = body.get("transfer_id"), body.get("token")
        if not (_short_text(transfer_id) and _short_text(token)):
            return _error(400, "bad_request", 'the body needs "transfer_id" and "token" strings')
        if not self._key:
            return _error(
                403, "insecure", "this instance runs without a shared secret: it hands out no "
                "release tokens and takes none",
            )  # fmt: skip
        if not release_token_ok(self._key, epoch, transfer_id, token):
            return _error(
                403, "bad_token", f"the token is not this instance's for transfer "
                f"{transfer_id!r} (forged, another transfer's, or from before a restart)",
            )  # fmt: skip
        if not self._legs.held_under(transfer_id):
            return _unknown(transfer_id)
        ask = _Ask(transfer_id)
        with self._lock:
            if self._in_flight >= MAX_ASKS:
                return _error(503, "busy", f"{MAX_ASKS} releases are in flight already")
            self._in_flight += 1
            self._new.append(ask)
        self._ringer.ring()  # an idle engine steps now, not at its idle bound
        answered = ask.done.wait(ANSWER_WAIT_S)
        if not answered or ask.answer is None:
            return 202, {"transfer_id": transfer_id, "reason": "pending",
                         "detail": "asked; the workers have not answered yet"}  # fmt: skip
        return ask.answer

    # -- the engine's thread ------------------------------------------------------------

    def plan(self) -> None:
        """A step is being planned: the asks handed over go into its plan."""
        with self._lock:
            new, self._new = self._new, []
        for ask in new:
            held = self._legs.held_under(ask.transfer_id)
            if not held:  # claimed and delivered, or released, since the POST came
                self._finish(ask, _unknown(ask.transfer_id))
                continue
            ask.verdicts = {leg.transfer_id: {} for leg in held}
            self._legs.release(held)
            self._open.append(ask)
        self._forget_old(time.monotonic())

    def heard(self, verdicts: dict[str, dict[int, str]] | None) -> None:
        """What the workers' release did, per transfer and rank (a step's output)."""
        if not verdicts:
            return
        for ask in list(self._open):
            for tid, ranks in ask.verdicts.items():
                ranks.update(verdicts.get(tid, {}))
            if all(len(ranks) >= self._world for ranks in ask.verdicts.values()):
                self._open.remove(ask)
                self._finish(ask, _settled(ask))

    def close(self) -> None:
        self._ringer.close()

    def _forget_old(self, now: float) -> None:
        for ask in [a for a in self._open if now - a.made > FORGET_S]:
            self._open.remove(ask)
            self._finish(ask, _error(504, "no_answer", "the workers never answered"))

    def _finish(self, ask: _Ask, answer: Answer) -> None:
        with self._lock:
            self._in_flight -= 1
        ask.finish(answer)


def _short_text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _FIELD_CHARS


def _unknown(transfer_id: str) -> Answer:
    return _error(
        404, "unknown_transfer", f"no KV is held here for transfer {transfer_id!r}: "
        "claimed or released already, or never computed here",
    )  # fmt: skip


# Why KV is kept, in words, most telling first: a consumer's claim or announcement
# beats a record that ended meanwhile.
_KEPT = {
    "claimed": "a decode instance claimed it, and its word wins",
    "announced": "a decode instance announced it, and its word wins",
    "ended": "its transfer ended meanwhile",
    "unknown": "the workers hold no transfer of it",
}


def _settled(ask: _Ask) -> Answer:
    """The answer once every rank gave its verdict on every held leg of the ask."""
    kept = {v for ranks in ask.verdicts.values() for v in ranks.values() if v != RELEASED}
    released = sum(all(v == RELEASED for v in ranks.values()) for ranks in ask.verdicts.values())
    if not kept:
        return 200, {"transfer_id": ask.transfer_id, "released": released}
    order = list(_KEPT)
    why = min(kept, key=lambda v: order.index(v) if v in _KEPT else len(order))
    message = f"the KV of transfer {ask.transfer_id!r} is kept: {_KEPT.get(why, why)}"
    return 409, {"error": message, "reason": why, "released": released}
