"""The NIXL transport between two OS processes: real UCX, real bytes."""

from __future__ import annotations

import base64
import time

import msgspec
import numpy as np
import pytest
from agent_peer import Peer

from kvpush.errors import MetadataError, RegionError, TransportError
from kvpush.regions import MemRegion

pytestmark = pytest.mark.nixl

LAYERS, BLOCKS, BLOCK_BYTES = 2, 12, 4096


@pytest.fixture
def pair(remote_peer):
    """(local Peer in this process, remote peer process), connected both ways."""
    local = Peer("test-local", LAYERS, BLOCKS, BLOCK_BYTES, fill=0x11)
    hello = remote_peer.call(
        "init", name="test-remote", layers=LAYERS, blocks=BLOCKS, block_bytes=BLOCK_BYTES, fill=0
    )
    local.connect(hello["metadata"], hello["layout"])
    remote_peer.call("connect", **local.hello())
    yield local, remote_peer
    local.agent.close()


def _values(remote_peer):
    return remote_peer.call("blocks")["values"]


def test_write_scattered_blocks_with_notification(pair):
    local, remote = pair
    sources, targets = [1, 4, 5, 9], [0, 3, 7, 11]
    local.transfer("WRITE", sources, targets, "write-1")
    notifs = remote.call("wait_notifs", count=1, seconds=10)["notifs"]
    assert notifs == [["test-local", "write-1"]]
    values = _values(remote)
    for layer in range(LAYERS):
        for block in range(BLOCKS):
            expected = [0x11] if block in targets else [0]
            assert values[layer][block] == expected, (layer, block)


def test_read_blocks_from_peer(pair):
    local, remote = pair
    remote.call("fill", blocks=[2, 6], value=0x55)
    remote.send("pump", seconds=3.0)  # the target keeps NIXL progressing meanwhile
    local.transfer("READ", [0, 10], [2, 6], "")
    remote.reply("pump")
    for layer in range(LAYERS):
        assert (local.buf[layer, [0, 10]] == 0x55).all()
        untouched = [b for b in range(BLOCKS) if b not in (0, 10)]
        assert (local.buf[layer, untouched] == 0x11).all()


def test_killed_peer_gives_named_error_quickly(pair):
    local, remote = pair
    local.transfer("WRITE", [0], [0], "before")  # connection is up
    remote.kill()
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        for _ in range(2000):  # the first post may still succeed while UCX notices
            local.transfer("WRITE", [1], [1], "after")
            time.sleep(0.005)
    assert time.monotonic() - started < 10
    assert caught.value.peer == "test-remote"
    assert "test-remote" in str(caught.value)


def test_malformed_metadata_is_a_clear_error():
    local = Peer("test-lonely", 1, 2, 4096, fill=0)
    try:
        for blob in (b"", b"garbage", base64.b64decode(local.hello()["metadata"])[:40]):
            with pytest.raises(MetadataError, match="metadata"):
                local.agent.add_peer(blob)
    finally:
        local.agent.close()


def test_descriptor_ids_out_of_range(pair):
    local, _ = pair
    with pytest.raises(RegionError, match="out of range"):
        local.table.ids([0, BLOCKS])
    with pytest.raises(RegionError, match="rows"):
        local.agent.post(
            "WRITE", local.local, np.array([0, 10**6]), local.remote, np.array([0, 1]), b""
        )
    with pytest.raises(RegionError, match="3 local descriptors but 2"):
        local.agent.post(
            "WRITE", local.local, np.array([0, 1, 2]), local.remote, np.array([0, 1]), b""
        )


def test_bad_regions_are_refused():
    with pytest.raises(RegionError, match="address is 0"):
        MemRegion(0, 4096)
    with pytest.raises(RegionError, match="length 0"):
        MemRegion(0x1000, 0)
    local = Peer("test-regions", 1, 2, 4096, fill=0)
    try:
        with pytest.raises(RegionError, match="empty"):
            local.agent.register([])
    finally:
        local.agent.close()


def test_layout_crosses_the_wire_intact(pair):
    local, _ = pair
    encoded = msgspec.json.encode(local.kv.layout)
    assert msgspec.json.decode(encoded, type=type(local.kv.layout)) == local.kv.layout
