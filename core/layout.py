"""Where each KV block lives, as plain numbers, and the NIXL descriptors that follow.

A KVLayout is the wire format of a worker's KV cache: what a backend's description
comes to (kvpush.backend derives it from tensor views), what NIXL registers, and what
the peer checks its own layout against. Per layer it holds one or more runs of
equally spaced blocks. A run holds K and V back to back inside each block ("KV",
the block-major layout `(blocks, 2, ...)`), only K or only V ("K", "V": the
K/V-major layout `(2, blocks, ...)`), or K and V interleaved below the block
("mixed": vLLM's CPU layout packs them in the last dimension; MLA has one latent).
Two peers whose layouts differ only between "KV" and "K"+"V" still pair: transfers
then go at K/V granularity, which maps one layout onto the other byte for byte.

With tensor parallelism a worker's blocks hold only its share of the model's KV
heads (its Shard). Workers of different TP sizes pair when the heads lie outermost
inside a block (vLLM's CPU layout, and HND on GPUs): `plan` says which slice of a
producer rank's block fills which slice of a consumer rank's, and `assignment`
which producer rank fills each consumer rank's heads (exactly one per head, among
replicas when there are fewer heads than ranks). BlockTable turns a layout's
transfer units into NIXL descriptor rows.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import msgspec
import numpy as np

from kvpush.errors import RegionError
from kvpush.regions import MemRegion

PARTS = ("KV", "K", "V", "mixed")


class Shard(msgspec.Struct, frozen=True):
    """Which of the model's `heads` KV heads TP rank `rank` of `world` holds, as vLLM
    shards them: an equal share each, or, with fewer heads than ranks, one head,
    replicated over world / heads ranks. MLA's latent is one head, replicated."""

    rank: int = 0
    world: int = 1
    heads: int = 1

    @property
    def first(self) -> int:
        if self.heads >= self.world:
            return self.rank * (self.heads // self.world)
        return self.rank * self.heads // self.world

    @property
    def count(self) -> int:
        return max(1, self.heads // self.world)

    def holds(self, head: int) -> bool:
        return self.first <= head < self.first + self.count


class Piece(NamedTuple):
    """Heads [first, first + count) of the model go from producer rank `src` to
    consumer rank `dst`."""

    src: int
    dst: int
    first: int
    count: int


def assignment(src_world: int, dst_world: int, heads: int) -> list[Piece]:
    """Which producer rank fills which heads of each consumer rank: every head a
    consumer rank holds comes from exactly one producer rank holding it (replicas
    taken in turn by consumer rank), consecutive heads from one rank in one piece."""
    pieces: list[Piece] = []
    for dst in range(dst_world):
        mine = Shard(dst, dst_world, heads)
        for head in range(mine.first, mine.first + mine.count):
            holders = [s for s in range(src_world) if Shard(s, src_world, heads).holds(head)]
            src = holders[dst % len(holders)]
            last = pieces[-1] if pieces else None
            if last and (last.src, last.dst) == (src, dst) and last.first + last.count == head:
                pieces[-1] = last._replace(count=last.count + 1)
            else:
                pieces.append(Piece(src, dst, head, 1))
    return pieces


def tp_problem(src_world: int, dst_world: int, heads: int) -> str | None:
    """Why producer and consumer TP sizes cannot pair for a model of `heads` KV
    heads, or None. Pairable: one size divides the other."""
    if src_world % dst_world and dst_world % src_world:
        return (
            f"tensor-parallel sizes {src_world} (prefill) and {dst_world} (decode) do not "
            "divide one another: a decode rank's KV heads would straddle prefill ranks"
        )
    return None


def block_size_problem(src_tokens: int, dst_tokens: int) -> str | None:
    """Why a producer of `src_tokens` tokens per block cannot fill a consumer's blocks
    of `dst_tokens`, or None. A block's bytes are one whole unit of the transfer, so
    the sizes must be equal: the same --block-size on both instances."""
    if src_tokens != dst_tokens:
        return (
            f"block sizes differ: prefill holds {src_tokens} tokens per block, decode "
            f"{dst_tokens}; kvpush pairs equal block sizes only (start both with the same "
            "--block-size)"
        )
    return None


def sources(dst: Shard, src_world: int) -> list[tuple[int, int]]:
    """The producer ranks consumer rank `dst` takes KV heads from, each with the number
    of consumer ranks that producer rank fills (a claim's `parts`)."""
    pieces = assignment(src_world, dst.world, dst.heads)
    mine = sorted({p.src for p in pieces if p.dst == dst.rank})
    return [(src, len({p.dst for p in pieces if p.src == src})) for src in mine]


class BlockRun(msgspec.Struct, frozen=True):
    """Block i of the run occupies [base + i * stride, + block_bytes)."""

    base: int
    stride: int
    block_bytes: int
    part: str = "KV"


class KVLayout(msgspec.Struct, frozen=True):
    """A worker's KV cache: the regions to register and every layer's block runs.

    `inner` names the element order inside one K or V block (for example
    "tokens,heads,dim"); peers must agree on it and on `dtype`, because a byte copy
    cannot transpose.
    """

    regions: tuple[MemRegion, ...]
    layers: tuple[tuple[BlockRun, ...], ...]
    num_blocks: int
    tokens_per_block: int
    dtype: str
    inner: str
    layer_names: tuple[str, ...] = ()
    shard: Shard = Shard()

    def __post_init__(self) -> None:
        check_layout(self)

    @property
    def mem_type(self) -> str:
        return self.regions[0].mem_type

    @property
    def device_id(self) -> int:
        return self.regions[0].device_id

    def digest(self) -> str:
        """Changes whenever any address, size or shape changes (a re-registration)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]


class Unit(NamedTuple):
    """One transfer unit of a layer: the same slice of every block."""

    layer: int
    part: str
    base: int
    stride: int
    nbytes: int


def check_layout(layout: KVLayout) -> None:
    if not layout.regions:
        raise RegionError("a KV layout needs at least one memory region")
    spaces = {(r.mem_type, r.device_id) for r in layout.regions}
    if len(spaces) != 1:
        raise RegionError(f"a KV layout must live on one device; got {sorted(spaces)}")
    if layout.num_blocks <= 0:
        raise RegionError(f"num_blocks must be > 0, got {layout.num_blocks}")
    if layout.tokens_per_block <= 0:
        raise RegionError(f"tokens_per_block must be > 0, got {layout.tokens_per_block}")
    if not layout.layers:
        raise RegionError("a KV layout needs at least one layer")
    if layout.layer_names and len(layout.layer_names) != len(layout.layers):
        raise RegionError("layer_names must name every layer, or be empty")
    for index, runs in enumerate(layout.layers):
        _check_layer(layout, index, runs)


def _check_layer(layout: KVLayout, index: int, runs: tuple[BlockRun, ...]) -> None:
    if not runs:
        raise RegionError(f"layer {index} has no block runs")
    k_bytes = v_bytes = 0
    for run in runs:
        if run.part not in PARTS:
            raise RegionError(f"layer {index}: run part {run.part!r} is not one of {PARTS}")
        if run.block_bytes <= 0 or (run.part == "KV" and run.block_bytes % 2):
            raise RegionError(f"layer {index}: block size {run.block_bytes} bytes is not usable")
        if layout.num_blocks > 1 and run.stride < run.block_bytes:
            raise RegionError(
                f"layer {index}: stride {run.stride} is smaller than the block ({run.block_bytes})"
            )
        extent = run.stride * (layout.num_blocks - 1) + run.block_bytes
        if not any(region.contains(run.base, extent) for region in layout.regions):
            raise RegionError(
                f"layer {index}: blocks at [{run.base:#x}, +{extent}) are outside every region"
            )
        k_bytes += run.block_bytes // 2 if run.part == "KV" else run.block_bytes * (run.part == "K")
        v_bytes += run.block_bytes // 2 if run.part == "KV" else run.block_bytes * (run.part == "V")
    if any(run.part == "mixed" for run in runs) and len(runs) != 1:
        raise RegionError(f"layer {index}: a mixed K/V run must be the layer's only run")
    if k_bytes != v_bytes:
        raise RegionError(f"layer {index}: K holds {k_bytes} bytes a block but V holds {v_bytes}")


def units(layout: KVLayout, split: bool) -> list[Unit]:
    """The layout's transfer units, layer by layer; with `split`, K and V apart."""
    result: list[Unit] = []
    for index, runs in enumerate(layout.layers):
        if not split:
            result.extend(Unit(index, r.part, r.base, r.stride, r.block_bytes) for r in runs)
            continue
        k_units, v_units = [], []
        for r in runs:
            if r.part == "mixed":
                raise RegionError(
                    f"layer {index} interleaves K and V inside a block; it can only pair "
                    "with a peer of the same layout"
                )
            if r.part == "KV":
                half = r.block_bytes // 2
                k_units.append(Unit(index, "K", r.base, r.stride, half))
                v_units.append(Unit(index, "V", r.base + half, r.stride, half))
            else:
                (k_units if r.part == "K" else v_units).append(
                    Unit(index, r.part, r.base, r.stride, r.block_bytes)
                )
        result.extend(k_units + v_units)
    return result


def _shape(layout_units: list[Unit]) -> list[tuple[int, str, int]]:
    return [(u.layer, u.part, u.nbytes) for u in layout_units]


def pairing_split(local: KVLayout, remote: KVLayout) -> bool:
    """Whether two layouts pair at K/V granularity (True) or whole blocks (False).

    Raises RegionError naming the difference when no byte-for-byte mapping exists.
    """
    for field in ("tokens_per_block", "dtype", "inner"):
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise RegionError(f"KV layouts differ in {field}: local {mine!r}, remote {theirs!r}")
    if len(local.layers) != len(remote.layers):
        raise RegionError(
            f"KV layouts differ in layer count: local {len(local.layers)}, "
            f"remote {len(remote.layers)}"
        )
    if _shape(units(local, False)) == _shape(units(remote, False)):
        return False
    mine, theirs = _shape(units(local, True)), _shape(units(remote, True))
    if mine == theirs:
        return True
    if len(mine) != len(theirs):
        raise RegionError(
            f"KV layouts cannot be mapped block for block: local has {len(mine)} K/V slices "
            f"per block, remote {len(theirs)}"
        )
    first = next((a, b) for a, b in zip(mine, theirs, strict=True) if a != b)
    raise RegionError(
        "KV layouts cannot be mapped block for block: first difference (layer, part, bytes): "
        f"local {first[0]}, remote {first[1]}"
    )


def plan(src: KVLayout, dst: KVLayout) -> tuple[list[Unit], list[Unit]]:
    """The transfer units of a producer rank's layout (`src`) and a consumer rank's
    (`dst`), aligned: unit i of one fills unit i of the other, block for block.

    Equal TP sizes move whole blocks, rank r to rank r (K and V apart when one side
    keeps them apart). Different ones move each consumer rank's heads from the
    producer rank `assignment` names, as slices of the blocks. RegionError names the
    difference when no byte-for-byte mapping exists.
    """
    a, b = src.shard, dst.shard
    problem = block_size_problem(src.tokens_per_block, dst.tokens_per_block)
    if problem:
        raise RegionError(problem)
    if a.heads != b.heads:
        raise RegionError(
            f"KV layouts differ in KV heads: the producer's model has {a.heads}, the "
            f"consumer's {b.heads} (another model?)"
        )
    if a.world == b.world:
        if a.rank != b.rank:
            raise RegionError(f"rank mismatch: producer rank {a.rank}, consumer rank {b.rank}")
        split = pairing_split(src, dst)
        return units(src, split), units(dst, split)
    problem = tp_problem(a.world, b.world, a.heads)
    if problem:
        raise RegionError(problem)
    if src.dtype != dst.dtype:
        raise RegionError(
            f"KV layouts differ in dtype: producer {src.dtype!r}, consumer {dst.dtype!r}"
        )
    src_units, dst_units = _head_units(src), _head_units(dst)
    if _per_head(src.inner) != _per_head(dst.inner):
        raise RegionError(
            f"KV layouts differ inside a head: producer [{src.inner}], consumer [{dst.inner}]"
        )
    pairs = assignment(a.world, b.world, a.heads)
    pieces = [p for p in pairs if (p.src, p.dst) == (a.rank, b.rank)]
    if not pieces:
        raise RegionError(f"producer rank {a.rank} holds none of consumer rank {b.rank}'s KV heads")
    if [(u.layer, u.part) for u in src_units] != [(u.layer, u.part) for u in dst_units]:
        raise RegionError("KV layouts cannot be mapped head for head: their layers differ")
    planned_src: list[Unit] = []
    planned_dst: list[Unit] = []
    for s_unit, d_unit in zip(src_units, dst_units, strict=True):  # layer-major, as tables are
        for piece in pieces:
            planned_src.append(_heads_of(s_unit, a, piece))
            planned_dst.append(_heads_of(d_unit, b, piece))
    return planned_src, planned_dst


def _per_head(inner: str) -> str:
    """A block's inner layout without its heads count (what one head holds)."""
    dims = inner.split(",")
    return ",".join(dims[1:]) if dims and dims[0].startswith("heads:") else inner


def _head_units(layout: KVLayout) -> list[Unit]:
    """The layout's units in which each head is one contiguous slice: K and V apart,
    unless they interleave below the head (vLLM's CPU layout)."""
    if not layout.inner.startswith("heads:") and layout.shard.count > 1:
        raise RegionError(
            f"a head-split transfer needs the KV heads outermost inside a block, and this "
            f"layout's block is [{layout.inner}] (on GPUs: vLLM's HND layout)"
        )
    mixed = any(run.part == "mixed" for runs in layout.layers for run in runs)
    return units(layout, split=not mixed)


def _heads_of(unit: Unit, shard: Shard, piece: Piece) -> Unit:
    """The slice of `unit` (a block of `shard`'s heads) that holds `piece`'s heads."""
    per_head = unit.nbytes // shard.count
    offset = (piece.first - shard.first) * per_head
    return unit._replace(base=unit.base + offset, nbytes=piece.count * per_head)


class BlockTable:
    """Every (unit, block) slice of a layout as NIXL descriptor rows, built once.

    Row `unit * num_blocks + block` holds block `block` of unit `unit`, so moving some
    blocks is a list of row indices: prepare the table with NIXL once, post by index.
    The units are the layout's own (K and V apart if `split`), or a plan's.
    """

    def __init__(
        self, layout: KVLayout, split: bool = False, layout_units: list[Unit] | None = None
    ) -> None:
        self.layout = layout
        if layout_units is None:
            layout_units = units(layout, split)
        self.num_units = len(layout_units)
        nb = layout.num_blocks
        self.rows = np.empty((self.num_units * nb, 3), dtype=np.uint64)
        blocks = np.arange(nb, dtype=np.uint64)
        for i, unit in enumerate(layout_units):
            rows = self.rows[i * nb : (i + 1) * nb]
            rows[:, 0] = np.uint64(unit.base) + blocks * np.uint64(unit.stride)
            rows[:, 1] = unit.nbytes
            rows[:, 2] = layout.device_id
        self._unit_offsets = np.arange(self.num_units, dtype=np.int64)[:, None] * nb
        # Units are layer-major: layer l owns units [first[l], first[l + 1]).
        self._first_unit = np.searchsorted(
            [u.layer for u in layout_units], range(len(layout.layers) + 1)
        )

    def ids(
        self, block_ids: np.ndarray | list[int], layers: tuple[int, int] | None = None
    ) -> np.ndarray:
        """Row indices for `block_ids` (in layers [start, stop) if given), unit-major.

        RegionError if any block id is out of range.
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        check_block_ids(self.layout, ids)
        offsets = self._unit_offsets
        if layers is not None:
            start, stop = layers
            if not 0 <= start < stop <= len(self.layout.layers):
                raise RegionError(f"layer range {layers} outside 0..{len(self.layout.layers)}")
            offsets = offsets[self._first_unit[start] : self._first_unit[stop]]
        return (offsets + ids[None, :]).ravel()


def check_block_ids(layout: KVLayout, ids: np.ndarray) -> None:
    if ids.ndim != 1:
        raise RegionError(f"block ids must be a flat list, got shape {ids.shape}")
    bad = ids[(ids < 0) | (ids >= layout.num_blocks)]
    if bad.size:
        raise RegionError(
            f"block ids {bad[:8].tolist()} are out of range: the layout has "
            f"{layout.num_blocks} blocks (0..{layout.num_blocks - 1})"
        )
