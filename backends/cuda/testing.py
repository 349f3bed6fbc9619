"""A fake CUDA for tests on machines without a GPU (needs torch, any build).

Install it with kvpush_cuda.runtime.set_runtime(FakeCuda(...)) and the CUDA backend's
real logic runs against it:

- device memory is CPU memory: FakeCuda.zeros() returns a tensor whose .device says
  cuda:N (so the host backend leaves it alone) and whose bytes NIXL can move;
- kernels are asynchronous: FakeCuda.write() queues a write on the device's stream and
  it lands only when an event recorded after it is waited on (or at synchronize()),
  so a WRITE posted without the fence sends the stale bytes, as RDMA would;
- the current device is per thread, as in CUDA, and events remember their stream position;
- staging copies read what has landed, like a copy on a side stream;
- pinning is recorded (or refused, to test the fallback).

A testing aid, not part of the backend: nothing in kvpush_cuda imports it. It ships in
the backend package, beside the seam it fakes, so the seam and its fake change together
and third parties can test their integrations against it.

NIXL's UCX refuses "VRAM" that is really host memory ("VRAM memory is detected as host
by UCX"), so for transfers on a CPU box make it with mem_type="DRAM": the backend's
logic is the same, only the memory type NIXL is told differs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Storage address -> device index, for every fake allocation (and so every view of one).
_DEVICE_OF: dict[int, int] = {}


def _on_device(result: Any) -> Any:
    """Views of fake device memory stay on the device; anything else is a host result."""
    if isinstance(result, torch.Tensor) and result.untyped_storage().data_ptr() in _DEVICE_OF:
        return torch.Tensor._make_subclass(FakeCudaTensor, result)
    if isinstance(result, tuple | list):
        return type(result)(_on_device(r) for r in result)
    return result


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports itself as living on a CUDA device.

    Views (narrow, select, indexing by slices) stay "on the device"; computed results
    (a sum, a gathered copy) come back as plain host tensors, which tests can read.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            return _on_device(func(*args, **(kwargs or {})))

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            return torch.device("cuda", _DEVICE_OF[self.untyped_storage().data_ptr()])


@dataclass(frozen=True)
class FakeEvent:
    device: int
    position: int  # writes queued on the stream before the event was recorded


class FakeCuda:
    """The fake runtime (kvpush_cuda.runtime.CudaRuntime) plus the device's test API."""

    def __init__(self, device_count: int = 1, mem_type: str = "VRAM", pin_ok: bool = True):
        self.device_count = device_count
        self.mem_type = mem_type
        self.pin_ok = pin_ok
        self.pinned: dict[int, int] = {}
        self._allocations: list[torch.Tensor] = []
        self._queued: dict[int, list[tuple[Any, Any, Any]]] = {}
        self._landed: dict[int, int] = {}  # per device: how many queued writes have landed
        self._thread = threading.local()
        self._lock = threading.RLock()

    # -- the device, as a test drives it ---------------------------------------------

    def zeros(self, shape: Sequence[int], dtype: Any = torch.float16, device: int = 0) -> Any:
        if not 0 <= device < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
        base = torch.zeros(tuple(shape), dtype=dtype)
        self._allocations.append(base)  # keeps the storage (and its address) alive
        _DEVICE_OF[base.untyped_storage().data_ptr()] = device
        return torch.Tensor._make_subclass(FakeCudaTensor, base)

    def write(self, tensor: Any, index: Any, value: Any) -> None:
        """A kernel writing tensor[index] = value: queued on the device's stream."""
        with self._lock:
            self._queued.setdefault(tensor.device.index, []).append((tensor, index, value))

    def synchronize(self, device: int | None = None) -> None:
        for index in [device] if device is not None else list(self._queued):
            self._land(index, len(self._queued.get(index, [])))

    def _land(self, device: int, upto: int) -> None:
        with self._lock:
            queue = self._queued.get(device, [])
            start = self._landed.get(device, 0)
            for tensor, index, value in queue[start:upto]:
                torch.Tensor.__setitem__(tensor, index, value)
            self._landed[device] = max(start, upto)

    def current_device(self) -> int:
        return getattr(self._thread, "device", 0)

    # -- the seam (kvpush_cuda.runtime.CudaRuntime) -------------------------------------

    def device_index(self, tensor: Any) -> int | None:
        device = getattr(tensor, "device", None)
        return device.index if getattr(device, "type", None) == "cuda" else None

    def set_device(self, index: int) -> None:
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self._thread.device = index

    def record_event(self, index: int) -> FakeEvent:
        with self._lock:
            return FakeEvent(index, len(self._queued.get(index, [])))

    def wait_event(self, event: FakeEvent) -> None:
        self._land(event.device, event.position)

    def pin(self, addr: int, nbytes: int) -> bool:
        if self.pin_ok:
            self.pinned[addr] = nbytes
        return self.pin_ok

    def unpin(self, addr: int) -> None:
        del self.pinned[addr]

    def copy(self, pairs: Sequence[tuple[Any, Any]], index: int) -> None:
        # A side-stream copy sees what has landed, not what is still queued.
        for dst, src in pairs:
            torch.Tensor.copy_(dst, src)
