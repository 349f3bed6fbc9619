"""Neuron (Trainium/Inferentia) backend hooks.

Two transfer paths:
- direct: TorchNeuron with NEURON_RT_MAP_HBM=1 set before the first allocation, and the
  runtime up before the NIXL agent: HBM is registered as VRAM, over LIBFABRIC (EFA);
  UCX cannot register Neuron memory.
- staged: the older XLA stack (no device pointer), or no HBM mapping: KV is copied
  through page-aligned host buffers registered as DRAM, device->host after the fence
  and before the WRITE, host->device after the KV arrives.

Everything Neuron-specific goes through kvpush_neuron.runtime (torch-neuronx, imported
on first use). device_options the backend reads (the `config` of describe and
prepare_process; OPTIONS, declared in its BackendInfo, so any other key is refused):
  staging: "auto" (default: direct when possible, else staged, with a warning saying
      why), "host" (always staged) or "off" (direct or a clear error);
  visible_cores / core_offset: this rank's NEURON_RT_VISIBLE_CORES (default: the
      local rank, or the local rank's core of a range the launcher exported);
  dims: override the dimension names the engine integration passed;
  tokens_per_block: when the dims name no "tokens" dimension.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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

# The staging hooks every staging backend shares: imported here, pluggy registers them as ours.
from kvpush.backend.staging import host_layout, kvpush_release, kvpush_stage_blocks  # noqa: F401
from kvpush.errors import BackendError, ConfigError
from kvpush_neuron import environment
from kvpush_neuron.runtime import get_runtime
from kvpush_neuron.staging import HostStaging

NAME = "neuron"
DEVICE_TYPES = ("neuron", "xla")
STAGING = ("auto", "host", "off")
OPTIONS = ("staging", "visible_cores", "core_offset", "dims", "tokens_per_block")
#: vllm-neuron's per-layer KV cache: K and V apart, (2, num_blocks, heads, block_size, dim).
NEURON_KV_DIMS = ("kv", "blocks", "heads", "tokens", "dim")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NeuronFence:
    """Neuron has no events: a fence is a count of fences issued, satisfied by a sync."""

    seq: int


@dataclass
class NeuronState:
    tensors: dict[str, Any]
    legacy: bool
    staging: HostStaging | None = None
    issued: int = 0
    synced: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def staging_mode(config: Mapping[str, Any]) -> str:
    mode = config.get("staging", "auto")
    if mode not in STAGING:
        raise ConfigError(f"device_options staging must be one of {STAGING}, got {mode!r}")
    return mode


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    return BackendInfo(
        NAME,
        device_types=DEVICE_TYPES,
        mem_types=("VRAM", "DRAM"),
        transfer_paths=("direct", "staged"),
        device_options=OPTIONS,
    )


@hookimpl
def kvpush_probe() -> Probe:
    devices = glob.glob("/dev/neuron*")
    if not devices:
        return Probe(NAME, False, "no Neuron devices (/dev/neuron* absent)")
    mapped = environment.hbm_mapped(os.environ.get(environment.MAP_HBM))
    path = "direct over LIBFABRIC possible" if mapped else "staged unless it is set"
    return Probe(
        NAME,
        True,
        f"{len(devices)} Neuron device(s) under /dev; "
        f"{environment.MAP_HBM}={os.environ.get(environment.MAP_HBM, 'unset')} ({path})",
    )


@hookimpl
def kvpush_prepare_process(device_type: str, local_rank: int, config: Mapping[str, Any]) -> None:
    if device_type not in DEVICE_TYPES:
        return
    staging_mode(config)
    done = environment.prepare(local_rank, config, get_runtime().too_late())
    if done:
        log.info("kvpush neuron: rank %d environment %s", local_rank, done)


@hookimpl
def kvpush_init_runtime(device_type: str) -> None:
    if device_type in DEVICE_TYPES:
        get_runtime().start()


def _neuron_dims(config: Mapping[str, Any], dims: Sequence[str], ndim: int) -> tuple[str, ...]:
    if config.get("dims"):
        return tuple(config["dims"])
    if len(dims) != ndim and ndim == len(NEURON_KV_DIMS):
        # The engine integration's generic dims do not fit: this is vllm-neuron's cache.
        return NEURON_KV_DIMS
    return tuple(dims)


def _device_views(
    tensors: Mapping[str, Any], index: int, legacy: bool, mem_type: str
) -> tuple[dict[str, TensorView] | None, str]:
    """The tensors' views for direct registration, or None and why it cannot be done."""
    if legacy:
        return None, "the XLA stack's tensors have no device address (data_ptr() raises)"
    try:
        views = {name: torch_view(t, index, mem_type) for name, t in tensors.items()}
    except RuntimeError as exc:
        return None, f"data_ptr() failed ({exc})"
    if any(view.addr == 0 for view in views.values()):
        return None, (
            f"data_ptr() is 0: {environment.MAP_HBM}=1 was not set before this process's "
            "first device allocation (call prepare_process first, or export it)"
        )
    return views, ""


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    runtime = get_runtime()
    devices = {name: runtime.device_index(t) for name, t in tensors.items()}
    scope = "one NeuronCore (one visible core per process)"
    index = claimed_device(devices, "Neuron", scope)
    if index is None:
        return None
    first = next(iter(tensors.values()))
    legacy = runtime.is_legacy(first)
    dims = _neuron_dims(config, dims, len(first.shape))
    tokens = int(config.get("tokens_per_block", 0))
    mode = staging_mode(config)
    device = f"{first.device.type}:{index}"
    state = NeuronState(dict(tensors), legacy)
    if mode != "host":
        views, why = _device_views(tensors, index, legacy, runtime.mem_type)
        if views is not None:
            layout = layout_from_views(views, dims, tokens)
            return DeviceKV(NAME, device, layout, "direct", state=state)
        if mode == "off":
            raise BackendError(
                f"Neuron KV on {device} cannot be registered directly: {why}. "
                "Set device_options staging to 'auto' or 'host' to stage it through host memory"
            )
        log.warning("kvpush neuron: staging KV on %s through host memory: %s", device, why)
    state.staging = HostStaging(tensors, dims, runtime)
    staged = host_layout(state.staging.host, dims, tokens)
    return DeviceKV(NAME, device, staged, "staged", state=state)


@hookimpl
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    if kv.path == "staged":
        return list(requested) or ["UCX"]  # host buffers: any NIXL backend can reach them
    if not get_runtime().started():
        # NIXL's LIBFABRIC backend asks the Neuron runtime where an address lives when
        # the agent is made; before the runtime is up it files HBM as system memory
        # (FI_HMEM_SYSTEM) and says nothing. Transfers then fail or move the wrong bytes.
        raise BackendError(
            f"the Neuron runtime is not started, and a NIXL agent made now would register "
            f"{kv.device}'s HBM as plain system memory without any error. Call "
            "Backends.init_runtime('neuron') before starting the kvpush Node"
        )
    if kv.layout.mem_type != "VRAM":
        return list(requested) or ["UCX"]  # a fake device's loopback memory (see testing.py)
    wanted = list(requested) or ["LIBFABRIC"]
    chosen = [name for name in wanted if name != "UCX"]
    if not chosen:
        raise BackendError(
            f"NIXL backend(s) {list(requested)} cannot register Neuron HBM ({kv.device}): UCX "
            "does not know Neuron memory. Use LIBFABRIC (EFA; nixl_backends: ['LIBFABRIC']), "
            "or stage through host memory (device_options staging: 'host')"
        )
    if len(chosen) < len(wanted):
        log.warning("kvpush neuron: leaving out UCX, which cannot register Neuron HBM")
    return chosen


@hookimpl
def kvpush_bind_thread(kv: DeviceKV) -> None:
    # One visible core per process and no per-thread device: any thread may call NIXL.
    return None


@hookimpl
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    state = kv.state
    with state.lock:
        state.issued += 1
        return NeuronFence(state.issued)


@hookimpl
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    # NIXL reads HBM behind the device queue's back: wait until the queued writes land.
    # One sync covers every fence issued before it, so most waits cost nothing.
    state = kv.state
    with state.lock:
        if state.synced >= fence.seq:
            return
        target = state.issued
    get_runtime().synchronize(state.legacy)
    with state.lock:
        state.synced = max(state.synced, target)
