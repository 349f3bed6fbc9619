"""Host staging for Neuron KV: when HBM cannot be registered with NIXL.

That is the older XLA stack (no device pointer at all) and TorchNeuron without
NEURON_RT_MAP_HBM. Each KV tensor gets a page-aligned host buffer of its logical shape
(the XLA stack has no strides to mirror), registered as DRAM. The buffers are never
pinned: pin_memory can crash the Neuron runtime, and NIXL pins what it registers.
Copies gather the moved blocks of a tensor into one device->host transfer, because on
Neuron each transfer has a large fixed cost.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpush_neuron.runtime import NeuronRuntime


def _host_buffer(shape: Sequence[int], dtype: Any) -> Any:
    """A zeroed, page-aligned (anonymous mmap) host tensor; never pinned."""
    import torch

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8))
    return raw.view(dtype).view(tuple(shape))


class HostStaging:
    """Host buffers for one worker's Neuron KV tensors, and the copies between them."""

    def __init__(
        self, tensors: Mapping[str, Any], dims: Sequence[str], runtime: NeuronRuntime
    ) -> None:
        self.runtime = runtime
        self.block_dim = tuple(dims).index("blocks")
        self.host: dict[str, Any] = {}
        self._pairs: list[tuple[Any, Any]] = []  # (device, host), each device tensor once
        mirrors: dict[int, Any] = {}
        for name, tensor in tensors.items():
            # An XLA tensor has no address to compare: the same object means the same KV.
            if id(tensor) not in mirrors:
                mirrors[id(tensor)] = _host_buffer(tuple(tensor.shape), tensor.dtype)
                self._pairs.append((tensor, mirrors[id(tensor)]))
            self.host[name] = mirrors[id(tensor)]

    def copy(self, block_ids: Sequence[int], direction: str) -> None:
        """Copy `block_ids` of every layer: "to_host" before a send, "to_device" after one."""
        import torch

        ids = sorted({int(b) for b in block_ids})
        if not ids:
            return
        index = torch.tensor(ids, dtype=torch.long)
        dim = self.block_dim
        for device, host in self._pairs:
            if direction == "to_host":
                host.index_copy_(dim, index, self.runtime.gather(device, dim, ids))
            else:
                self.runtime.scatter(device, dim, ids, host.index_select(dim, index))

    def release(self) -> None:
        self._pairs.clear()
        self.host.clear()
