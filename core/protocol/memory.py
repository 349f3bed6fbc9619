"""What a machine remembers of transfer ids it no longer tracks: bounded memories.

Each memory answers latecomers (a claim for a transfer that ended, the engine's
report after a release) and is bounded twice, the same way for all: an entry may
carry a deadline past which it is forgotten, and only the newest `size` entries
are kept, so no stream of transfer ids can grow it without end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from kvpush.protocol.timers import Deadlines

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Far more transfers than can end between two reports of one.
SIZE = 65536


class Memory(Generic[K, V]):
    """Key -> value, forgotten at its deadline (if it has one) or when `size` newer
    keys came after it."""

    def __init__(self, size: int = SIZE) -> None:
        self._size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._deadlines = Deadlines()

    def remember(self, key: K, value: V, until: float | None = None) -> None:
        """Keep `key` -> `value`, until `until` when given (else as long as room lasts)."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if until is None:
            self._deadlines.cancel(key)
        else:
            self._deadlines.set(key, until)
        while len(self._entries) > self._size:
            oldest, _ = self._entries.popitem(last=False)
            self._deadlines.cancel(oldest)

    def keep(self, key: K) -> None:
        """Let `key` outlive its deadline: it goes only when forgotten or crowded out."""
        self._deadlines.cancel(key)

    def forget(self, key: K) -> V | None:
        self._deadlines.cancel(key)
        return self._entries.pop(key, None)

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def until(self, key: K) -> float | None:
        """When `key` will be forgotten (None: no deadline, or not remembered)."""
        return self._deadlines.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __iter__(self) -> Iterator[K]:
        """The keys remembered now (a copy: forgetting while iterating is safe)."""
        return iter(list(self._entries))

    def expire(self, now: float) -> None:
        for key in self._deadlines.pop_expired(now):
            self._entries.pop(key, None)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()
