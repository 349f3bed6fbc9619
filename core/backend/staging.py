"""Hook implementations shared by backends that stage KV through host buffers.

A backend whose DeviceKV.state carries a `staging` object (with `copy(block_ids,
direction)` and `release()`, or None on the direct path) imports these two names
into its plugin module; pluggy registers them as that backend's own hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.backend.hookspecs import hookimpl
from kvpush.backend.records import DeviceKV
from kvpush.errors import BackendError


@hookimpl
def kvpush_stage_blocks(kv: DeviceKV, block_ids: Sequence[int], direction: str) -> None:
    if kv.state.staging is None:
        raise BackendError(f"KV on {kv.device} is not staged; nothing to copy")
    kv.state.staging.copy(block_ids, direction)


@hookimpl
def kvpush_release(kv: DeviceKV) -> None:
    if kv.state.staging is not None:
        kv.state.staging.release()
