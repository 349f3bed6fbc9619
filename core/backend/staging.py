"""What backends that stage KV through host buffers share: the buffers' layout and two hooks.

On the staged path NIXL never sees device memory. The backend keeps a host buffer per
KV tensor, describes those buffers (host_layout) as the DeviceKV's layout, and copies
blocks between device and host when the core asks. Its DeviceKV.state carries a
`staging` object shaped like Staging (None on the direct path); a backend imports
kvpush_stage_blocks and kvpush_release from here into its plugin module, and pluggy
registers them as that backend's own hooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvpush.backend.describe import layout_from_views, torch_view
from kvpush.backend.hookspecs import hookimpl
from kvpush.backend.records import DeviceKV
from kvpush.errors import BackendError
from kvpush.layout import KVLayout


class Staging(Protocol):
    """A backend's host buffers for one worker's KV, and the copies between them."""

    #: KV tensor name -> its host buffer (a CPU torch tensor).
    host: dict[str, Any]

    def copy(self, block_ids: Sequence[int], direction: str) -> None:
        """Copy `block_ids` of every layer: "to_host" before a send, "to_device" after one."""

    def release(self) -> None:
        """Free the buffers (unpin them first if pinned); safe to call twice."""


def host_layout(host: Mapping[str, Any], dims: Sequence[str], tokens_per_block: int) -> KVLayout:
    """The layout NIXL registers on the staged path: the host buffers, as DRAM."""
    views = {name: torch_view(buffer, 0, "DRAM") for name, buffer in host.items()}
    return layout_from_views(views, tuple(dims), tokens_per_block)


@hookimpl
def kvpush_stage_blocks(kv: DeviceKV, block_ids: Sequence[int], direction: str) -> None:
    if kv.state.staging is None:
        raise BackendError(f"KV on {kv.device} is not staged; nothing to copy")
    kv.state.staging.copy(block_ids, direction)


@hookimpl
def kvpush_release(kv: DeviceKV) -> None:
    if kv.state.staging is not None:
        kv.state.staging.release()
