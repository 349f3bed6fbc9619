"""Swappable: the process-wide device runtime behind a backend, which a test can replace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Swappable(Generic[T]):
    """A process-wide object a test can replace: the device runtime behind a backend.

    Made lazily (`make` may import a device library) and replaced through `set`,
    which returns what it replaced (None: back to the real one).
    """

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None

    def get(self) -> T:
        if self._value is None:
            self._value = self._make()
        return self._value

    def set(self, value: T | None) -> T | None:
        previous, self._value = self._value, value
        return previous
