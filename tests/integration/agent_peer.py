"""A bare NIXL agent with a KV-shaped buffer, for transport tests.

The tests hold one in the pytest process and another in a peer process
(peer_main.py), so every transfer crosses a real process boundary.
"""

from __future__ import annotations

import base64
import time

import msgspec
import numpy as np

from kvpush.backend.plugins import get_backends
from kvpush.layout import BlockTable, KVLayout
from kvpush.transport.agent import NixlAgent


class Peer:
    def __init__(self, name: str, layers: int, blocks: int, block_bytes: int, fill: int) -> None:
        self.buf = np.full((layers, blocks, block_bytes), fill, dtype=np.uint8)
        tensors = {f"layer.{i}": self.buf[i] for i in range(layers)}
        self.kv = get_backends(["host"]).describe(tensors, ("blocks", "bytes"))
        self.table = BlockTable(self.kv.layout, split=False)
        self.agent = NixlAgent(name)
        self.agent.register(self.kv.layout.regions)
        self.local = self.agent.prepare(self.table.rows, "DRAM")
        self.remote = None
        self.peer = None

    def hello(self) -> dict:
        return {
            "metadata": base64.b64encode(self.agent.metadata()).decode(),
            "layout": msgspec.json.encode(self.kv.layout).decode(),
        }

    def connect(self, metadata: str, layout: str) -> dict:
        self.peer = self.agent.add_peer(base64.b64decode(metadata))
        remote_layout = msgspec.json.decode(layout, type=KVLayout)
        self.remote_table = BlockTable(remote_layout, split=False)
        self.remote = self.agent.prepare(self.remote_table.rows, "DRAM", self.peer)
        return {"peer": self.peer}

    def transfer(self, op: str, blocks: list[int], remote_blocks: list[int], notif: str) -> dict:
        handle = self.agent.post(
            op,
            self.local,
            self.table.ids(blocks),
            self.remote,
            self.remote_table.ids(remote_blocks),
            notif.encode(),
        )
        while not self.agent.done(handle):
            time.sleep(0.0001)
        self.agent.release(handle)
        return {}

    def wait_notifs(self, count: int, seconds: float) -> dict:
        got: list[list[str]] = []
        deadline = time.monotonic() + seconds
        while len(got) < count and time.monotonic() < deadline:
            got += [[peer, msg.decode()] for peer, msg in self.agent.notifs()]
            time.sleep(0.0005)
        return {"notifs": got}

    def blocks(self) -> dict:
        # Per (layer, block): the set of byte values present, enough to see partial writes.
        return {
            "values": [[sorted(set(np.unique(b).tolist())) for b in layer] for layer in self.buf]
        }

    def fill(self, blocks: list[int], value: int) -> dict:
        self.buf[:, blocks] = value
        return {}

    def pump(self, seconds: float) -> dict:
        # Keep NIXL progressing (the peer of a READ must, for connection set-up).
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.agent.notifs()
            time.sleep(0.0005)
        return {}
