"""What the request ledger did to its legs: each leg's beginning, every change of its
state, and its end, in order. The ledger hands them out (Ledger.take_moves) for
whoever keeps a request's timeline (kvpush.vllm.spans) to read, so that nobody keeps
a second account of where a request stands."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Moved:
    request_id: str
    leg: str  # "decode" | "prefill"
    before: str | None  # None: the leg begins
    after: str | None  # None: the leg ends (the engine finished its request)
    transfer_id: str = ""  # the transfer as its router named it


class MoveLog:
    """The moves since they were last taken."""

    def __init__(self) -> None:
        self._moves: list[Moved] = []

    def add(self, moved: Moved) -> None:
        self._moves.append(moved)

    def take(self) -> list[Moved]:
        moves, self._moves = self._moves, []
        return moves
