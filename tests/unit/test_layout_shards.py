"""Tensor-parallel layouts: which producer rank fills which heads of which consumer
rank, and the descriptor rows that do it, checked byte for byte over small shapes."""

from __future__ import annotations

import ctypes
import itertools

import msgspec
import numpy as np
import pytest

from kvpush.backend import layout_from_views
from kvpush.backend.host import host_view
from kvpush.errors import RegionError
from kvpush.layout import BlockTable, Shard, assignment, plan, sources

BLOCKS, TOKENS, DIM, LAYERS = 5, 4, 2, 2
# vLLM's CPU cache, an HND GPU cache (K and V blocks of heads outermost), and the
# Neuron one (K and V planes, block-major inside).
KINDS = {
    "cpu": (lambda h: (BLOCKS, h, TOKENS, 2 * DIM), ("blocks", "heads", "tokens", "kvdim")),
    "hnd": (lambda h: (BLOCKS, 2, h, TOKENS, DIM), ("blocks", "kv", "heads", "tokens", "dim")),
    "neuron": (lambda h: (2, BLOCKS, h, TOKENS, DIM), ("kv", "blocks", "heads", "tokens", "dim")),
}
SIZES = (1, 2, 4, 8)


HEAD_AXIS = {"cpu": 1, "hnd": 2, "neuron": 2}


def _canonical_to(kind: str, values: np.ndarray) -> np.ndarray:
    """One head's data, [blocks, K/V, tokens, dim], as `kind` lays it out."""
    if kind == "cpu":
        return np.concatenate([values[:, 0], values[:, 1]], axis=-1)
    return values if kind == "hnd" else values.transpose(1, 0, 2, 3)


def _canonical_from(kind: str, values: np.ndarray) -> np.ndarray:
    if kind == "cpu":
        return np.stack([values[..., :DIM], values[..., DIM:]], axis=1)
    return values if kind == "hnd" else values.transpose(1, 0, 2, 3)


def _head_data(layer: int, head: int) -> np.ndarray:
    """What the model's KV head `head` holds in layer `layer`: the same on every rank."""
    rng = np.random.default_rng(1000 * layer + head)
    return rng.standard_normal((BLOCKS, 2, TOKENS, DIM)).astype(np.float32)


def _rank(kind: str, shard: Shard, fill: bool):
    """One rank's KV cache (its heads' data when `fill`, else zeros) and its layout."""
    shape, dims = KINDS[kind]
    arrays = []
    for layer in range(LAYERS):
        array = np.zeros(shape(shard.count), dtype=np.float32)
        for i in range(shard.count) if fill else ():
            index = [slice(None)] * array.ndim
            index[HEAD_AXIS[kind]] = i
            array[tuple(index)] = _canonical_to(kind, _head_data(layer, shard.first + i))
        arrays.append(array)
    views = {f"layer.{i}": host_view(a) for i, a in enumerate(arrays)}
    layout = msgspec.structs.replace(layout_from_views(views, dims), shard=shard)
    return arrays, layout


def _held(arrays, kind: str, shard: Shard, head: int, layer: int) -> np.ndarray:
    """What a rank holds of `head` in `layer`, [blocks, K/V, tokens, dim]."""
    return _canonical_from(kind, np.take(arrays[layer], head - shard.first, HEAD_AXIS[kind]))


def _cases():
    # A layout that interleaves K and V below the head pairs only with its like.
    pairs = [("cpu", "cpu"), ("hnd", "hnd"), ("neuron", "neuron"), ("hnd", "neuron"),
             ("neuron", "hnd")]  # fmt: skip
    for src_kind, dst_kind in pairs:
        for heads, src_world, dst_world in itertools.product(SIZES, SIZES, SIZES):
            if src_world % dst_world and dst_world % src_world:
                continue
            yield src_kind, dst_kind, heads, src_world, dst_world


@pytest.mark.parametrize(
    ("src_kind", "dst_kind", "heads", "src_world", "dst_world"), list(_cases())
)
def test_every_consumer_head_is_filled_once_from_a_producer_that_holds_it(
    src_kind, dst_kind, heads, src_world, dst_world
):
    producers = [_rank(src_kind, Shard(r, src_world, heads), True) for r in range(src_world)]
    consumers = [_rank(dst_kind, Shard(r, dst_world, heads), False) for r in range(dst_world)]
    src_blocks, dst_blocks = [0, 3, 4], [2, 1, 4]
    written: dict[tuple[int, int], int] = {}  # (consumer rank, head) -> times written
    for piece in assignment(src_world, dst_world, heads):
        (_, src), (_, dst) = producers[piece.src], consumers[piece.dst]
        ours, theirs = plan(src, dst)
        a = BlockTable(src, layout_units=ours)
        b = BlockTable(dst, layout_units=theirs)
        for i, j in zip(a.ids(src_blocks), b.ids(dst_blocks), strict=True):
            (sa, n, _), (da, m, _) = a.rows[i], b.rows[j]
            assert n == m
            ctypes.memmove(int(da), int(sa), int(n))
        for head in range(piece.first, piece.first + piece.count):
            written[(piece.dst, head)] = written.get((piece.dst, head), 0) + 1
    for rank, (arrays, layout) in enumerate(consumers):
        shard = layout.shard
        for head in range(shard.first, shard.first + shard.count):
            assert written.get((rank, head)) == 1, (rank, head)
            for layer in range(LAYERS):
                got = _held(arrays, dst_kind, shard, head, layer)[dst_blocks]
                assert np.array_equal(got, _head_data(layer, head)[src_blocks]), (rank, head)


def test_equal_sizes_pair_rank_with_rank_in_whole_blocks():
    _, a = _rank("cpu", Shard(1, 2, 4), False)
    _, b = _rank("cpu", Shard(1, 2, 4), False)
    ours, _ = plan(a, b)
    assert [u.nbytes for u in ours] == [r.block_bytes for layer in a.layers for r in layer]
    _, c = _rank("cpu", Shard(0, 2, 4), False)
    with pytest.raises(RegionError, match="rank mismatch"):
        plan(a, c)


def test_pairs_that_cannot_map_are_refused_with_the_reason():
    _, tp2 = _rank("cpu", Shard(0, 2, 8), False)
    _, other_model = _rank("cpu", Shard(0, 1, 4), False)
    with pytest.raises(RegionError, match="differ in KV heads"):
        plan(tp2, other_model)
    _, tp4 = _rank("cpu", Shard(2, 4, 8), False)
    with pytest.raises(RegionError, match="holds none of consumer rank 2"):
        plan(tp2, tp4)  # producer rank 0 of 2 holds heads 0-3; consumer rank 2 of 4 wants 4-5
    nhd = layout_from_views(
        {"l": host_view(np.zeros((BLOCKS, 2, TOKENS, 4, DIM), np.float32))},
        ("blocks", "kv", "tokens", "heads", "dim"),
    )
    nhd = msgspec.structs.replace(nhd, shard=Shard(0, 1, 4))
    _, hnd = _rank("hnd", Shard(0, 2, 4), False)
    with pytest.raises(RegionError, match="KV heads outermost inside a block"):
        plan(nhd, hnd)


@pytest.mark.parametrize(
    ("src_world", "dst_world", "heads", "expected"),
    [
        (1, 2, 2, {0: [(0, 2)], 1: [(0, 2)]}),  # one producer rank fills both consumer ranks
        (2, 1, 2, {0: [(0, 1), (1, 1)]}),  # one consumer rank takes from both
        (8, 2, 8, {0: [(0, 1), (1, 1), (2, 1), (3, 1)], 1: [(4, 1), (5, 1), (6, 1), (7, 1)]}),
        (2, 8, 2, {r: [(0 if r < 4 else 1, 4)] for r in range(8)}),  # replicated heads
    ],
)
def test_sources_name_each_producer_rank_and_how_many_consumer_ranks_it_fills(
    src_world, dst_world, heads, expected
):
    got = {r: sources(Shard(r, dst_world, heads), src_world) for r in range(dst_world)}
    assert got == expected


def test_a_qwen3_32b_shaped_transfer_keeps_its_descriptors_bounded():
    """64 layers, 8 KV heads of 128, bfloat16, 16-token blocks, a 16k-token prompt:
    prefill TP 4 to decode TP 8 (each decode rank takes one head) in the CPU layout."""
    layers, heads, dim, tokens, prompt = 64, 8, 128, 16, 16384
    blocks = prompt // tokens

    def rank(shard: Shard):
        views = {
            f"l{i}": host_view(np.zeros((blocks + 1, shard.count, tokens, 2 * dim), np.float16))
            for i in range(layers)
        }
        layout = layout_from_views(views, ("blocks", "heads", "tokens", "kvdim"))
        return views, msgspec.structs.replace(layout, shard=shard)

    (_, src), (_, dst) = rank(Shard(1, 4, heads)), rank(Shard(3, 8, heads))
    ours, _ = plan(src, dst)
    rows = BlockTable(src, layout_units=ours).ids(list(range(blocks)))
    assert len(rows) == layers * blocks  # one descriptor per layer and block
    per = tokens * 2 * dim * 2
    assert {u.nbytes for u in ours} == {per}  # one head: 8 KiB a descriptor
