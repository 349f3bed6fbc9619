"""CUDA backend hooks: GPU KV tensors as VRAM regions, CUDA events as fences.

Everything CUDA-specific goes through kvpush_cuda.runtime (torch.cuda, imported on
first use); the layout is read from the live tensors by kvpush.backend.describe.

device_options the backend reads (the `config` of describe and prepare_process;
OPTIONS, declared in its BackendInfo, so any other key is refused):
  staging: "off" (default) and "auto" both mean direct: NIXL reads GPU memory, with
      no fallback (unlike Neuron's "auto"); "host" copies through host buffers, for
      setups without GPUDirect;
  pin_staging: with staging "host", pin those buffers (cudaHostRegister; default
      true; where the driver refuses, a warning and slower copies); false leaves
      them pageable, for hosts short of lockable memory;
  dims: override the dimension names the engine integration passed;
  tokens_per_block: when the dims name no "tokens" dimension.
"""

from __future__ import annotations

import glob
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.backend import (
    BackendInfo,
    DeviceKV,
    Probe,
    claimed_device,
    hookimpl,
    layout_from_views,
    torch_view,
)

# The staging hooks every staging backend shares: imported here, pluggy registers them as ours.
from kvpush.backend.staging import host_layout, kvpush_release, kvpush_stage_blocks  # noqa: F401
from kvpush.errors import ConfigError
from kvpush_cuda.runtime import get_runtime
from kvpush_cuda.staging import HostStaging

NAME = "cuda"
STAGING = ("off", "auto", "host")
OPTIONS = ("staging", "pin_staging", "dims", "tokens_per_block")
log = logging.getLogger(__name__)


@dataclass
class CudaState:
    """The backend's own part of a DeviceKV: the tensors (kept alive), device, staging."""

    tensors: dict[str, Any]
    index: int
    staging: HostStaging | None = None


def staging_mode(config: Mapping[str, Any]) -> str:
    mode = config.get("staging", "off")
    if mode not in STAGING:
        raise ConfigError(f"device_options staging must be one of {STAGING}, got {mode!r}")
    pin = config.get("pin_staging", True)
    if not isinstance(pin, bool):
        raise ConfigError(f"device_options pin_staging must be true or false, got {pin!r}")
    return "host" if mode == "host" else "off"


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    return BackendInfo(
        NAME,
        device_types=("cuda",),
        mem_types=("VRAM", "DRAM"),
        transfer_paths=("direct", "staged"),
        device_options=OPTIONS,
    )


@hookimpl
def kvpush_probe() -> Probe:
    # The driver's /proc entries answer without importing torch or creating a context.
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return Probe(NAME, True, f"{len(gpus)} NVIDIA GPU(s) in /proc/driver/nvidia/gpus")
    return Probe(NAME, False, "no NVIDIA driver or GPU (/proc/driver/nvidia/gpus is empty)")


@hookimpl
def kvpush_prepare_process(device_type: str, local_rank: int, config: Mapping[str, Any]) -> None:
    if device_type == NAME:
        staging_mode(config)  # a bad option fails here, before the engine allocates


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    runtime = get_runtime()
    devices = {name: runtime.device_index(t) for name, t in tensors.items()}
    index = claimed_device(devices, "CUDA", "one GPU")
    if index is None:
        return None
    dims = tuple(config.get("dims") or dims)
    tokens = int(config.get("tokens_per_block", 0))
    # NIXL must see the memory as it lies; the strides say how (permuted caches included).
    views = {name: torch_view(t, index, runtime.mem_type) for name, t in tensors.items()}
    layout = layout_from_views(views, dims, tokens)
    state = CudaState(dict(tensors), index)
    if staging_mode(config) == "off":
        return DeviceKV(NAME, f"cuda:{index}", layout, "direct", state=state)
    state.staging = HostStaging(tensors, dims, runtime, index, pin=config.get("pin_staging", True))
    staged = host_layout(state.staging.host, dims, layout.tokens_per_block)
    log.info("kvpush cuda: KV on cuda:%d is staged through host memory (staging=host)", index)
    return DeviceKV(NAME, f"cuda:{index}", staged, "staged", state=state)


@hookimpl
def kvpush_nixl_backends(kv: DeviceKV, requested: Sequence[str]) -> list[str]:
    # UCX reaches GPU memory (cuda_copy, cuda_ipc, GPUDirect RDMA); LIBFABRIC (EFA)
    # registers it as FI_HMEM_CUDA. Either serves host staging buffers.
    return list(requested) or ["UCX"]


@hookimpl
def kvpush_bind_thread(kv: DeviceKV) -> None:
    # Without a current device on the NIXL thread, UCX loses its CUDA-IPC/NVLink paths.
    get_runtime().set_device(kv.state.index)


@hookimpl
def kvpush_fence(kv: DeviceKV, layer: str | None) -> Any:
    # The layer's KV was written by kernels queued on the current stream; an event
    # recorded now completes when they have. RDMA ignores stream order, so the WRITE
    # must wait for it. One stream runs in order, so this event also covers earlier layers.
    return get_runtime().record_event(kv.state.index)


@hookimpl
def kvpush_wait_fence(kv: DeviceKV, fence: Any) -> None:
    get_runtime().wait_event(fence)
