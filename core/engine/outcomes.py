"""A worker's half of the request ledger: which engine request each transfer serves,
and when the engine may hear of each outcome.

The scheduler's Ledger (kvpush.engine.ledger) names, in each step's plan, the
request every claimed or produced transfer belongs to; workers hear of transfers by
id only (the protocol knows no requests). Outcomes keeps that map from the plans and
turns each transfer's end into what vLLM's contract asks of a worker: the requests
finished sending (a prefill's blocks may be reused: the producer let go, and the
engine finished the request too), finished receiving, and failed receiving. Plain
values in and out, like the ledger.

A progressive transfer the producer let go between chunks (decode cancelled) is
still named by each later step's plan until its request's last step: it is not
held again, so the maps keep only what the producer still holds, or what waits for
the engine to finish its request.
"""

from __future__ import annotations

from collections.abc import Iterable


class Outcomes:
    def __init__(self) -> None:
        self._sender_of: dict[str, str] = {}  # transfer id -> prefill request id, held
        self._sent_by: dict[str, str] = {}  # the same, request id -> transfer id
        self._receiver_of: dict[str, str] = {}  # transfer id -> decode request id
        # Prefill requests the producer let go -> their transfer, until the engine
        # finished them too (later plans may still name the transfer until then).
        self._released: dict[str, str] = {}
        self._finished: set[str] = set()  # held or released requests the engine finished
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()

    # -- from the step's plan -------------------------------------------------------

    def receiving(self, request_id: str, transfer_id: str) -> None:
        self._receiver_of[transfer_id] = request_id

    def sending(self, request_id: str, transfer_id: str) -> None:
        if self._released.get(request_id) == transfer_id:
            return  # let go between chunks: the producer ignores the rest of it
        self._sender_of[transfer_id] = request_id
        self._sent_by[request_id] = transfer_id

    def rejected(self, request_id: str) -> None:
        """A decode leg that fails at once: its load is reported failed."""
        self._recv_done.add(request_id)
        self._recv_failed.add(request_id)

    # -- from the node's outcomes ---------------------------------------------------

    def sender(self, transfer_id: str) -> str | None:
        """The prefill request a transfer sends, while its blocks are held."""
        return self._sender_of.get(transfer_id)

    def let_go(self, transfer_id: str) -> str | None:
        """The producer released a transfer's blocks: the request they belong to."""
        request_id = self._sender_of.pop(transfer_id, None)
        if request_id is not None:
            if self._sent_by.get(request_id) == transfer_id:
                del self._sent_by[request_id]
            self._released[request_id] = transfer_id
        return request_id

    def received(self, transfer_id: str, ok: bool) -> str | None:
        """A claimed transfer landed (`ok`) or failed: the request it loads."""
        request_id = self._receiver_of.pop(transfer_id, None)
        if request_id is not None:
            self._recv_done.add(request_id)
            if not ok:
                self._recv_failed.add(request_id)
        return request_id

    # -- to the engine --------------------------------------------------------------

    def engine_finished(self, request_ids: Iterable[str]) -> None:
        """The engine finished these requests; only prefill legs we hold matter."""
        for request_id in request_ids:
            if request_id in self._sent_by or request_id in self._released:
                self._finished.add(request_id)

    def take(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.
        A prefill request's blocks go back only once the engine has finished it, too."""
        sending = {r for r in self._finished if r in self._released}
        for request_id in sending:
            del self._released[request_id]
        self._finished -= sending
        recving, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return sending, recving, failed
