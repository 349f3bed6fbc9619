"""A faithful fake Neuron device for tests on machines without Trainium (needs torch).

Install it with kvpush_neuron.runtime.set_runtime(FakeNeuron(...)) and the Neuron
backend's real logic runs against it. It reproduces what bites on real hardware:

- HBM is host memory behind an address table, so NIXL really moves its bytes;
- data_ptr() is 0 unless NEURON_RT_MAP_HBM was "1"/"true" at the process's first
  device allocation (read once, as the runtime does); legacy=True is the older XLA
  stack, whose tensors have no data_ptr() at all;
- the runtime starts at the first allocation (or start()); with start_on_alloc=False
  it starts only when asked, which is how a NIXL agent can come to exist before it;
- the runtime reads NEURON_RT_VISIBLE_CORES when it starts and claims those cores
  (all of the fake host's cores when unset) with a lock file, so a second process on
  the same fake host fails as on a real one; visible cores appear as neuron:0..n-1;
- device writes (FakeNeuron.write) are queued and land only at synchronize(), so a
  WRITE posted without the fence sends stale bytes; a device->host copy (gather) is
  queued behind them, as on the device;
- a tensor's pin_memory() raises (pinning can crash the Neuron runtime);
- nixl_register() says what NIXL would do with a region: UCX refuses Neuron VRAM,
  LIBFABRIC registers it as FI_HMEM_NEURON after the runtime started and silently as
  FI_HMEM_SYSTEM before, and an address outside every allocation fails as
  "Failed to retrieve placement for VA".

What it cannot do: NIXL's LIBFABRIC backend does not load on a machine without EFA, and
UCX refuses "VRAM" that is host memory. So transfers on a CPU box use mem_type="DRAM":
the direct path then registers the fake HBM as DRAM over UCX. The backend's choice of
NIXL backend for real VRAM is tested against nixl_register() instead.

A testing aid, not part of the backend: nothing in kvpush_neuron imports it. It ships
in the backend package, beside the seam it fakes, so the two change together and a
third party can test a Neuron integration without hardware.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpush_neuron.environment import MAP_HBM, VISIBLE_CORES, hbm_mapped, parse_cores


@dataclass(frozen=True)
class FakeNeuronDevice:
    type: str  # "neuron" (TorchNeuron) or "xla" (the older stack)
    index: int

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


class FakeNeuronTensor:
    """A tensor in fake HBM. Like a real one it is no CPU tensor: only the runtime's
    copies (and NIXL, at data_ptr(), when HBM is mapped) reach its bytes."""

    def __init__(self, owner: FakeNeuron, memory: torch.Tensor, device: FakeNeuronDevice):
        self._owner = owner
        self._memory = memory
        self.device = device

    @property
    def shape(self) -> torch.Size:
        return self._memory.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._memory.dtype

    def dim(self) -> int:
        return self._memory.dim()

    def stride(self) -> tuple[int, ...]:
        return self._memory.stride()

    def element_size(self) -> int:
        return self._memory.element_size()

    def data_ptr(self) -> int:
        return self._owner.address_of(self)

    def pin_memory(self) -> Any:
        raise RuntimeError("pin_memory() on a Neuron process's tensors can crash the runtime")

    def __getitem__(self, index: Any) -> FakeNeuronTensor:
        """A view (layers that share one allocation are views of it)."""
        return FakeNeuronTensor(self._owner, self._memory[index], self.device)

    def __repr__(self) -> str:
        return f"FakeNeuronTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {self.device})"


def default_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kvpush-fake-neuron-{os.getuid()}"


class FakeNeuron:
    """The fake runtime (kvpush_neuron.runtime.NeuronRuntime) plus the device's test API."""

    def __init__(
        self,
        cores: int = 2,
        legacy: bool = False,
        mem_type: str = "VRAM",
        start_on_alloc: bool = True,
        lock_dir: str | Path | None = None,
    ) -> None:
        self.cores = cores
        self.legacy = legacy
        self.mem_type = mem_type
        self.start_on_alloc = start_on_alloc
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()
        self.visible: list[int] = []
        self.syncs = 0
        self._started = False
        self._mapped: bool | None = None  # read once, at the first allocation
        self._table: dict[int, int] = {}  # the address table: allocation base -> bytes
        self._keep: list[torch.Tensor] = []
        self._queue: list[tuple[FakeNeuronTensor, Any, Any]] = []
        self._queue_lock = threading.Lock()  # the model writes while the NIXL thread syncs
        self._locks: list[Any] = []

    # -- the device, as a test drives it -------------------------------------------------

    def zeros(
        self, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16, device: int = 0
    ) -> FakeNeuronTensor:
        if self.start_on_alloc:
            self.start()
        if device >= max(len(self.visible), 1):
            raise RuntimeError(
                f"NRT: neuron:{device} is not visible to this process "
                f"({VISIBLE_CORES}={os.environ.get(VISIBLE_CORES, 'unset')})"
            )
        if self._mapped is None:
            self._mapped = hbm_mapped(os.environ.get(MAP_HBM))
        memory = torch.zeros(tuple(shape), dtype=dtype)
        self._table[memory.data_ptr()] = memory.numel() * memory.element_size()
        self._keep.append(memory)
        kind = "xla" if self.legacy else "neuron"
        return FakeNeuronTensor(self, memory, FakeNeuronDevice(kind, device))

    def write(self, tensor: FakeNeuronTensor, index: Any, value: Any) -> None:
        """A kernel writing tensor[index] = value: queued until the device syncs."""
        with self._queue_lock:
            self._queue.append((tensor, index, value))

    def read(self, tensor: FakeNeuronTensor) -> torch.Tensor:
        """What HBM holds now (landed writes only), as a host copy."""
        return tensor._memory.clone()

    def address_of(self, tensor: FakeNeuronTensor) -> int:
        if self.legacy:
            raise RuntimeError(
                "XLA tensors have no storage: data_ptr() is not available on this device"
            )
        return tensor._memory.data_ptr() if self._mapped else 0

    def close(self) -> None:
        """Give the claimed cores back (a process exiting does this too)."""
        while self._locks:
            self._locks.pop().close()

    # -- the seam (kvpush_neuron.runtime.NeuronRuntime) ------------------------------------

    def device_index(self, tensor: Any) -> int | None:
        if isinstance(tensor, FakeNeuronTensor) and tensor._owner is self:
            return tensor.device.index
        return None

    def is_legacy(self, tensor: Any) -> bool:
        return tensor.device.type == "xla"

    def started(self) -> bool:
        return self._started

    def too_late(self) -> str | None:
        if self._mapped is not None:
            return f"a device tensor was already allocated (the runtime read {MAP_HBM} then)"
        if self._started:
            return f"the Neuron runtime already started (it read {VISIBLE_CORES} then)"
        return None

    def start(self) -> None:
        if self._started:
            return
        spec = os.environ.get(VISIBLE_CORES)
        wanted = parse_cores(spec) if spec else list(range(self.cores))
        missing = [core for core in wanted if not 0 <= core < self.cores]
        if missing:
            raise RuntimeError(f"NRT: no NeuronCore {missing} on this host ({self.cores} cores)")
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        for core in wanted:
            handle = open(self.lock_dir / f"core{core}.lock", "w")  # noqa: SIM115 (held open)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                self.close()
                raise RuntimeError(
                    f"NRT: NeuronCore {core} is in use by another process; give each process "
                    f"its own core with {VISIBLE_CORES}"
                ) from None
            self._locks.append(handle)
        self.visible = wanted
        self._started = True

    def synchronize(self, legacy: bool = False) -> None:
        with self._queue_lock:
            self.syncs += 1
            for tensor, index, value in self._queue:
                tensor._memory[index] = value
            self._queue.clear()

    def gather(self, tensor: Any, dim: int, block_ids: Sequence[int]) -> torch.Tensor:
        self.synchronize()  # a device->host copy waits for the writes queued before it
        return tensor._memory.index_select(dim, torch.tensor(list(block_ids))).clone()

    def scatter(self, tensor: Any, dim: int, block_ids: Sequence[int], host: Any) -> None:
        tensor._memory.index_copy_(dim, torch.tensor(list(block_ids)), host)

    # -- what NIXL would do with this memory ---------------------------------------------

    def nixl_register(self, backend: str, mem_type: str, addr: int, nbytes: int) -> str:
        """The memory kind NIXL would file the region under, or the error it would raise."""
        if mem_type == "DRAM":
            return "FI_HMEM_SYSTEM"
        if backend != "LIBFABRIC":
            raise RuntimeError(f"{backend}: VRAM memory is detected as host; cannot register it")
        if not self._started:
            return "FI_HMEM_SYSTEM"  # the silent degrade: no error, wrong memory kind
        if not any(base <= addr and addr + nbytes <= base + n for base, n in self._table.items()):
            where = f"{addr:#x}" if addr else "(nil)"
            raise RuntimeError(f"Failed to retrieve placement for VA: {where}")
        return "FI_HMEM_NEURON"

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
