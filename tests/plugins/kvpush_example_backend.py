"""An example third-party kvpush backend, the one docs/writing-a-backend.md walks through.

It serves an imaginary device type "example" whose tensors are host arrays in a
wrapper, so NIXL can really move them. Writes to an example tensor are queued until
a fence flushes them, which is how a real accelerator behaves: the backend's fence
is what makes the bytes NIXL reads the bytes the model wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpush.backend import BackendInfo, DeviceKV, Probe, TensorView, hookimpl, layout_from_views

NAME = "example"


class ExampleDevice:
    type = "example"

    def __str__(self) -> str:
        return "example:0"


class ExampleTensor:
    """Device memory: host bytes behind it, written only when the device syncs."""

    device = ExampleDevice()

    def __init__(self, shape: tuple[int, ...], dtype: str = "uint8") -> None:
        self.memory = np.zeros(shape, dtype=dtype)
        self.queued: list[tuple[Any, Any]] = []

    def write(self, index: Any, value: Any) -> None:
        self.queued.append((index, value))

    def synchronize(self) -> None:
        for index, value in self.queued:
            self.memory[index] = value
        self.queued.clear()


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    # It reads no device_options, so any key given is refused, naming none.
    return BackendInfo(NAME, ("example",), ("DRAM",), ("direct",), device_options=())


@hookimpl
def kvpush_probe() -> Probe:
    return Probe(NAME, True, "the example device is imaginary, so always present")


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    if not all(isinstance(t, ExampleTensor) for t in tensors.values()):
        return None
    views = {
        name: TensorView(
            addr=t.memory.ctypes.data,
            shape=t.memory.shape,
            strides=tuple(s // t.memory.itemsize for s in t.memory.strides),
            itemsize=t.memory.itemsize,
            dtype=str(t.memory.dtype),
        )
        for name, t in tensors.items()
    }
    return DeviceKV(NAME, "example:0", layout_from_views(views, dims), state=dict(tensors))


@hookimpl
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    return list(requested) or ["UCX"]


@hookimpl
def kvpush_bind_thread(kv: DeviceKV) -> None:
    return None


@hookimpl
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    names = [layer] if layer else list(kv.state)
    return [kv.state[name] for name in names]


@hookimpl
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    for tensor in fence:
        tensor.synchronize()
