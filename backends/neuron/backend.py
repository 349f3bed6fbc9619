"""Neuron backend hooks."""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.device import BackendInfo, DeviceKV, Probe
from kvpush.errors import BackendNotImplemented
from kvpush.hookspecs import hookimpl

NAME = "neuron"
_MISSING = ("kvpush_describe_kv",)


@hookimpl
def kvpush_backend_info() -> BackendInfo:
    return BackendInfo(
        NAME,
        device_types=("neuron",),
        mem_types=("VRAM", "DRAM"),
        transfer_paths=("direct", "staged"),
        missing=_MISSING,
    )


@hookimpl
def kvpush_probe() -> Probe:
    devices = glob.glob("/dev/neuron*")
    if devices:
        return Probe(NAME, True, f"{len(devices)} Neuron device(s) under /dev")
    return Probe(NAME, False, "no Neuron devices (/dev/neuron* absent)")


@hookimpl
def kvpush_describe_kv(
    tensors: Mapping[str, Any], dims: Sequence[str], config: Mapping[str, Any]
) -> DeviceKV | None:
    first = next(iter(tensors.values()))
    if getattr(getattr(first, "device", None), "type", None) not in ("neuron", "xla"):
        return None
    raise BackendNotImplemented(
        "describing Neuron KV tensors is not implemented for backend 'neuron'"
    )
