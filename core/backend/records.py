"""What a backend answers with: what it serves, whether its device is here, the KV it claimed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpush.layout import KVLayout


@dataclass(frozen=True)
class BackendInfo:
    """What a backend serves. `missing` lists hooks it does not implement yet.

    `device_types` are the device types it acts on when `kvpush_prepare_process` and
    `kvpush_init_runtime` pass vLLM's platform device type (`current_platform.device_type`).

    `device_options` are the keys of the connector's `device_options` it reads: any
    other key is refused before the engine allocates, naming these. None declares
    nothing, so keys reach the backend unchecked (with a warning, once): a misspelt
    option would otherwise pick a transfer path silently.
    """

    name: str
    device_types: tuple[str, ...]
    mem_types: tuple[str, ...]
    transfer_paths: tuple[str, ...]
    missing: tuple[str, ...] = ()
    device_options: tuple[str, ...] | None = None


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
    state: Any = field(default=None, repr=False)
