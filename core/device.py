"""Records that device backends hand to the core, and the core hands back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvpush.errors import BackendError
from kvpush.layout import KVLayout


@dataclass(frozen=True)
class BackendInfo:
    """What a backend serves. `missing` lists hooks it does not implement yet."""

    name: str
    device_types: tuple[str, ...]
    mem_types: tuple[str, ...]
    transfer_paths: tuple[str, ...]
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probe:
    """Whether a backend's device is present here; `detail` says how it knows."""

    name: str
    present: bool
    detail: str


@dataclass
class DeviceKV:
    """A worker's KV cache as one backend claimed it.

    `layout` is what NIXL registers and moves: the device memory itself on the
    direct path, the host staging buffers on the staged path. `state` is the
    backend's own (tensors, staging buffers, events); the core never reads it.
    """

    backend: str
    device: str
    layout: KVLayout
    path: str = "direct"
    device_layout: KVLayout | None = None
    state: Any = field(default=None, repr=False)


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


def claimed_device(
    devices: Mapping[str, int | None], kind: str, scope: str = "one device"
) -> int | None:
    """The one device index all KV tensors share; None when none is on `kind`.

    `devices` maps tensor name to its index on `kind`, or None when the tensor lives
    elsewhere. A worker whose KV straddles devices is refused: NIXL registers one
    device per agent.
    """
    if all(index is None for index in devices.values()):
        return None
    strays = sorted(name for name, index in devices.items() if index is None)
    if strays:
        raise BackendError(f"KV tensors {strays} are not on a {kind} device but the others are")
    indices = sorted(set(devices.values()))
    if len(indices) != 1:
        raise BackendError(f"a worker's KV must live on {scope}; got devices {indices}")
    return indices[0]
