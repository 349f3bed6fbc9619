"""The built-in host (DRAM) backend: numpy arrays and CPU torch tensors.

Registered through the `kvpush.backends` entry point like any third-party backend.
torch is optional: a tensor is recognised by its type, never by importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpush.backend import (
    BackendInfo,
    DeviceKV,
    Probe,
    TensorView,
    claimed_device,
    hookimpl,
    layout_from_views,
    torch_view,
)
from kvpush.errors import RegionError

NAME = "host"


def is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def host_view(obj: Any) -> TensorView | None:
    """The view of a host array or CPU tensor; None for anything on another device."""
    if isinstance(obj, np.ndarray):
        itemsize = obj.itemsize
        if any(s % itemsize for s in obj.strides):
            raise RegionError(f"array strides {obj.strides} are not whole elements")
        return TensorView(
            addr=obj.ctypes.data,
            shape=tuple(obj.shape),
            strides=tuple(s // itemsize for s in obj.strides),
            itemsize=itemsize,
            dtype=str(obj.dtype),
        )
    if is_torch_tensor(obj) and obj.device.type == "cpu":
        return torch_view(obj, device_id=0, mem_type="DRAM")
    return None


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    # tokens_per_block: the only option it reads; vLLM's CPU layout names no tokens dimension.
    return BackendInfo(
        NAME,
        device_types=("cpu",),
        mem_types=("DRAM",),
        transfer_paths=("direct",),
        device_options=("tokens_per_block",),
    )


@hookimpl
def kvpush_probe() -> Probe:
    return Probe(NAME, present=True, detail="host memory is always present")


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    views = {name: host_view(t) for name, t in tensors.items()}
    if claimed_device({n: None if v is None else 0 for n, v in views.items()}, "host") is None:
        return None
    layout = layout_from_views(views, dims, int(config.get("tokens_per_block", 0)))
    # Keep the arrays alive as long as NIXL may touch their memory.
    return DeviceKV(NAME, "cpu", layout, "direct", state=dict(tensors))


@hookimpl
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    return list(requested) or ["UCX"]


@hookimpl
def kvpush_bind_thread(kv: DeviceKV) -> None:
    return None


@hookimpl
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    # Host writes are complete when the writing call returns: nothing to wait for.
    return None


@hookimpl
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    return None
