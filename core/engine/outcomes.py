"""A worker's half of the request ledger: which engine request each transfer serves,
and when the engine may hear of each outcome.

The scheduler's Ledger (kvpush.engine.ledger) names, in each step's plan, the
request every claimed or produced transfer belongs to; workers hear of transfers by
id only (the protocol knows no requests). Outcomes keeps one record per request's
transfer, with its state, and turns each transfer's end into what vLLM's contract
asks of a worker: the requests finished sending (a prefill's blocks may be reused:
the producer let go, and the engine finished the request too), finished receiving,
and failed receiving. Plain values in and out, like the ledger.

    receiving --landed--> landed      (reported, then forgotten)
        '-----failed----> failed      (so is a leg refused at once)
    sending --producer let go--> let go --engine finished it too--> reported

A progressive transfer the producer let go between chunks (decode cancelled) is
still named by each later step's plan until its request's last step: its record
stays let go, and is not held again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvpush.protocol.states import TransitionTable


class Outcome(enum.StrEnum):
    RECEIVING = "receiving"  # decode: claimed; its landing is awaited
    LANDED = "landed"  # decode: landed, to report
    FAILED = "failed"  # decode: failed (or refused at once), to report
    SENDING = "sending"  # prefill: the producer holds the blocks
    LET_GO = "let_go"  # prefill: the producer let go; reported once the engine finished it


OC = Outcome
OUTCOME_TRANSITIONS: TransitionTable[Outcome] = TransitionTable(
    "worker outcome",
    {
        OC.RECEIVING: {OC.LANDED, OC.FAILED},
        OC.SENDING: {OC.LET_GO},
        OC.LANDED: set(),
        OC.FAILED: set(),
        OC.LET_GO: set(),
    },
)


@dataclass
class _Record:
    request_id: str
    transfer_id: str  # "" for a leg refused before it claimed anything
    state: Outcome
    engine_finished: bool = False  # a prefill's request the engine finished


class Outcomes:
    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}  # by request id
        self._by_transfer: dict[str, _Record] = {}  # the ones still waiting, by transfer id

    # -- from the step's plan -------------------------------------------------------

    def receiving(self, request_id: str, transfer_id: str) -> None:
        self._begin(_Record(request_id, transfer_id, OC.RECEIVING))

    def sending(self, request_id: str, transfer_id: str) -> None:
        """Named by a step's plan (every chunk's step names it again)."""
        record = self._records.get(request_id)
        if record is not None and record.transfer_id == transfer_id:
            return  # held already, or let go between chunks: the producer ignores the rest
        self._begin(_Record(request_id, transfer_id, OC.SENDING))

    def rejected(self, request_id: str) -> None:
        """A decode leg that fails at once: its load is reported failed."""
        self._records[request_id] = _Record(request_id, "", OC.FAILED)

    def _begin(self, record: _Record) -> None:
        self._records[record.request_id] = record
        self._by_transfer[record.transfer_id] = record

    # -- from the node's outcomes ---------------------------------------------------

    def sender(self, transfer_id: str) -> str | None:
        """The prefill request a transfer sends, while its blocks are held."""
        record = self._by_transfer.get(transfer_id)
        return record.request_id if record is not None and record.state == OC.SENDING else None

    def let_go(self, transfer_id: str) -> str | None:
        """The producer released a transfer's blocks: the request they belong to."""
        return self._ended(transfer_id, OC.SENDING, OC.LET_GO)

    def received(self, transfer_id: str, ok: bool) -> str | None:
        """A claimed transfer landed (`ok`) or failed: the request it loads."""
        return self._ended(transfer_id, OC.RECEIVING, OC.LANDED if ok else OC.FAILED)

    def _ended(self, transfer_id: str, was: Outcome, to: Outcome) -> str | None:
        record = self._by_transfer.get(transfer_id)
        if record is None or record.state != was:
            return None
        del self._by_transfer[transfer_id]
        OUTCOME_TRANSITIONS.move(record, to)
        return record.request_id

    def in_flight(self) -> list[str]:
        """The ids of the transfers still awaited."""
        return list(self._by_transfer)

    def loading(self) -> list[str]:
        """The requests whose claimed load has not landed or failed yet."""
        return [r.request_id for r in self._by_transfer.values() if r.state == OC.RECEIVING]

    def end_all(self) -> list[str]:
        """Every transfer ended at once (the KV cache's memory goes away): claims fail,
        and the producer holds no blocks any more. The requests whose load failed."""
        failed = []
        for transfer_id, record in list(self._by_transfer.items()):
            if record.state == OC.SENDING:
                self.let_go(transfer_id)
            elif self.received(transfer_id, ok=False) is not None:
                failed.append(record.request_id)
        return failed

    def kept(self) -> int:
        """Records kept, by request or by transfer: 0 when nothing is in flight."""
        return len(self._records) + len(self._by_transfer)

    # -- to the engine --------------------------------------------------------------

    def engine_finished(self, request_ids: Iterable[str]) -> None:
        """The engine finished these requests; only prefill legs we hold matter."""
        for request_id in request_ids:
            record = self._records.get(request_id)
            if record is not None and record.state in (OC.SENDING, OC.LET_GO):
                record.engine_finished = True

    def take(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.
        A prefill request's blocks go back only once the engine has finished it, too."""
        reported = [
            r for r in self._records.values()
            if r.state in (OC.LANDED, OC.FAILED) or (r.state == OC.LET_GO and r.engine_finished)
        ]  # fmt: skip
        for record in reported:
            del self._records[record.request_id]
        sending = {r.request_id for r in reported if r.state == OC.LET_GO}
        recving = {r.request_id for r in reported if r.state != OC.LET_GO}
        failed = {r.request_id for r in reported if r.state == OC.FAILED}
        return sending, recving, failed
