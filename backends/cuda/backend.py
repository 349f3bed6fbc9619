"""CUDA backend hooks."""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.device import BackendInfo, DeviceKV, Probe
from kvpush.errors import BackendNotImplemented
from kvpush.hookspecs import hookimpl

NAME = "cuda"
_MISSING = ("kvpush_describe_kv",)


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    return BackendInfo(
        NAME,
        device_types=("cuda",),
        mem_types=("VRAM",),
        transfer_paths=("direct",),
        missing=_MISSING,
    )


@hookimpl
def kvpush_probe() -> Probe:
    # The driver's /proc entries answer without creating a CUDA context.
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return Probe(NAME, True, f"{len(gpus)} NVIDIA GPU(s) in /proc/driver/nvidia/gpus")
    return Probe(NAME, False, "no NVIDIA driver or GPU (/proc/driver/nvidia/gpus is empty)")


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    first = next(iter(tensors.values()))
    if getattr(getattr(first, "device", None), "type", None) != "cuda":
        return None
    raise BackendNotImplemented("describing CUDA KV tensors is not implemented for backend 'cuda'")
