"""Trainium prefill -> GPU decode and back, over real NIXL between two processes.

Each side is a kvpush Node on a fake device in its engine's real KV layout: Neuron's
(2, blocks, heads, tokens, dim) against the GPU's (blocks, 2, heads, tokens, dim).
The core must map one onto the other at K/V granularity; every byte of every moved
block is checked against the pattern the sender's model wrote, and untouched blocks
must still be zero. (NIXL here is UCX over loopback, the fake HBM registered as DRAM:
see kvpush_neuron.testing for what that leaves to the unit tests.)
"""

from __future__ import annotations

import pytest
from kv_devices import ZERO, expected

pytestmark = pytest.mark.nixl

LAYERS, BLOCKS = 2, 8
FAST = {"layers": LAYERS, "blocks": BLOCKS, "write_grace_s": 5.0, "heartbeat_s": 0.5}


def _one(peer, seconds: float = 20.0) -> dict:
    outcomes = peer.call("results", count=1, seconds=seconds, timeout=seconds + 30)["outcomes"]
    assert outcomes, "no outcome arrived"
    return outcomes[0]


def _push(producer, consumer, tid: str, src: list[int], dst: list[int], seed: int, **kw) -> None:
    consumer.call("expect", tid=tid, producer=producer.address, blocks=dst)
    producer.call("kv_ready_pattern", tid=tid, blocks=src, seed=seed, **kw)
    delivered = _one(consumer)
    assert delivered["kind"] == "delivered", delivered
    released = _one(producer)
    assert (released["kind"], released["reason"]) == ("released", "sent"), released


def _check(peer, holds: dict[int, tuple[int, int]]) -> None:
    """Every block of every layer: block -> (seed, source block) it must hold, else zero."""
    got = peer.call("digests", blocks=list(range(BLOCKS)))["digests"]
    for layer in range(LAYERS):
        for block in range(BLOCKS):
            if block in holds:
                seed, source = holds[block]
                want = expected(seed, LAYERS, [source])[layer][0]
            else:
                want = [ZERO, ZERO]
            assert got[layer][block] == want, (layer, block)


@pytest.mark.parametrize(
    ("trn", "gpu", "paths"),
    [
        ("neuron", "cuda", ("direct", "direct")),
        ("neuron-staged", "host-kv", ("staged", "direct")),
        ("neuron-legacy", "cuda-staged", ("staged", "staged")),
    ],
)
def test_trainium_prefill_gpu_decode_and_back(spawn, trn, gpu, paths):
    neuron, other = spawn(
        ("both", "trn", {"device": trn, **FAST}), ("both", "gpu", {"device": gpu, **FAST})
    )
    assert (neuron.hello["path"], other.hello["path"]) == paths
    # Trainium prefill, GPU decode: blocks 0, 1, 3 land in 5, 2, 7.
    _push(neuron, other, "t1", [0, 1, 3], [5, 2, 7], seed=11)
    _check(other, {5: (11, 0), 2: (11, 1), 7: (11, 3)})
    # The layouts differ, so the core paired them at K/V granularity.
    assert other.call("pairings")["split"] == [True]
    if paths[0] == "direct":
        # What the fence is for: NIXL reads HBM itself, so a WRITE posted before the
        # model's writes land sends what was there before (block 0's first pattern).
        _push(neuron, other, "t3", [0], [0], seed=33, fence=False)
        _check(other, {5: (11, 0), 2: (11, 1), 7: (11, 3), 0: (11, 0)})
    # And back: GPU prefill, Trainium decode, into blocks the Neuron side never wrote.
    _push(other, neuron, "t2", [2, 4], [6, 4], seed=22)
    _check(neuron, {0: (11, 0), 1: (11, 1), 3: (11, 3), 6: (22, 2), 4: (22, 4)})
    assert neuron.call("pairings")["split"] == [True, True]


def test_pull_stages_on_both_sides(spawn):
    # The producer copies the blocks to its host buffers before it grants the READ;
    # the consumer copies them to the device once they land.
    neuron, gpu = spawn(
        ("producer", "trn", {"device": "neuron-staged", "mode": "pull", **FAST}),
        ("consumer", "gpu", {"device": "cuda-staged", "mode": "pull", **FAST}),
    )
    assert (neuron.hello["path"], gpu.hello["path"]) == ("staged", "staged")
    neuron.call("kv_ready_pattern", tid="p1", blocks=[1, 3], seed=44)
    gpu.call("expect", tid="p1", producer=neuron.address, blocks=[6, 0])
    delivered = _one(gpu)
    assert delivered["kind"] == "delivered", delivered
    released = _one(neuron)
    assert (released["kind"], released["reason"]) == ("released", "sent"), released
    _check(gpu, {6: (44, 1), 0: (44, 3)})
