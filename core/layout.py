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

Workers of different block sizes pair when one size divides the other and both
layouts name where a block's tokens lie (a `tokens` dimension): the pair then
counts in pages of the smaller size, and each larger block is that many pages, at
fixed offsets inside it. Block ids on the wire between two such peers are page ids
(block b of a side with f pages a block is pages b·f to b·f + f - 1), so a page
moves by descriptor, with no copy.

A hybrid model's KV cache groups (vLLM's hybrid manager: full-attention and
sliding-window layers) overlay the same memory: a layer of each group shares each
region, and a block id belongs to one group at a time. So a pair of block ids of
any group moves correctly through every region, and a transfer carries one list
whose position i holds `groups` ids, one per group (`interleave`). A position a
sliding window has left is padded with vLLM's null block (`null_block`): a pair
with it on either side moves nothing.

Which heads a rank holds is kvpush.shards', and block ids as pages kvpush.pages';
both are importable from here too, as the layout's arithmetic uses them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from kvpush.errors import RegionError
from kvpush.pages import block_size_problem as block_size_problem
from kvpush.pages import blocks_of as blocks_of
from kvpush.pages import page_factors as page_factors
from kvpush.pages import to_pages as to_pages
from kvpush.regions import MemRegion
from kvpush.shards import Piece as Piece
from kvpush.shards import Shard as Shard
from kvpush.shards import assignment as assignment
from kvpush.shards import sources as sources
from kvpush.shards import tp_problem as tp_problem

PARTS = ("KV", "K", "V", "mixed")


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
    groups: int = 1  # KV cache groups overlaid on the regions (hybrid models)
    states: int = 0  # of them, recurrent-state groups: their pages are not head-split
    null_block: int = -1  # the id that stands for no block (-1: every id is one)

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
    """One transfer unit of a layer: the same slice of every block, or, with `pages`
    above 1, of every page: page j of block b starts at base + b·stride + j·page_stride."""

    layer: int
    part: str
    base: int
    stride: int
    nbytes: int
    pages: int = 1
    page_stride: int = 0


def groups_problem(src: KVLayout, dst: KVLayout) -> str | None:
    """Why two layouts' KV cache groups cannot pair, or None: block lists interleave
    one id per group, so both sides must have as many, and a position is one block
    on both (equal block sizes)."""
    if src.groups != dst.groups:
        return (
            f"KV layouts differ in KV cache groups: the producer has {src.groups}, the "
            f"consumer {dst.groups} (another model, or vLLM's hybrid KV cache manager on "
            "one side only)"
        )
    if src.states != dst.states:
        return (
            f"KV layouts differ in recurrent-state groups: the producer has {src.states}, "
            f"the consumer {dst.states}"
        )
    if src.states and src.shard.world != dst.shard.world:
        return (
            f"the producer runs TP {src.shard.world} and the consumer TP {dst.shard.world} "
            "with recurrent state (Mamba, gated DeltaNet): each rank's state page moves "
            "whole, so such models pair at equal TP only"
        )
    if src.groups > 1 and src.tokens_per_block != dst.tokens_per_block:
        return (
            f"KV layouts differ in tokens_per_block (producer {src.tokens_per_block}, "
            f"consumer {dst.tokens_per_block}) with {src.groups} KV cache groups: "
            "hybrid models pair at equal block sizes only"
        )
    return None


def interleave(groups: Sequence[Sequence[int]]) -> list[int]:
    """One block list for a transfer from one list per KV cache group (equal lengths):
    position i's ids, group by group."""
    lengths = {len(group) for group in groups}
    if len(lengths) > 1:
        raise RegionError(f"KV cache groups hold different block counts: {sorted(lengths)}")
    return [block for position in zip(*groups, strict=True) for block in position]


def moving_pairs(
    src: Sequence[int], dst: Sequence[int], src_null: int, dst_null: int
) -> tuple[list[int], list[int]]:
    """The pairs of `src` and `dst` that move bytes: not those where either side is
    its layout's null block (a position outside a sliding window)."""
    if src_null < 0 and dst_null < 0:
        return list(src), list(dst)
    pairs = [(s, d) for s, d in zip(src, dst, strict=True) if s != src_null and d != dst_null]
    return [s for s, _ in pairs], [d for _, d in pairs]


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
    if layout.groups < 1:
        raise RegionError(f"groups must be >= 1, got {layout.groups}")
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


def _shape(layout_units: list[Unit], tokens: int = 1) -> list[tuple[int, str, int]]:
    """Units as (layer, part, bytes); per token when `tokens` is a block's token count."""
    return [(u.layer, u.part, u.nbytes // tokens) for u in layout_units]


def pairing_split(local: KVLayout, remote: KVLayout, same_tokens: bool = True) -> bool:
    """Whether two layouts pair at K/V granularity (True) or whole blocks (False);
    without `same_tokens`, blocks of different sizes compare per token.

    Raises RegionError naming the difference when no byte-for-byte mapping exists.
    """
    fields = ("tokens_per_block", "dtype", "inner") if same_tokens else ("dtype",)
    for field in fields:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise RegionError(f"KV layouts differ in {field}: local {mine!r}, remote {theirs!r}")
    if not same_tokens and _without_tokens(local.inner) != _without_tokens(remote.inner):
        raise RegionError(
            f"KV layouts differ inside a token: local [{local.inner}], remote [{remote.inner}]"
        )
    if len(local.layers) != len(remote.layers):
        raise RegionError(
            f"KV layouts differ in layer count: local {len(local.layers)}, "
            f"remote {len(remote.layers)}"
        )
    per = (1, 1) if same_tokens else (local.tokens_per_block, remote.tokens_per_block)
    if _shape(units(local, False), per[0]) == _shape(units(remote, False), per[1]):
        return False
    mine, theirs = _shape(units(local, True), per[0]), _shape(units(remote, True), per[1])
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
    (`dst`), aligned: unit i of one fills unit i of the other, block for block (page
    for page when the block sizes differ).

    Equal TP and block sizes move whole blocks, rank r to rank r (K and V apart when
    one side keeps them apart). Different TP sizes move each consumer rank's heads from
    the producer rank `assignment` names, as slices of the blocks; different block
    sizes move pages. RegionError names the difference when no byte-for-byte mapping
    exists.
    """
    a, b = src.shard, dst.shard
    problem = groups_problem(src, dst) or block_size_problem(
        src.tokens_per_block, dst.tokens_per_block
    )
    if problem:
        raise RegionError(problem)
    if a.heads != b.heads:
        raise RegionError(
            f"KV layouts differ in KV heads: the producer's model has {a.heads}, the "
            f"consumer's {b.heads} (another model?)"
        )
    if a.world == b.world and a.rank != b.rank:
        raise RegionError(f"rank mismatch: producer rank {a.rank}, consumer rank {b.rank}")
    runs = _pageable(src, dst) if src.tokens_per_block != dst.tokens_per_block else 1
    if a.world == b.world and src.tokens_per_block == dst.tokens_per_block:
        split = pairing_split(src, dst)
        return units(src, split), units(dst, split)
    problem = tp_problem(a.world, b.world, a.heads)
    if problem:
        raise RegionError(problem)
    if src.dtype != dst.dtype:
        raise RegionError(
            f"KV layouts differ in dtype: producer {src.dtype!r}, consumer {dst.dtype!r}"
        )
    heads_first = _heads_first(src.inner) or _heads_first(dst.inner)
    if src.tokens_per_block != dst.tokens_per_block and a.world == b.world and not heads_first:
        pairing_split(src, dst, same_tokens=False)
        # A page is a token range of K, or of V: never of both at once.
        return _paged(src, dst, _kv_units(src), _kv_units(dst), runs)
    src_units, dst_units = _head_units(src), _head_units(dst)
    if _without_tokens(_per_head(src.inner)) != _without_tokens(_per_head(dst.inner)):
        raise RegionError(
            f"KV layouts differ inside a head: producer [{src.inner}], consumer [{dst.inner}]"
        )
    pairs = assignment(a.world, b.world, a.heads)
    pieces = [p for p in pairs if (p.src, p.dst) == (a.rank, b.rank)]
    if not pieces:
        raise RegionError(f"producer rank {a.rank} holds none of consumer rank {b.rank}'s KV heads")
    if [(u.layer, u.part) for u in src_units] != [(u.layer, u.part) for u in dst_units]:
        raise RegionError("KV layouts cannot be mapped head for head: their layers differ")
    if src.tokens_per_block != dst.tokens_per_block:
        # A page of a larger block is contiguous only inside one head: one head apiece.
        pieces = [p._replace(first=h, count=1) for p in pieces for h in _heads(p)]
    planned_src: list[Unit] = []
    planned_dst: list[Unit] = []
    for s_unit, d_unit in zip(src_units, dst_units, strict=True):  # layer-major, as tables are
        for piece in pieces:
            planned_src.append(_heads_of(s_unit, a, piece))
            planned_dst.append(_heads_of(d_unit, b, piece))
    return _paged(src, dst, planned_src, planned_dst, runs)


def _heads(piece: Piece) -> range:
    return range(piece.first, piece.first + piece.count)


def _heads_first(inner: str) -> bool:
    return inner.startswith("heads:")


def _without_tokens(inner: str) -> str:
    """A block's inner layout without its token count (what one token holds, in order)."""
    return ",".join("tokens" if d.startswith("tokens:") else d for d in inner.split(","))


def _paged(
    src: KVLayout, dst: KVLayout, src_units: list[Unit], dst_units: list[Unit], runs: int
) -> tuple[list[Unit], list[Unit]]:
    """Aligned units, the larger block's cut into pages of the smaller block's tokens.

    A unit is one head's slice of a block (heads outermost) or the whole block. What
    lies above the tokens inside it (K and V planes, say) makes `runs` runs of tokens
    (`_pageable`), each cut into pages apart."""
    f_src, f_dst = page_factors(src.tokens_per_block, dst.tokens_per_block)
    if f_src == f_dst:
        return src_units, dst_units
    return (_pages_of(_runs_of(src_units, runs), f_src),
            _pages_of(_runs_of(dst_units, runs), f_dst))  # fmt: skip


def _pageable(src: KVLayout, dst: KVLayout) -> int:
    """The runs of tokens in a unit of either layout; RegionError if pages cannot be cut."""
    runs = _token_runs(src.inner)
    if runs is None or runs != _token_runs(dst.inner):
        shown = src.inner if runs is None else dst.inner
        raise RegionError(
            "block sizes differ, and a page of a larger block is a slice only when a "
            f"block names its tokens and both sides hold them alike; this layout's block "
            f"is [{shown}]"
        )
    return runs


def _token_runs(inner: str) -> int | None:
    """How many runs of tokens a unit of this block holds (the sizes of the dims above
    its tokens, below the heads), or None when it has no tokens dimension."""
    dims = inner.split(",")
    if dims and dims[0].startswith("heads:"):
        dims = dims[1:]
    runs = 1
    for dim in dims:
        name, _, size = dim.partition(":")
        if name == "tokens":
            return runs
        runs *= int(size or 1)
    return None


def _runs_of(layout_units: list[Unit], runs: int) -> list[Unit]:
    if runs == 1:
        return layout_units
    return [u._replace(base=u.base + r * (u.nbytes // runs), nbytes=u.nbytes // runs)
            for u in layout_units for r in range(runs)]  # fmt: skip


def _pages_of(layout_units: list[Unit], pages: int) -> list[Unit]:
    if pages == 1:
        return layout_units
    return [u._replace(nbytes=u.nbytes // pages, pages=pages, page_stride=u.nbytes // pages)
            for u in layout_units]  # fmt: skip


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
    return _kv_units(layout)


def _kv_units(layout: KVLayout) -> list[Unit]:
    """K and V apart, unless they interleave below the block's first dimension."""
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
    The units are the layout's own (K and V apart if `split`), or a plan's. A plan's
    paged units (a pair of block sizes) make the table one of pages: `pages` a block,
    indexed by page id.
    """

    def __init__(
        self, layout: KVLayout, split: bool = False, layout_units: list[Unit] | None = None
    ) -> None:
        self.layout = layout
        if layout_units is None:
            layout_units = units(layout, split)
        self.pages = layout_units[0].pages if layout_units else 1
        if any(u.pages != self.pages for u in layout_units):
            raise RegionError("a descriptor table's units must cut blocks into equal pages")
        self.num_units = len(layout_units)
        count = layout.num_blocks * self.pages
        self.rows = np.empty((self.num_units * count, 3), dtype=np.uint64)
        ids = np.arange(count, dtype=np.uint64)
        blocks, pages = ids // np.uint64(self.pages), ids % np.uint64(self.pages)
        for i, unit in enumerate(layout_units):
            rows = self.rows[i * count : (i + 1) * count]
            rows[:, 0] = (np.uint64(unit.base) + blocks * np.uint64(unit.stride)
                          + pages * np.uint64(unit.page_stride))  # fmt: skip
            rows[:, 1] = unit.nbytes
            rows[:, 2] = layout.device_id
        self._unit_offsets = np.arange(self.num_units, dtype=np.int64)[:, None] * count
        # Units are layer-major: layer l owns units [first[l], first[l + 1]).
        self._first_unit = np.searchsorted(
            [u.layer for u in layout_units], range(len(layout.layers) + 1)
        )

    def ids(
        self, block_ids: np.ndarray | list[int], layers: tuple[int, int] | None = None
    ) -> np.ndarray:
        """Row indices for `block_ids` (page ids in a paged table; in layers
        [start, stop) if given), unit-major.

        RegionError if any id is out of range.
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        check_block_ids(self.layout, ids, self.pages)
        offsets = self._unit_offsets
        if layers is not None:
            start, stop = layers
            if not 0 <= start < stop <= len(self.layout.layers):
                raise RegionError(f"layer range {layers} outside 0..{len(self.layout.layers)}")
            offsets = offsets[self._first_unit[start] : self._first_unit[stop]]
        return (offsets + ids[None, :]).ravel()


def check_block_ids(layout: KVLayout, ids: np.ndarray, pages: int = 1) -> None:
    if ids.ndim != 1:
        raise RegionError(f"block ids must be a flat list, got shape {ids.shape}")
    count = layout.num_blocks * pages
    bad = ids[(ids < 0) | (ids >= count)]
    if bad.size:
        what = "block" if pages == 1 else f"page ({pages} a block)"
        raise RegionError(
            f"{what} ids {bad[:8].tolist()} are out of range: the layout has "
            f"{count} (0..{count - 1})"
        )
