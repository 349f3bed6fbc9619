"""The producer process of the two-process GPU tests, and what both sides share.

The producer holds its KV in Neuron's K/V-major layout (2, blocks, heads, tokens, dim),
the consumer in the GPU's block-major one, so the core's K/V mapping is exercised.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

LAYERS, BLOCKS, HEADS, TOKENS, DIM = 2, 8, 2, 16, 64
KV_MAJOR = ("kv", "blocks", "heads", "tokens", "dim")
BLOCK_MAJOR = ("blocks", "kv", "heads", "tokens", "dim")
SRC, DST = [0, 3, 4], [6, 1, 2]
SLEEP_CYCLES = 50_000_000  # tens of milliseconds of GPU time before each layer's writes


def pattern(seed: int, layer: int, block: int, part: int) -> torch.Tensor:
    """One block's K (part 0) or V (part 1), on the host, from its coordinates."""
    generator = torch.Generator().manual_seed(((seed * 64 + layer) * 1024 + block) * 2 + part)
    return torch.randn((HEADS, TOKENS, DIM), generator=generator).to(torch.bfloat16)


def compute_layers(backends: Any, kv: Any, tensors: dict[str, torch.Tensor], seed: int) -> list:
    """The "model": each layer's blocks written late on the GPU stream; a fence per layer."""
    fences = []
    for layer, (name, tensor) in enumerate(tensors.items()):
        torch.cuda._sleep(SLEEP_CYCLES)
        for block in SRC:
            for part in (0, 1):
                tensor[part, block].copy_(pattern(seed, layer, block, part), non_blocking=True)
        fences.append(backends.fence(kv, name))
    return fences


def producer(queue: Any, done: Any, staged: bool, seed: int) -> None:
    import msgspec

    from kvpush.backend.plugins import Backends

    torch.cuda.set_device(0)
    backends = Backends(["host", "cuda"])
    shape = (2, BLOCKS, HEADS, TOKENS, DIM)
    tensors = {
        f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0")
        for i in range(LAYERS)
    }
    kv = backends.describe(tensors, KV_MAJOR, {"staging": "host"} if staged else {})
    for fence in compute_layers(backends, kv, tensors, seed):
        backends.wait_fence(kv, fence)  # what the Node does before posting the WRITE
    message: dict[str, Any] = {"layout": msgspec.msgpack.encode(kv.layout)}
    if staged:
        backends.stage(kv, SRC, "to_host")
        message["regions"] = [
            (r.addr, ctypes.string_at(r.addr, r.length)) for r in kv.layout.regions
        ]
    else:
        # CUDA IPC: the consumer maps these allocations; the layout's addresses are ours.
        message["tensors"] = tensors
        message["bases"] = {n: t.data_ptr() for n, t in tensors.items()}
    queue.put(message)
    done.wait(120)  # IPC memory must outlive the consumer's reads
    backends.release(kv)
