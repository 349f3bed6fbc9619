"""The process environment the Neuron runtime reads once, and when it is too late to set it.

NEURON_RT_VISIBLE_CORES is read when the runtime starts: without it the first process
takes every NeuronCore and the next one on the host fails. NEURON_RT_MAP_HBM is read at
the first device allocation: without it a tensor's data_ptr() is 0 and NIXL cannot
register HBM ("Failed to retrieve placement for VA: (nil)").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from kvpush.errors import BackendError, ConfigError

MAP_HBM = "NEURON_RT_MAP_HBM"
VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"
_EFFECT = {
    MAP_HBM: "data_ptr() stays 0, so HBM cannot be registered with NIXL",
    VISIBLE_CORES: "this process keeps every core the runtime already claimed",
}


def parse_cores(spec: str) -> list[int]:
    """The cores named by a NEURON_RT_VISIBLE_CORES value: "3", "0-3", "0,2,4-5"."""
    cores: list[int] = []
    try:
        for part in str(spec).split(","):
            first, _, last = part.strip().partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(
            f"{VISIBLE_CORES}={spec!r} is not a core list like 0, 0-3 or 0,2"
        ) from None
    if not cores:
        raise ConfigError(f"{VISIBLE_CORES}={spec!r} names no core")
    return cores


def hbm_mapped(value: str | None) -> bool:
    """How the runtime reads NEURON_RT_MAP_HBM: "true" or a positive integer."""
    if value is None:
        return False
    value = value.strip().lower()
    return value == "true" or (value.isdigit() and int(value) > 0)


def planned(
    local_rank: int, config: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables this rank needs: one core of its own, and HBM mapping unless staged."""
    plan = {}
    if "visible_cores" in config:
        spec = str(config["visible_cores"])
        parse_cores(spec)
    elif VISIBLE_CORES in environ:
        # A launcher may give the node's workers one range: rank r takes the r-th core.
        cores = parse_cores(environ[VISIBLE_CORES])
        if len(cores) == 1:
            spec = environ[VISIBLE_CORES]
        elif local_rank < len(cores):
            spec = str(cores[local_rank])
        else:
            raise ConfigError(
                f"{VISIBLE_CORES}={environ[VISIBLE_CORES]} has {len(cores)} cores; "
                f"local rank {local_rank} has none of its own"
            )
    else:
        spec = str(int(config.get("core_offset", 0)) + local_rank)
    plan[VISIBLE_CORES] = spec
    if config.get("staging", "auto") != "host":
        plan[MAP_HBM] = "1"
    return plan


def prepare(
    local_rank: int,
    config: Mapping[str, Any],
    too_late: str | None,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Set what this rank needs; BackendError if the runtime already read other values.

    `too_late` is the runtime's reason it can no longer take new settings, or None.
    Returns what was set.
    """
    environ = os.environ if environ is None else environ
    plan = planned(local_rank, config, environ)
    missing = {
        key: value
        for key, value in plan.items()
        if not (hbm_mapped(environ.get(key)) if key == MAP_HBM else environ.get(key) == value)
    }
    if missing and too_late:
        effects = "; ".join(f"{key}={value}: {_EFFECT[key]}" for key, value in missing.items())
        raise BackendError(
            f"too late to prepare this process for Neuron: {too_late}, and the runtime reads "
            f"its settings only once ({effects}). Call prepare_process before the first "
            "device allocation, or export these variables when launching the process"
        )
    environ.update(missing)
    return missing
