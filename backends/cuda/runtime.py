"""The CUDA runtime seam: everything kvpush_cuda asks of torch.cuda, behind one object.

The backend's logic (regions, fences, staging, thread binding) calls only this, so a
test can swap in kvpush_cuda.testing.FakeCuda and run the same logic on CPU tensors that
pose as device memory. The real object imports torch on first use: `import
kvpush_cuda` (and `kvpush backends`) must work without torch and start no CUDA context.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvpush.backend import Swappable

log = logging.getLogger(__name__)


class CudaRuntime(Protocol):
    """What the backend needs from CUDA; TorchCuda is the real one, FakeCuda the test one."""

    #: NIXL memory type of device memory: "VRAM" (a fake may say "DRAM", see testing.py).
    mem_type: str

    def device_index(self, tensor: Any) -> int | None:
        """The CUDA device index of `tensor`, or None if it is not a CUDA tensor."""

    def set_device(self, index: int) -> None:
        """Make `index` the calling thread's current device."""

    def record_event(self, index: int) -> Any:
        """An event recorded on device `index`'s current stream, after the work queued so far."""

    def wait_event(self, event: Any) -> None:
        """Block the calling thread until `event` has completed."""

    def pin(self, addr: int, nbytes: int) -> bool:
        """Page-lock host memory for fast DMA; False if the driver refused."""

    def unpin(self, addr: int) -> None:
        """Undo pin()."""

    def copy(self, pairs: Sequence[tuple[Any, Any]], index: int) -> None:
        """dst.copy_(src) for each (dst, src) between host and device `index`; returns when done."""


class TorchCuda:
    """The real runtime: torch.cuda, imported on first use."""

    mem_type = "VRAM"

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _torch() -> Any:
        import torch

        return torch

    def device_index(self, tensor: Any) -> int | None:
        device = getattr(tensor, "device", None)
        if getattr(device, "type", None) != "cuda":
            return None
        # A CUDA tensor always carries its index; `max(..., 0)` guards odd wrappers.
        return max(device.index or 0, 0)

    def set_device(self, index: int) -> None:
        self._torch().cuda.set_device(index)

    def record_event(self, index: int) -> Any:
        torch = self._torch()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        return event

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def pin(self, addr: int, nbytes: int) -> bool:
        cudart = self._torch().cuda.cudart()
        try:
            code = cudart.cudaHostRegister(addr, nbytes, 0)
        except (AttributeError, TypeError) as exc:  # an unusual torch build
            log.warning("kvpush cuda: cannot pin staging buffers (%s); using pageable memory", exc)
            return False
        return int(getattr(code, "value", code)) == 0

    def unpin(self, addr: int) -> None:
        unregister = getattr(self._torch().cuda.cudart(), "cudaHostUnregister", None)
        if unregister is not None:
            unregister(addr)

    def copy(self, pairs: Sequence[tuple[Any, Any]], index: int) -> None:
        # A side stream, so staging one request's blocks never queues behind the
        # compute stream's later work; callers have already waited on the KV's fence.
        torch = self._torch()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(index)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        stream.synchronize()


# The runtime the backend uses: the real one unless a test installed another.
_runtime: Swappable[CudaRuntime] = Swappable(TorchCuda)
get_runtime = _runtime.get
set_runtime = _runtime.set
