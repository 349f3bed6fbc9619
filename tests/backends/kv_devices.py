"""KV caches on fake devices, and the byte patterns the cross-device tests move.

Kinds (each in its engine's real layout):
  neuron         fake Neuron, HBM mapped: direct path, (2, blocks, heads, tokens, dim)
  neuron-staged  fake Neuron, HBM not mapped (staging "host"): host buffers, same layout
  neuron-legacy  fake Neuron, older XLA stack (no data_ptr at all): staged, same layout
  cuda           fake CUDA on cuda:1, direct, (blocks, 2, heads, tokens, dim)
  cuda-staged    fake CUDA on cuda:1, staged through host buffers, same layout
  host-kv        CPU torch tensors (the host backend), (blocks, 2, heads, tokens, dim)

Every block's K and V get their own random bytes from (seed, layer, block, part), so a
receiver's bytes can be checked against what was meant, not against the sender's
(possibly stale) memory, and a K/V or block mix-up shows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

HEADS, TOKENS, DIM = 2, 4, 8
PART_BYTES = HEADS * TOKENS * DIM * 2  # bfloat16
NEURON_DIMS = ("kv", "blocks", "heads", "tokens", "dim")
GPU_DIMS = ("blocks", "kv", "heads", "tokens", "dim")
KINDS = ("neuron", "neuron-staged", "neuron-legacy", "cuda", "cuda-staged", "host-kv")


def pattern(seed: int, layer: int, block: int, part: int) -> bytes:
    rng = np.random.default_rng([seed, layer, block, part])
    return rng.integers(0, 256, size=PART_BYTES, dtype=np.uint8).tobytes()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


ZERO = digest(bytes(PART_BYTES))


def expected(seed: int, layers: int, blocks: list[int]) -> list[list[list[str]]]:
    """[layer][i] = [K digest, V digest] of block blocks[i] as `seed` fills it."""
    return [
        [[digest(pattern(seed, layer, b, part)) for part in (0, 1)] for b in blocks]
        for layer in range(layers)
    ]


def _index(dims: tuple[str, ...], part: int, block: int) -> tuple[Any, ...]:
    index: list[Any] = [slice(None)] * len(dims)
    index[dims.index("kv")], index[dims.index("blocks")] = part, block
    return tuple(index)


class FakeDeviceCache:
    """One worker's KV on a fake device, its Backends, and how its "model" writes it."""

    def __init__(self, kind: str, layers: int, blocks: int, lock_dir: str = "") -> None:
        import torch

        from kvpush.backend.plugins import Backends

        if kind not in KINDS:
            raise ValueError(f"unknown device kind {kind!r}; known: {KINDS}")
        self.kind = kind
        self.fake: Any = None
        if kind.startswith("neuron"):
            from kvpush_neuron import runtime
            from kvpush_neuron.testing import FakeNeuron

            # The bytes must cross real NIXL here, where UCX refuses host memory posing as
            # VRAM and LIBFABRIC cannot load: fake HBM is registered as DRAM (see testing.py).
            self.fake = FakeNeuron(legacy=kind == "neuron-legacy", mem_type="DRAM",
                                   lock_dir=lock_dir or None)  # fmt: skip
            runtime.set_runtime(self.fake)
            self.backends = Backends(["host", "neuron"])
            config = {} if kind == "neuron" else {"staging": "host"}
            self.backends.prepare_process("neuron", 0, config)  # before any allocation
            self.backends.init_runtime("neuron")
            self.dims = NEURON_DIMS
            shape = (2, blocks, HEADS, TOKENS, DIM)
            alloc = self.fake.zeros
        elif kind.startswith("cuda"):
            from kvpush_cuda import runtime
            from kvpush_cuda.testing import FakeCuda

            self.fake = FakeCuda(device_count=2, mem_type="DRAM")
            runtime.set_runtime(self.fake)
            self.backends = Backends(["host", "cuda"])
            config = {"staging": "host"} if kind == "cuda-staged" else {}
            self.dims = GPU_DIMS
            shape = (blocks, 2, HEADS, TOKENS, DIM)

            def alloc(shape: tuple[int, ...], dtype: Any) -> Any:
                return self.fake.zeros(shape, dtype, device=1)
        else:
            self.backends = Backends(["host"])
            config = {}
            self.dims = GPU_DIMS
            shape = (blocks, 2, HEADS, TOKENS, DIM)
            alloc = torch.zeros
        self.tensors = {f"layer.{i}": alloc(shape, dtype=torch.bfloat16) for i in range(layers)}
        self.kv = self.backends.describe(self.tensors, self.dims, config)

    def write(self, name: str, layer: int, blocks: list[int], seed: int) -> None:
        """The model computing `layer` of `blocks`: through the device's asynchronous writes."""
        import torch

        tensor = self.tensors[name]
        for block in blocks:
            for part in (0, 1):
                raw = bytearray(pattern(seed, layer, block, part))
                value = torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16)
                value = value.view(HEADS, TOKENS, DIM)
                index = _index(self.dims, part, block)
                if self.fake is None:
                    tensor[index] = value
                else:
                    self.fake.write(tensor, index, value)

    def digests(self, blocks: list[int]) -> list[list[list[str]]]:
        """[layer][i] = [K digest, V digest] of what block blocks[i] holds on the device now."""
        import torch

        result = []
        for tensor in self.tensors.values():
            memory = self.fake.read(tensor) if hasattr(self.fake, "read") else tensor
            layer = []
            for block in blocks:
                parts = []
                for part in (0, 1):
                    data = memory[_index(self.dims, part, block)].clone()
                    parts.append(digest(data.view(torch.uint8).numpy().tobytes()))
                layer.append(parts)
            result.append(layer)
        return result
