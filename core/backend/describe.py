"""Helpers for `kvpush_describe_kv`: read tensors as views, find their device, derive a layout.

A backend never hands the core a tensor. It reads each layer's tensor into a TensorView
(torch_view does it for any torch tensor), checks with claimed_device that the tensors
are all its own and on one device, and lets layout_from_views turn the views into the
KVLayout that NIXL registers and the peer pairs with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvpush.errors import BackendError, RegionError
from kvpush.layout import BlockRun, KVLayout
from kvpush.regions import MemRegion, merge_regions


class TensorView(NamedTuple):
    """What a backend reads off one KV tensor: enough to place every block.

    `strides` are in elements, as torch and numpy (divided by itemsize) report them.
    """

    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    device_id: int = 0
    mem_type: str = "DRAM"


def torch_view(tensor: Any, device_id: int, mem_type: str) -> TensorView:
    """The TensorView of any torch tensor, read through its own methods (no torch import)."""
    return TensorView(
        addr=tensor.data_ptr(),
        shape=tuple(tensor.shape),
        strides=tuple(tensor.stride()),
        itemsize=tensor.element_size(),
        dtype=str(tensor.dtype).removeprefix("torch."),
        device_id=device_id,
        mem_type=mem_type,
    )


def claimed_device(
    devices: Mapping[str, int | None], kind: str, scope: str = "one device"
) -> int | None:
    """The one device index all KV tensors share; None when none is on `kind`.

    `devices` maps tensor name to its index on `kind`, or None when the tensor lives
    elsewhere. A worker whose KV straddles devices is refused: NIXL registers one
    device per agent.
    """
    if all(index is None for index in devices.values()):
        return None
    strays = sorted(name for name, index in devices.items() if index is None)
    if strays:
        raise BackendError(f"KV tensors {strays} are not on a {kind} device but the others are")
    indices = sorted(set(devices.values()))
    if len(indices) != 1:
        raise BackendError(f"a worker's KV must live on {scope}; got devices {indices}")
    return indices[0]


def layout_from_views(
    views: dict[str, TensorView], dims: tuple[str, ...] | list[str], tokens_per_block: int = 0
) -> KVLayout:
    """Derive a KVLayout from per-layer tensor views and the meaning of their dimensions.

    `dims` names each dimension of the tensors' shape: "blocks" (required), "kv" (size 2,
    K then V; absent when K and V are interleaved below the block) and any other names
    for the dimensions inside a block. Memory order is read from the strides, so a
    permuted tensor is described as it really lies.
    """
    dims = tuple(dims)
    if "blocks" not in dims:
        raise RegionError(f"dims {dims} must name the 'blocks' dimension")
    if not views:
        raise RegionError("no KV tensors to describe")
    regions, layers, num_blocks, dtype, inner = [], [], None, None, None
    for name, view in views.items():
        runs, layer_inner, tokens = _runs_of(name, view, dims)
        blocks = view.shape[dims.index("blocks")]
        if num_blocks is not None and (blocks, view.dtype, layer_inner) != (
            num_blocks,
            dtype,
            inner,
        ):
            raise RegionError(
                f"layer {name!r} has {blocks} blocks of {view.dtype} [{layer_inner}]; "
                f"earlier layers have {num_blocks} blocks of {dtype} [{inner}]"
            )
        num_blocks, dtype, inner = blocks, view.dtype, layer_inner
        tokens_per_block = tokens_per_block or tokens
        layers.append(runs)
        extent = sum((n - 1) * s for n, s in zip(view.shape, view.strides, strict=True)) + 1
        regions.append(MemRegion(view.addr, extent * view.itemsize, view.device_id, view.mem_type))
    return KVLayout(
        regions=tuple(merge_regions(regions)),
        layers=tuple(layers),
        num_blocks=num_blocks,
        tokens_per_block=tokens_per_block or 1,
        dtype=dtype,
        inner=inner,
        layer_names=tuple(views),
    )


def _runs_of(
    name: str, view: TensorView, dims: tuple[str, ...]
) -> tuple[tuple[BlockRun, ...], str, int]:
    if len(dims) != len(view.shape) or len(view.strides) != len(view.shape):
        raise RegionError(
            f"layer {name!r}: shape {view.shape} does not match the dims {dims} it was given"
        )
    size = dict(zip(dims, view.shape, strict=True))
    stride = dict(zip(dims, view.strides, strict=True))
    if "kv" in size and size["kv"] != 2:
        raise RegionError(f"layer {name!r}: the 'kv' dimension has size {size['kv']}, not 2")
    # Memory order: outermost first. Ties (size-1 dims) keep the declared order.
    order = sorted(dims, key=lambda d: (-stride[d], dims.index(d)))
    outer = [d for d in order if d in ("blocks", "kv")]
    inner_dims = [d for d in order if d not in ("blocks", "kv")]
    if order[: len(outer)] != outer:
        raise RegionError(
            f"layer {name!r}: dimensions {order} put a per-token dimension outside the "
            "blocks; a block must be one contiguous slice"
        )
    expected = 1
    for d in reversed(inner_dims):
        if size[d] > 1 and stride[d] != expected:
            raise RegionError(f"layer {name!r}: the inside of a block is not dense (dim {d!r})")
        expected *= size[d]
    isz = view.itemsize
    block_stride = stride["blocks"] * isz
    inner = ",".join(f"{d}:{size[d]}" for d in inner_dims)
    if "kv" not in size:
        runs = (BlockRun(view.addr, block_stride, expected * isz, "mixed"),)
    elif outer[0] == "blocks":
        runs = (BlockRun(view.addr, block_stride, 2 * stride["kv"] * isz, "KV"),)
        if stride["kv"] != expected:
            raise RegionError(f"layer {name!r}: K and V halves of a block are not adjacent")
    else:
        kv_offset = stride["kv"] * isz
        runs = (
            BlockRun(view.addr, block_stride, expected * isz, "K"),
            BlockRun(view.addr + kv_offset, block_stride, expected * isz, "V"),
        )
    return runs, inner, size.get("tokens", 0)
