"""What the producer and the consumer share about their transfers' states.

Each machine names its states in an enum and writes every move a transfer may make
into one TransitionTable. Every change of state goes through the table, so a move
nobody wrote down fails where it happens, naming the transfer, instead of showing up
later as a leaked or corrupted block; and the tables docs/protocol.md shows are
rendered from these, so the docs say what the code enforces.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

from kvpush.errors import ProtocolError

S = TypeVar("S", bound=enum.StrEnum)


class Stateful(Protocol):
    """A machine's per-transfer record, as far as moving it is concerned."""

    transfer_id: str
    state: Any


class TransitionTable(Mapping[S, frozenset[S]], Generic[S]):
    """Where each state of one machine's transfers may go; read-only."""

    def __init__(self, side: str, moves: Mapping[S, Iterable[S]]) -> None:
        self.side = side
        self._moves = {state: frozenset(targets) for state, targets in moves.items()}
        # A state added to the enum but not to the table would refuse every move out
        # of it at run time; refuse it at import instead.
        states = type(next(iter(self._moves)))
        missing = [str(state) for state in states if state not in self._moves]
        if missing:
            raise ValueError(f"{side}: no row for state(s) {missing} in its transition table")

    def __getitem__(self, state: S) -> frozenset[S]:
        return self._moves[state]

    def __iter__(self) -> Iterator[S]:
        return iter(self._moves)

    def __len__(self) -> int:
        return len(self._moves)

    def move(self, transfer: Stateful, to: S) -> None:
        """Put `transfer` in state `to`, or raise ProtocolError if the table forbids it."""
        if to not in self._moves[transfer.state]:
            raise ProtocolError(
                f"{self.side}: transfer {transfer.transfer_id!r} cannot go from "
                f"{transfer.state} to {to}"
            )
        transfer.state = to

    def markdown(self) -> str:
        """The table as docs/protocol.md shows it (final states, with no row, left out)."""
        rows = ["| from | may go to |", "|---|---|"]
        for state, targets in self._moves.items():
            if targets:
                rows.append(f"| `{state}` | {', '.join(f'`{t}`' for t in sorted(targets))} |")
        return "\n".join(rows)


E = TypeVar("E", bound=enum.StrEnum)


class EventTable(Generic[S, E]):
    """Where a record goes when an event meets it in a state: (state, event) -> state.

    A pair the table does not hold is a bug, refused where it happens, naming the
    record, the state and the event (the rule h11 keeps for its connections).
    """

    def __init__(self, side: str, rows: Mapping[S, Mapping[E, S]]) -> None:
        """`rows`: for each state, where each event it takes leads."""
        self.side = side
        self._moves = {(s, e): to for s, row in rows.items() for e, to in row.items()}

    def fire(self, record: Stateful, event: E) -> None:
        """Move `record` as `event` takes it from its state, or raise ProtocolError."""
        to = self._moves.get((record.state, event))
        if to is None:
            raise ProtocolError(
                f"{self.side}: transfer {record.transfer_id!r} cannot go from "
                f"{record.state} on {event}"
            )
        record.state = to

    def __contains__(self, pair: object) -> bool:
        return pair in self._moves

    def items(self) -> Iterable[tuple[tuple[S, E], S]]:
        return self._moves.items()

    def markdown(self) -> str:
        """The table as docs/protocol.md shows it: one row a (state, event) pair."""
        rows = ["| in | on | goes to |", "|---|---|---|"]
        rows += [f"| `{s}` | {e} | `{to}` |" for (s, e), to in self._moves.items()]
        return "\n".join(rows)


def allowed(side: str, states: type[S], *tables: EventTable[S, Any]) -> TransitionTable[S]:
    """Where each state may go by any event of `tables`: the moves, without their why."""
    moves: dict[S, set[S]] = {state: set() for state in states}
    for table in tables:
        for (state, _), to in table.items():
            moves[state].add(to)
    return TransitionTable(side, moves)
