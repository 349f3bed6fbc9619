"""The backend contract: the hooks the core calls, in the order a worker meets them.

Which backends see a hook. Every loaded backend answers kvpush_backend_info (when it
is loaded) and kvpush_probe. kvpush_prepare_process and kvpush_init_runtime are called
on every backend with vLLM's platform device type (`current_platform.device_type`:
"cuda" on NVIDIA and on ROCm, "neuron", "cpu", ...); a backend acts only on the types
in its BackendInfo.device_types. kvpush_describe_kv is asked of each backend in turn
until one returns a DeviceKV. Every later hook takes that DeviceKV and is called on the
backend that returned it and on no other; if the core needs one that backend lacks,
it raises BackendNotImplemented naming the hook.

Precedence. When two backends would claim the same tensors, the first asked wins.
Third-party backends are asked before the built-in ones, each group in order of
entry-point names; `@hookimpl(tryfirst=True)` on kvpush_describe_kv puts a backend
ahead of all. So a ROCm backend gets ROCm tensors, which report
`device.type == "cuda"`, before the built-in CUDA backend would take them;
`kvpush backends` lists backends in the order they are asked.

Threads. prepare_process runs on the worker's engine thread when the connector is
made, before the engine allocates; init_runtime and describe_kv on the same thread
when the engine hands over its KV cache; fence on that thread after each layer's
forward pass. nixl_backends and bind_thread run on the Node's loop thread, the one
that owns NIXL, as it starts; wait_fence and stage_blocks on the loop thread before
each WRITE (or READ, or after KV lands). So a fence is made on one thread and waited
on another. release runs on the thread that closes the Node, after the loop thread
has stopped and NIXL has let go of the memory (on a Node that fails to start, on
its loop thread, once the agent it made is closed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pluggy

from kvpush.backend.records import BackendInfo, DeviceKV, Probe

PROJECT = "kvpush"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# -- every backend sees these --------------------------------------------------------


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


# -- only the backend that returned the DeviceKV sees these --------------------------


@hookspec
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    """NIXL backends for this KV's memory, best first; called just before the agent exists."""


@hookspec
def kvpush_bind_thread(kv: DeviceKV) -> None:
    """Make the calling thread, which will own NIXL, safe to use with this device."""


@hookspec
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    """Mark the KV writes issued so far (all layers if `layer` is None); None if already visible."""


@hookspec
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    """Block until the writes before `fence` are visible to NIXL."""


@hookspec
def kvpush_stage_blocks(kv: DeviceKV, block_ids: Sequence[int], direction: str) -> None:
    """Copy blocks between the device and the staging buffers: "to_host" or "to_device"."""


@hookspec
def kvpush_release(kv: DeviceKV) -> None:
    """Free what `kvpush_describe_kv` allocated (staging buffers, events)."""
