"""The device-backend contract: what the core asks of the backend that owns a device.

Hooks taking a DeviceKV are called on the backend that claimed it, and only that one.
A backend that cannot do something raises BackendNotImplemented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pluggy

from kvpush.backend.records import BackendInfo, DeviceKV, Probe

PROJECT = "kvpush"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvpush_backend_info() -> BackendInfo:
    """Name, device types, memory types and transfer paths this backend serves."""


@hookspec
def kvpush_probe() -> Probe:
    """Whether this backend's device is present, cheaply and without starting a runtime."""


@hookspec
def kvpush_prepare_process(device_type: str, local_rank: int, config: Mapping[str, Any]) -> None:
    """Set up the process for `device_type` before its first allocation; raise if too late."""


@hookspec
def kvpush_init_runtime(device_type: str) -> None:
    """Start the runtime of `device_type` if it is yours; the NIXL agent comes after."""


@hookspec(firstresult=True)
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    """Describe these per-layer KV tensors if they live on your device, else return None."""


@hookspec(firstresult=True)
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    """NIXL backends for this KV's memory, best first; called just before the agent exists."""


@hookspec(firstresult=True)
def kvpush_bind_thread(kv: DeviceKV) -> None:
    """Make the calling thread, which will own NIXL, safe to use with this device."""


@hookspec(firstresult=True)
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    """Mark the KV writes issued so far (all layers if `layer` is None); None if already visible."""


@hookspec(firstresult=True)
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    """Block until the writes before `fence` are visible to NIXL."""


@hookspec(firstresult=True)
def kvpush_stage_blocks(kv: DeviceKV, block_ids: Sequence[int], direction: str) -> None:
    """Copy blocks between the device and the staging buffers: "to_host" or "to_device"."""


@hookspec(firstresult=True)
def kvpush_release(kv: DeviceKV) -> None:
    """Free what `kvpush_describe_kv` allocated (staging buffers, events)."""
