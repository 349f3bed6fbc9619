"""Host staging for CUDA KV: for setups where NIXL cannot reach GPU memory (no GPUDirect).

Each KV tensor gets a page-aligned host mirror laid out in the same memory order, so
the staged layout has the same shape of block runs as the device one (a block-major
GPU cache stays block-major on the host and pairs with a peer the same way). Mirrors
are pinned when the driver allows, which doubles copy bandwidth; NIXL registers them
as DRAM. Copies run on a side stream, only for the blocks being moved.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpush_cuda.runtime import CudaRuntime

log = logging.getLogger(__name__)


def consecutive_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) for each run of consecutive ids, so a copy moves runs, not blocks."""
    runs: list[tuple[int, int]] = []
    for block in sorted(set(block_ids)):
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def _host_mirror(device_tensor: Any) -> tuple[Any, mmap.mmap]:
    """A zeroed host tensor shaped like `device_tensor`, dense in the same memory order."""
    import torch

    dims = range(device_tensor.dim())
    order = sorted(dims, key=lambda d: (-device_tensor.stride(d), d))  # outermost first
    nbytes = device_tensor.numel() * device_tensor.element_size()
    # Anonymous mmap memory starts on a page and is zeroed: what pinning and NIXL want.
    memory = mmap.mmap(-1, nbytes)
    raw = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8))
    dense = raw.view(device_tensor.dtype).view([device_tensor.shape[d] for d in order])
    return dense.permute([order.index(d) for d in dims]), memory


class HostStaging:
    """The host mirrors of one worker's CUDA KV tensors, and the copies between them."""

    def __init__(
        self,
        tensors: Mapping[str, Any],
        dims: Sequence[str],
        runtime: CudaRuntime,
        device: int,
        pin: bool = True,
    ) -> None:
        self.runtime = runtime
        self.device = device
        self.block_dim = tuple(dims).index("blocks")
        self.host: dict[str, Any] = {}
        self._pairs: list[tuple[Any, Any]] = []  # (device, host), each device tensor once
        self._memory: list[mmap.mmap] = []
        self.pinned: list[int] = []
        mirrors: dict[tuple, Any] = {}
        for name, tensor in tensors.items():
            # Engines may hand one tensor to several layers: mirror and copy it once.
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if key not in mirrors:
                host, memory = _host_mirror(tensor)
                mirrors[key] = host
                self._memory.append(memory)
                self._pairs.append((tensor, host))
                if pin:
                    self._pin(host.data_ptr(), len(memory))
            self.host[name] = mirrors[key]

    def _pin(self, addr: int, nbytes: int) -> None:
        if self.runtime.pin(addr, nbytes):
            self.pinned.append(addr)
        else:
            log.warning(
                "kvpush cuda: pinning %d bytes of staging memory failed; copies will be slower",
                nbytes,
            )

    def copy(self, block_ids: Sequence[int], direction: str) -> None:
        """Copy `block_ids` of every layer: "to_host" before a send, "to_device" after one."""
        dim = self.block_dim
        pairs = []
        for device, host in self._pairs:
            for first, count in consecutive_runs(block_ids):
                d, h = device.narrow(dim, first, count), host.narrow(dim, first, count)
                pairs.append((h, d) if direction == "to_host" else (d, h))
        if pairs:
            self.runtime.copy(pairs, self.device)

    def release(self) -> None:
        while self.pinned:
            self.runtime.unpin(self.pinned.pop())
        self._pairs.clear()
        self.host.clear()
        self._memory.clear()
