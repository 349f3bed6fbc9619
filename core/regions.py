"""Memory regions: the plain records the core registers with NIXL.

Backends turn device tensors into these; the core never looks at a tensor.
"""

from __future__ import annotations

import msgspec

from kvpush.errors import RegionError

MEM_TYPES = ("DRAM", "VRAM")


class MemRegion(msgspec.Struct, frozen=True):
    """`length` bytes at `addr` on device `device_id`, in NIXL memory type `mem_type`."""

    addr: int
    length: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        check_region(self)

    def as_reg_tuple(self) -> tuple[int, int, int, str]:
        return (self.addr, self.length, self.device_id, "")

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


def check_region(region: MemRegion) -> None:
    """Refuse regions NIXL would register but that cannot be right."""
    for field in ("addr", "length", "device_id"):
        value = getattr(region, field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise RegionError(f"region {field} must be an int, got {type(value).__name__}")
    if region.addr == 0:
        # A zero address is what a device that did not map its memory hands out
        # (Neuron without NEURON_RT_MAP_HBM=1); registering it fails much later, obscurely.
        raise RegionError("region address is 0: the device did not expose a usable pointer")
    if region.addr < 0 or region.addr >= 1 << 64:
        raise RegionError(f"region address {region.addr:#x} is outside the 64-bit address space")
    if region.length <= 0:
        raise RegionError(f"region at {region.addr:#x} has length {region.length}; it must be > 0")
    if region.device_id < 0:
        raise RegionError(f"region at {region.addr:#x} has negative device id {region.device_id}")
    if region.mem_type not in MEM_TYPES:
        raise RegionError(f"region memory type {region.mem_type!r} is not one of {MEM_TYPES}")


def merge_regions(regions: list[MemRegion]) -> list[MemRegion]:
    """The union of `regions`, each byte once.

    NIXL refuses a range registered twice, and engines often hand the same tensor to
    several layers, or layers that are views into one allocation.
    """
    ordered = sorted(regions, key=lambda r: (r.mem_type, r.device_id, r.addr))
    merged: list[MemRegion] = []
    for region in ordered:
        last = merged[-1] if merged else None
        same_space = last is not None and (last.mem_type, last.device_id) == (
            region.mem_type,
            region.device_id,
        )
        if last is not None and same_space and region.addr <= last.addr + last.length:
            end = max(last.addr + last.length, region.addr + region.length)
            merged[-1] = MemRegion(last.addr, end - last.addr, last.device_id, last.mem_type)
        else:
            merged.append(region)
    return merged
