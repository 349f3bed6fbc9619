"""Deadlines kept in a heap: every expired entry is found, whatever was renewed.

A plain FIFO of leases (upstream's) stops at the first entry not yet expired and
strands every expired one queued behind it once leases are renewed out of order.
A heap ordered by deadline has no such blind spot. Renewing pushes a new entry and
makes the old one stale; stale entries are skipped when they surface.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Hashable


class Timer(enum.StrEnum):
    """What a deadline is for. A machine's deadlines are keyed (Timer, what it
    times), and each machine sends an expired one to its handler by a table."""

    HEARTBEAT = "heartbeat"  # the periodic round of heartbeats, one for all peers
    SILENT = "silent"  # producer: a consumer said nothing for silence_s
    LEASE = "lease"  # producer: computed or granted KV held for a claim
    REGISTRATION = "registration"  # producer: a claim or request waits for its KV
    REWRITE = "rewrite"  # producer: a failed WRITE is posted again
    WATCHDOG = "watchdog"  # consumer: no sign of life from the producer
    LANDING = "landing"  # consumer: NIXL's notification due after Complete
    SETTLE = "settle"  # consumer: no WRITE can land any more


# The key of a machine's periodic heartbeat round (one per machine, for all peers).
HEARTBEAT = (Timer.HEARTBEAT, "")


class Deadlines:
    """At most one live deadline per key."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live: dict[Hashable, tuple[float, int]] = {}
        self._seq = itertools.count()

    def set(self, key: Hashable, deadline: float) -> None:
        """Arm or move `key`'s deadline."""
        entry = (deadline, next(self._seq))
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))

    def extend(self, key: Hashable, deadline: float) -> None:
        """Move `key`'s deadline later, never earlier; no-op for an unarmed key."""
        current = self._live.get(key)
        if current is not None and deadline > current[0]:
            self.set(key, deadline)

    def cancel(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def get(self, key: Hashable) -> float | None:
        entry = self._live.get(key)
        return entry[0] if entry else None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def pop_expired(self, now: float) -> list[Hashable]:
        """Every key whose live deadline is <= now, earliest first; they are disarmed."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            deadline, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) == (deadline, seq):
                del self._live[key]
                expired.append(key)
        self._compact()
        return expired

    def next_deadline(self) -> float | None:
        while self._heap:
            deadline, seq, key = self._heap[0]
            if self._live.get(key) == (deadline, seq):
                return deadline
            heapq.heappop(self._heap)
        return None

    def _compact(self) -> None:
        # Renewals leave stale entries behind; rebuild when they outnumber live ones.
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
            self._heap = [(d, s, k) for k, (d, s) in self._live.items()]
            heapq.heapify(self._heap)


def arm_heartbeat(deadlines: Deadlines, now: float, period: float) -> None:
    """Make sure a heartbeat round is due within `period`; an armed one stays as it is,
    so frequent calls never push the round back."""
    if HEARTBEAT not in deadlines:
        deadlines.set(HEARTBEAT, now + period)
