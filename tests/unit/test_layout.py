"""Regions and KV layouts: derivation from tensor views, pairing, descriptors."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvpush.backend import layout_from_views
from kvpush.backend.host import host_view
from kvpush.errors import RegionError
from kvpush.layout import BlockTable, KVLayout, pairing_split, plan, units
from kvpush.regions import MemRegion, merge_regions

NB, H, T, D = 6, 2, 4, 8


def _layout(arrays, dims):
    return layout_from_views({f"l{i}": host_view(a) for i, a in enumerate(arrays)}, dims)


def test_vllm_cpu_layout_is_one_mixed_run_per_layer():
    # vLLM's CPU cache: [blocks, kv_heads, block_size, 2 * head_dim].
    arrays = [np.zeros((NB, H, T, 2 * D), dtype=np.float32) for _ in range(2)]
    layout = _layout(arrays, ("blocks", "heads", "tokens", "kvdim"))
    assert layout.tokens_per_block == T
    assert [run.part for layer in layout.layers for run in layer] == ["mixed", "mixed"]
    assert layout.layers[0][0].block_bytes == H * T * 2 * D * 4
    assert len(layout.regions) == 2


def test_block_major_and_kv_major_layouts_pair_at_kv_granularity():
    block_major = [np.zeros((NB, 2, H, T, D), dtype=np.float16) for _ in range(3)]
    kv_major = [np.zeros((2, NB + 3, H, T, D), dtype=np.float16) for _ in range(3)]
    a = _layout(block_major, ("blocks", "kv", "heads", "tokens", "dim"))
    b = _layout(kv_major, ("kv", "blocks", "heads", "tokens", "dim"))
    assert [r.part for r in a.layers[0]] == ["KV"]
    assert [r.part for r in b.layers[0]] == ["K", "V"]
    assert pairing_split(a, b) is True
    assert pairing_split(a, a) is False


def test_descriptor_rows_map_one_layout_onto_the_other_byte_for_byte():
    rng = np.random.default_rng(0)
    src = [rng.standard_normal((NB, 2, H, T, D)).astype(np.float32) for _ in range(2)]
    dst = [np.zeros((2, NB, H, T, D), dtype=np.float32) for _ in range(2)]
    a = _layout(src, ("blocks", "kv", "heads", "tokens", "dim"))
    b = _layout(dst, ("kv", "blocks", "heads", "tokens", "dim"))
    split = pairing_split(a, b)
    ta, tb = BlockTable(a, split), BlockTable(b, split)
    src_blocks, dst_blocks = [0, 3, 5], [4, 1, 2]
    for i, j in zip(ta.ids(src_blocks), tb.ids(dst_blocks), strict=True):
        (sa, n, _), (da, m, _) = ta.rows[i], tb.rows[j]
        assert n == m
        ctypes.memmove(int(da), int(sa), int(n))
    for layer in range(2):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            assert np.array_equal(dst[layer][0, d], src[layer][s, 0])  # K
            assert np.array_equal(dst[layer][1, d], src[layer][s, 1])  # V
        untouched = [b for b in range(NB) if b not in dst_blocks]
        assert not dst[layer][:, untouched].any()


def test_permuted_tensor_is_described_as_it_lies_in_memory():
    # Logical (blocks, kv, tokens, heads, dim) stored as (blocks, kv, heads, tokens, dim).
    base = np.zeros((NB, 2, H, T, D), dtype=np.float32)
    permuted = base.transpose(0, 1, 3, 2, 4)
    layout = _layout([permuted], ("blocks", "kv", "tokens", "heads", "dim"))
    assert layout.inner == f"heads:{H},tokens:{T},dim:{D}"


def test_inner_order_mismatch_refuses_to_pair():
    a = _layout(
        [np.zeros((NB, 2, H, T, D), np.float32)], ("blocks", "kv", "heads", "tokens", "dim")
    )
    b = _layout(
        [np.zeros((NB, 2, T, H, D), np.float32)], ("blocks", "kv", "tokens", "heads", "dim")
    )
    with pytest.raises(RegionError, match="differ in inner"):
        pairing_split(a, b)


def test_mixed_layout_cannot_split():
    a = _layout([np.zeros((NB, H, T, 2 * D), np.float32)], ("blocks", "heads", "tokens", "kvdim"))
    with pytest.raises(RegionError, match="interleaves K and V"):
        units(a, split=True)


def test_strided_inside_a_block_is_refused():
    padded = np.zeros((NB, 2, H, T, D + 1), np.float32)[..., :D]
    with pytest.raises(RegionError, match="not dense"):
        _layout([padded], ("blocks", "kv", "heads", "tokens", "dim"))


def test_block_ids_out_of_range_name_the_ids():
    layout = _layout([np.zeros((NB, 2, 8), np.uint8)], ("blocks", "kv", "x"))
    with pytest.raises(RegionError, match=r"block ids \[6, -1\] are out of range"):
        BlockTable(layout, False).ids([0, 6, -1])


def test_layout_outside_its_regions_is_refused():
    region = MemRegion(0x10000, 4096)
    with pytest.raises(RegionError, match="outside every region"):
        KVLayout((region,), ((_run(0x10000, 1024, 1024),),), 8, 1, "uint8", "x:1024")


def _run(base, stride, nbytes):
    from kvpush.layout import BlockRun

    return BlockRun(base, stride, nbytes, "mixed")


def test_merge_regions_registers_each_byte_once():
    merged = merge_regions(
        [
            MemRegion(0x1000, 0x1000),
            MemRegion(0x1000, 0x1000),  # same tensor, two layers
            MemRegion(0x1800, 0x1000),  # overlapping view
            MemRegion(0x9000, 0x100),
            MemRegion(0x1000, 0x100, device_id=1, mem_type="VRAM"),
        ]
    )
    assert merged == [
        MemRegion(0x1000, 0x1800),
        MemRegion(0x9000, 0x100),
        MemRegion(0x1000, 0x100, device_id=1, mem_type="VRAM"),
    ]


def test_layout_digest_changes_with_addresses():
    first, second = np.zeros((NB, 2, 8), np.uint8), np.zeros((NB, 2, 8), np.uint8)
    a = _layout([first], ("blocks", "kv", "x"))
    b = _layout([second], ("blocks", "kv", "x"))
    assert a.digest() == _layout([first], ("blocks", "kv", "x")).digest()
    assert a.digest() != b.digest()


def test_block_sizes_that_do_not_divide_are_refused_naming_both_and_the_rule():
    """64 and 128 pair (test_layout_pages); 64 and 96 cannot, either way."""
    small = _layout(
        [np.zeros((NB, H, 64, 2 * D), np.float32)], ("blocks", "heads", "tokens", "kvdim")
    )
    odd = _layout(
        [np.zeros((NB, H, 96, 2 * D), np.float32)], ("blocks", "heads", "tokens", "kvdim")
    )
    for (a, b), (prefill, decode) in (((small, odd), (64, 96)), ((odd, small), (96, 64))):
        with pytest.raises(RegionError, match="block sizes differ") as refused:
            plan(a, b)
        message = str(refused.value)
        assert f"prefill holds {prefill} tokens per block, decode {decode}" in message
        assert "one divides the other" in message
        with pytest.raises(RegionError, match="tokens_per_block"):
            pairing_split(a, b)
