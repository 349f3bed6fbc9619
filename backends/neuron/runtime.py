"""The Neuron runtime seam: everything kvpush_neuron asks of TorchNeuron / torch-xla.

The backend's logic calls only this object, so tests swap in kvpush_neuron.testing.FakeNeuron
and run the real logic without Trainium. The real object imports torch and torch-neuronx
(or torch-xla on the older stack) on first use: they are not on the public package index
(the names there are empty placeholders) and must come from AWS's Neuron repository.
"""

from __future__ import annotations

import glob
import importlib
import os
from collections.abc import Sequence
from typing import Any, Protocol

from kvpush.backend import Swappable
from kvpush.errors import BackendError

#: Device types a Neuron tensor reports: TorchNeuron renames PrivateUse1 to "neuron";
#: before the rename it is "privateuseone"; the older stack's tensors are "xla".
NATIVE_TYPES = ("neuron", "privateuseone")
LEGACY_TYPES = ("xla",)
INSTALL_HINT = (
    "install torch-neuronx (and vllm-neuron) from the AWS Neuron package repository "
    "(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com ...); the "
    "packages of that name on the public index are empty placeholders"
)


class NeuronRuntime(Protocol):
    """What the backend needs from Neuron; TorchNeuron is the real one, FakeNeuron the test one."""

    #: NIXL memory type of device memory: "VRAM" (a fake may say "DRAM", see testing.py).
    mem_type: str

    def device_index(self, tensor: Any) -> int | None:
        """The Neuron device index of `tensor`, or None if it is not a Neuron tensor."""

    def is_legacy(self, tensor: Any) -> bool:
        """Whether `tensor` is from the older XLA stack (no device pointer at all)."""

    def started(self) -> bool:
        """Whether the Neuron runtime is up in this process (NIXL can then see HBM)."""

    def too_late(self) -> str | None:
        """Why environment set now would be ignored (the runtime already read it), or None."""

    def start(self) -> None:
        """Start the runtime (idempotent)."""

    def synchronize(self, legacy: bool) -> None:
        """Block until every device write queued so far has landed in HBM."""

    def gather(self, tensor: Any, dim: int, block_ids: Sequence[int]) -> Any:
        """A host (CPU) tensor holding `block_ids` of `tensor` along `dim`, in that order."""

    def scatter(self, tensor: Any, dim: int, block_ids: Sequence[int], host: Any) -> None:
        """Write `host` (as gather returns it) into `block_ids` of `tensor`; returns when done."""


def opened_devices() -> list[str]:
    """The /dev/neuron* files this process holds open: the runtime opens them at init."""
    found = []
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/neuron"):
            found.append(target)
    return sorted(set(found))


class TorchNeuron:
    """The real runtime: torch + torch-neuronx (native "neuron" device) or torch-xla."""

    mem_type = "VRAM"

    @staticmethod
    def _import(name: str) -> Any:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise BackendError(f"cannot import {name} ({exc}); {INSTALL_HINT}") from exc

    def device_index(self, tensor: Any) -> int | None:
        device = getattr(tensor, "device", None)
        if getattr(device, "type", None) not in NATIVE_TYPES + LEGACY_TYPES:
            return None
        return max(device.index or 0, 0)

    def is_legacy(self, tensor: Any) -> bool:
        return tensor.device.type in LEGACY_TYPES

    def started(self) -> bool:
        return bool(opened_devices())

    def too_late(self) -> str | None:
        devices = opened_devices()
        if devices:
            return f"the Neuron runtime already opened {devices[0]} in this process"
        return None

    def start(self) -> None:
        torch = self._import("torch")
        self._import("torch_neuronx")
        try:
            # The first allocation starts the runtime (and reads its environment).
            torch.empty(1, device="neuron")
        except RuntimeError:
            # The older stack: the runtime comes up with the XLA device.
            self._import("torch_xla.core.xla_model").xla_device()

    def synchronize(self, legacy: bool) -> None:
        if legacy:
            xm = self._import("torch_xla.core.xla_model")
            xm.mark_step()  # XLA writes are lazy until the graph is cut
            xm.wait_device_ops()
        else:
            self._import("torch").accelerator.synchronize()

    def gather(self, tensor: Any, dim: int, block_ids: Sequence[int]) -> Any:
        torch = self._import("torch")
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        # One device->host transfer per tensor: each has a high fixed cost on Neuron.
        return tensor.index_select(dim, ids).to("cpu")

    def scatter(self, tensor: Any, dim: int, block_ids: Sequence[int], host: Any) -> None:
        torch = self._import("torch")
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        tensor.index_copy_(dim, ids, host.to(tensor.device))
        self.synchronize(self.is_legacy(tensor))


# The runtime the backend uses: the real one unless a test installed another.
_runtime: Swappable[NeuronRuntime] = Swappable(TorchNeuron)
get_runtime = _runtime.get
set_runtime = _runtime.set
