"""Different block sizes: a larger block is whole pages of the smaller, moved by
descriptor. Checked byte for byte, token by token, over small shapes, with and
without mixed tensor parallelism."""

from __future__ import annotations

import ctypes
import itertools

import msgspec
import numpy as np
import pytest

from kvpush.backend import layout_from_views
from kvpush.backend.host import host_view
from kvpush.errors import RegionError
from kvpush.layout import (
    BlockTable,
    Shard,
    assignment,
    blocks_of,
    page_factors,
    plan,
    to_pages,
)

DIM, LAYERS, BLOCKS = 2, 2, 16
PROMPT = 22  # tokens of KV that move: a whole number of no block size here
# Per kind: the cache's shape for (blocks, heads, tokens) and its dims. "planes" keeps
# each head's K for every token, then its V; "packed" keeps K and V side by side in
# each token's row; "nhd" has the tokens outermost in a block (vLLM's NHD layout on
# GPUs). (vLLM's CPU cache orders K by its kernels' tiling: kvpush refuses to page it.)
KINDS = {
    "planes": (lambda b, h, t: (b, h, 2, t, DIM), ("blocks", "heads", "planes", "tokens", "dim")),
    "packed": (lambda b, h, t: (b, h, t, 2 * DIM), ("blocks", "heads", "tokens", "kvdim")),
    "hnd": (lambda b, h, t: (b, 2, h, t, DIM), ("blocks", "kv", "heads", "tokens", "dim")),
    "neuron": (lambda b, h, t: (2, b, h, t, DIM), ("kv", "blocks", "heads", "tokens", "dim")),
    "nhd": (lambda b, h, t: (b, 2, t, h, DIM), ("blocks", "kv", "tokens", "heads", "dim")),
}


def _token_data(layer: int, head: int) -> np.ndarray:
    """The KV of `head` in `layer` for every prompt token: [tokens, K/V, dim]."""
    rng = np.random.default_rng(1000 * layer + head)
    return rng.standard_normal((PROMPT, 2, DIM)).astype(np.float32)


def _put(kind: str, array: np.ndarray, block: int, slot: int, i: int, kv: np.ndarray) -> None:
    """Write one token's K/V of the rank's `i`th head into `slot` of `block`."""
    if kind == "planes":
        array[block, i, :, slot] = kv
    elif kind == "packed":
        array[block, i, slot] = np.concatenate([kv[0], kv[1]])
    elif kind == "hnd":
        array[block, :, i, slot] = kv
    elif kind == "neuron":
        array[:, block, i, slot] = kv
    else:
        array[block, :, slot, i] = kv


def _get(kind: str, array: np.ndarray, block: int, slot: int, i: int) -> np.ndarray:
    if kind == "planes":
        return array[block, i, :, slot]
    if kind == "packed":
        return np.stack([array[block, i, slot, :DIM], array[block, i, slot, DIM:]])
    if kind == "hnd":
        return array[block, :, i, slot]
    if kind == "neuron":
        return array[:, block, i, slot]
    return array[block, :, slot, i]


def _rank(kind: str, shard: Shard, tokens: int, blocks: list[int] | None):
    """A rank's cache of `tokens`-token blocks, holding the prompt in `blocks` (in
    order) when given; its arrays and layout."""
    shape, dims = KINDS[kind]
    arrays = [np.zeros(shape(BLOCKS, shard.count, tokens), np.float32) for _ in range(LAYERS)]
    for layer, array in enumerate(arrays):
        for t in range(PROMPT) if blocks is not None else ():
            for i in range(shard.count):
                kv = _token_data(layer, shard.first + i)[t]
                _put(kind, array, blocks[t // tokens], t % tokens, i, kv)
    views = {f"layer.{i}": host_view(a) for i, a in enumerate(arrays)}
    layout = msgspec.structs.replace(layout_from_views(views, dims), shard=shard)
    return arrays, layout


def _move(src, dst, src_blocks: list[int], dst_blocks: list[int], skip_tokens: int = 0):
    """What the data path does for a pair: pages of both sides, aligned, copied."""
    ours, theirs = plan(src, dst)
    f_src, f_dst = page_factors(src.tokens_per_block, dst.tokens_per_block)
    page = min(src.tokens_per_block, dst.tokens_per_block)
    src_pages = to_pages(src_blocks, f_src)[skip_tokens // page :]
    dst_pages = to_pages(dst_blocks, f_dst)[skip_tokens // page :][: len(src_pages)]
    a = BlockTable(src, layout_units=ours)
    b = BlockTable(dst, layout_units=theirs)
    rows = 0
    for i, j in zip(a.ids(src_pages[: len(dst_pages)]), b.ids(dst_pages), strict=True):
        (sa, n, _), (da, m, _) = a.rows[i], b.rows[j]
        assert n == m
        ctypes.memmove(int(da), int(sa), int(n))
        rows += 1
    return rows


def _shuffled(seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(BLOCKS).tolist()


def _cases():
    # Each kind with its like; Trainium's K/V planes with a GPU's HND blocks, both ways.
    kinds = [(k, k) for k in KINDS] + [("neuron", "hnd"), ("hnd", "neuron")]
    sizes = [(4, 8), (8, 4), (2, 8), (8, 2), (4, 4)]
    for (src_kind, dst_kind), (src_tokens, dst_tokens) in itertools.product(kinds, sizes):
        nhd = "nhd" in (src_kind, dst_kind)
        worlds = [(1, 1), (2, 2)] if nhd else [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2)]
        for (src_world, dst_world), heads in itertools.product(worlds, (1, 2, 4)):
            yield src_kind, dst_kind, src_tokens, dst_tokens, src_world, dst_world, heads


@pytest.mark.parametrize(
    ("src_kind", "dst_kind", "src_tokens", "dst_tokens", "src_world", "dst_world", "heads"),
    list(_cases()),
)
def test_every_token_of_every_head_lands_in_the_consumer_block_that_holds_it(
    src_kind, dst_kind, src_tokens, dst_tokens, src_world, dst_world, heads
):
    src_blocks = _shuffled(1)[: -(-PROMPT // src_tokens)]
    dst_blocks = _shuffled(2)[: -(-PROMPT // dst_tokens)]
    producers = [_rank(src_kind, Shard(r, src_world, heads), src_tokens, src_blocks)
                 for r in range(src_world)]  # fmt: skip
    consumers = [_rank(dst_kind, Shard(r, dst_world, heads), dst_tokens, None)
                 for r in range(dst_world)]  # fmt: skip
    for piece in {(p.src, p.dst) for p in assignment(src_world, dst_world, heads)}:
        _move(producers[piece[0]][1], consumers[piece[1]][1], src_blocks, dst_blocks)
    for arrays, layout in consumers:
        shard = layout.shard
        for layer, i, t in itertools.product(range(LAYERS), range(shard.count), range(PROMPT)):
            got = _get(dst_kind, arrays[layer], dst_blocks[t // dst_tokens], t % dst_tokens, i)
            assert np.array_equal(got, _token_data(layer, shard.first + i)[t]), (layer, i, t)


@pytest.mark.parametrize(("src_tokens", "dst_tokens"), [(4, 8), (8, 4)])
def test_a_prefix_the_consumer_holds_is_skipped_and_the_rest_lands(src_tokens, dst_tokens):
    """The consumer's prefix cache holds its first block: only later tokens move, from
    the middle of a producer block when the producer's blocks are larger."""
    shard = Shard(0, 1, 2)
    src_blocks = _shuffled(3)[: -(-PROMPT // src_tokens)]
    dst_blocks = _shuffled(4)[: -(-PROMPT // dst_tokens)]
    _, src = _rank("planes", shard, src_tokens, src_blocks)
    arrays, dst = _rank("planes", shard, dst_tokens, None)
    _move(src, dst, src_blocks, dst_blocks, skip_tokens=dst_tokens)
    for layer, i, t in itertools.product(range(LAYERS), range(2), range(PROMPT)):
        got = _get("planes", arrays[layer], dst_blocks[t // dst_tokens], t % dst_tokens, i)
        held = t >= dst_tokens
        assert np.array_equal(got, _token_data(layer, i)[t] if held else np.zeros((2, DIM))), t


def test_pages_count_blocks_in_the_smaller_size():
    assert page_factors(64, 128) == (1, 2) and page_factors(128, 64) == (2, 1)
    assert to_pages([5, 2], 2) == [10, 11, 4, 5] and to_pages([5, 2], 1) == [5, 2]
    assert blocks_of([11, 4, 5], 2) == [5, 2]


def test_a_larger_block_costs_descriptors_per_head_plane_and_page_only():
    """K and V planes, 2 heads a rank, 8-token blocks into 4-token ones: each unit is
    one head's K or V page, so a page costs heads x 2 rows a layer."""
    _, src = _rank("planes", Shard(0, 1, 2), 8, [0, 1, 2])
    _, dst = _rank("planes", Shard(0, 1, 2), 4, None)
    rows = _move(src, dst, [0, 1, 2], [0, 1, 2, 3, 4, 5])
    assert rows == LAYERS * 2 * 2 * 6  # layers x heads x K/V x pages (22 tokens: 6 of 4)


def test_block_sizes_that_do_not_divide_or_cannot_be_paged_are_refused():
    shard = Shard(0, 1, 2)
    _, six = _rank("planes", shard, 6, None)
    _, four = _rank("planes", shard, 4, None)
    with pytest.raises(RegionError, match="prefill holds 6 tokens per block, decode 4"):
        plan(six, four)
    # No tokens dimension at all: nothing says where a page lies.
    opaque = [layout_from_views({"l": host_view(np.zeros((BLOCKS, 64 * n), np.uint8))},
                                ("blocks", "bytes"), tokens_per_block=n)
              for n in (8, 4)]  # fmt: skip
    opaque = [msgspec.structs.replace(o, shard=shard) for o in opaque]
    with pytest.raises(RegionError, match="a page of a larger block is a slice only when"):
        plan(*opaque)
