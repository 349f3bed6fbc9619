"""A kvpush Node over a KV-shaped buffer, for protocol tests over real NIXL.

`device="host"` keeps the KV in numpy arrays (the built-in host backend);
`device="gated"` keeps it on the example backend's imaginary device, whose fence
blocks until the test opens a gate: that holds a WRITE between "KV ready" and
"posted" for exactly as long as a test needs. The kinds in tests/backends/kv_devices.py
("neuron", "cuda-staged", ...) keep it on a fake device in that engine's real layout.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))
sys.path.insert(0, str(Path(__file__).parents[1] / "backends"))

import kv_devices
import kvpush_example_backend as example

from kvpush.backend.plugins import Backends
from kvpush.layout import Shard
from kvpush.node import Node, NodeConfig, Source
from kvpush.node.faults import Faults
from kvpush.protocol.config import ProtocolConfig
from kvpush.vllm.config import ConnectorConfig

GATE = threading.Event()
GATE.set()
AT_GATE = threading.Event()  # set while a fence wait is held at the gate


class GatedTensor(example.ExampleTensor):
    def synchronize(self) -> None:
        if not GATE.is_set():
            AT_GATE.set()
        GATE.wait()
        AT_GATE.clear()
        super().synchronize()


TOKEN_BYTES = 8  # what one token of one head takes, in the token-sized caches


class NodePeer:
    def __init__(
        self,
        role: str,
        engine_id: str,
        mode: str = "push",
        layers: int = 2,
        blocks: int = 16,
        block_bytes: int = 4096,
        fill: int = 0,
        device: str = "host",
        secret: str = "test-secret",
        rank: int = 0,
        world: int = 1,
        lock_dir: str = "",
        heads: int = 0,
        tokens: int = 0,
        faults: dict | None = None,
        host: str | None = "127.0.0.1",
        network: str = "",
        **protocol: float,
    ) -> None:
        """`host`: the address to advertise (None: the connector's default choice);
        `network`: where this node's loopback leads (""; its own)."""
        self.cache = None
        # Each rank holds its share of the model's KV heads (one each unless `heads`).
        self.shard = Shard(rank, world, heads or world)
        if device in kv_devices.KINDS:
            self.cache = kv_devices.FakeDeviceCache(device, layers, blocks, lock_dir)
            self.backends, self.tensors = self.cache.backends, self.cache.tensors
            self.kv = self.cache.kv
        elif tokens:  # as vLLM's CPU cache is: [blocks, heads, tokens, bytes a token]
            self.backends = Backends(["host"])
            shape = (layers, blocks, self.shard.count, tokens, TOKEN_BYTES)
            self.buf = np.full(shape, fill, np.uint8)
            self.tensors = {f"layer.{i}": self.buf[i] for i in range(layers)}
            dims = ("blocks", "heads", "tokens", "bytes")
            self.kv = self.backends.describe(self.tensors, dims)
        elif heads:  # blocks of heads, as vLLM's CPU cache is: [blocks, heads, bytes]
            self.backends = Backends(["host"])
            per_head = block_bytes // heads  # a head is as large on every rank
            self.buf = np.full((layers, blocks, self.shard.count, per_head), fill, np.uint8)
            self.tensors = {f"layer.{i}": self.buf[i] for i in range(layers)}
            self.kv = self.backends.describe(self.tensors, ("blocks", "heads", "bytes"))
        else:
            self._init_buffers(device, layers, blocks, block_bytes, fill)
        self.kv.layout = msgspec.structs.replace(self.kv.layout, shard=self.shard)
        # The side channel's address and binding as the connector decides them.
        where = ConnectorConfig.from_extra({} if host is None else {"host": host})
        config = NodeConfig(
            engine_id,
            role,
            rank=rank,
            world=world,
            host=where.host,
            listen=where.listen,
            protocol=ProtocolConfig(mode=mode, **protocol),
            secret=secret.encode(),
            **({"network": network} if network else {}),
        )
        self.faults = Faults(**faults) if faults else None
        self.node = Node(config, self.kv, self.backends, faults=self.faults).start()
        self.outcomes: list[dict] = []

    def _init_buffers(
        self, device: str, layers: int, blocks: int, block_bytes: int, fill: int
    ) -> None:
        self.backends = Backends(["host"])
        if device == "gated":
            self.backends.add(example, "example")
            self.tensors = {f"layer.{i}": GatedTensor((blocks, block_bytes)) for i in range(layers)}
            for tensor in self.tensors.values():
                tensor.memory[:] = fill
        else:
            self.buf = np.full((layers, blocks, block_bytes), fill, dtype=np.uint8)
            self.tensors = {f"layer.{i}": self.buf[i] for i in range(layers)}
        self.kv = self.backends.describe(self.tensors, ("blocks", "bytes"))

    def hello(self) -> dict:
        listening = self.node.config.role != "consumer"
        reply = {
            "address": self.node.address if listening else None,
            "network": self.node.config.network,
        }
        if self.cache is not None:
            reply.update(path=self.kv.path, mem_type=self.kv.layout.mem_type, device=self.kv.device)
        return reply

    def _memory(self, name: str) -> np.ndarray:
        tensor = self.tensors[name]
        return tensor.memory if isinstance(tensor, GatedTensor) else tensor

    def expect(
        self, tid: str, producer: str | list, blocks: list[int], skip: int = 0, network: str = ""
    ) -> dict:
        """`producer`: an address, or [address, parts] for each producer rank;
        `network`: the producer's, as its identity would say."""
        if not isinstance(producer, str):
            producer = [Source(address, "", parts) for address, parts in producer]
        self.node.expect(tid, producer, blocks, skip, network=network)
        return {}

    def kv_ready_heads(self, tid: str, blocks: list[int], base: int) -> dict:
        """Compute `blocks` in every layer, each head holding `base` + its index in the
        model, then say so."""
        for tensor in self.tensors.values():
            for i in range(self.shard.count):
                tensor[blocks, i] = base + self.shard.first + i
        self.node.kv_ready(tid, blocks, self.backends.fence(self.kv))
        return {}

    def kv_ready_tokens(self, tid: str, blocks: list[int], count: int, base: int) -> dict:
        """Compute `count` prompt tokens into `blocks` in order, token t of head h in
        layer l holding (base + 64 l + 16 h + t) mod 256, then say so."""
        tokens = self.buf.shape[3]
        for layer, t, i in itertools.product(
            range(len(self.buf)), range(count), range(self.shard.count)
        ):
            value = (base + 64 * layer + 16 * (self.shard.first + i) + t) % 256
            self.buf[layer, blocks[t // tokens], i, t % tokens] = value
        self.node.kv_ready(tid, blocks, self.backends.fence(self.kv))
        return {}

    def token_values(self, blocks: list[int], count: int) -> dict:
        """Per layer, head and prompt token (laid out in `blocks`): its distinct bytes."""
        tokens = self.buf.shape[3]
        return {
            "values": [
                [[sorted(set(self.buf[layer, blocks[t // tokens], i, t % tokens].tolist()))
                  for t in range(count)] for i in range(self.shard.count)]
                for layer in range(len(self.buf))
            ]
        }  # fmt: skip

    def head_values(self, block: int) -> dict:
        """What each local head of `block` holds, layer by layer (one value each)."""
        return {
            "values": [
                [sorted(set(tensor[block, i].tolist())) for i in range(self.shard.count)]
                for tensor in self.tensors.values()
            ]
        }

    def announce(self, tid: str, producer: str) -> dict:
        self.node.announce(tid, producer)
        return {}

    def kv_pending(self, tid: str) -> dict:
        self.node.kv_pending(tid)
        return {}

    def kv_ready(
        self, tid: str, blocks: list[int], value: int, layers: list[int] | None = None
    ) -> dict:
        """Compute (write `value` into) the given layers of `blocks`, then say so.

        With `layers`, the node hears that every layer up to the last one given is
        ready; without, that all are.
        """
        names = list(self.tensors)
        chosen = [names[i] for i in layers] if layers is not None else names
        for name in chosen:
            tensor = self.tensors[name]
            if isinstance(tensor, GatedTensor):
                tensor.write(blocks, value)  # lands only at the fence
            else:
                tensor[blocks] = value
        upto = None if layers is None else max(layers) + 1
        fence = self.backends.fence(self.kv)
        self.node.kv_ready(tid, blocks, fence, layers=upto)
        return {}

    def kv_ready_batch(self, items: list[list]) -> dict:
        """A forward pass's batch: compute every (tid, blocks, value) in `items`, then
        report them all in one call, as the connector does after a layer."""
        for _, blocks, value in items:
            for name in self.tensors:
                self.tensors[name][blocks] = value
        self.node.kv_ready_many([(tid, blocks) for tid, blocks, _ in items])
        return {}

    def registered(self) -> dict:
        """How many transfers a consumer has registered with the producer."""
        return {"count": self.node.loop.call(self.node.producer.claimed)}

    def kv_ready_pattern(self, tid: str, blocks: list[int], seed: int, fence: bool = True) -> dict:
        """Fake devices: compute each layer of `blocks` (kv_devices.pattern bytes) and say
        so layer by layer, each with its own fence (or none, to show what that sends)."""
        for layer, name in enumerate(self.tensors):
            self.cache.write(name, layer, blocks, seed)
            marker = self.backends.fence(self.kv, name) if fence else None
            self.node.kv_ready(tid, blocks, marker, layers=layer + 1)
        return {}

    def digests(self, blocks: list[int]) -> dict:
        return {"digests": self.cache.digests(blocks)}

    def pairings(self) -> dict:
        """For each paired peer: whether transfers go at K/V granularity (layouts differ)."""
        routes = self.node.loop.call(lambda: list(self.node.data.routes.values()))
        split = [any(unit.part in ("K", "V") for unit in route.local) for route in routes]
        return {"split": sorted(split)}

    def kv_progress(self, tid: str, blocks: list[int], full: int, value: int) -> dict:
        """A chunk of the prompt ran: write `value` into every layer of the first `full`
        of `blocks` (the rest is not complete), then say so."""
        for name in self.tensors:
            self._memory(name)[blocks[:full]] = value
        self.node.kv_progress_many([(tid, blocks, full)], self.backends.fence(self.kv))
        return {}

    def abort(self, tid: str) -> dict:
        self.node.abort(tid)
        return {}

    def results(self, count: int, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while len(self.outcomes) < count and time.monotonic() < deadline:
            for outcome in self.node.wait_results(max(0.0, deadline - time.monotonic())):
                self.outcomes.append(outcome.__dict__)
        taken, self.outcomes = self.outcomes[:count], self.outcomes[count:]
        return {"outcomes": taken}

    def values(self) -> dict:
        return {
            "values": [
                [sorted(set(np.unique(block).tolist())) for block in self._memory(name)]
                for name in self.tensors
            ]
        }

    def stats(self) -> dict:
        stats = self.node.stats()
        snapshot = self.node.metrics.snapshot()
        stats["metrics"] = snapshot["counters"]
        stats["nixl_posts"] = snapshot["histograms"].get("post_seconds", {}).get("count", 0)
        return stats

    def hold_fence(self) -> dict:
        GATE.clear()
        return {}

    def wait_at_fence(self, seconds: float = 10.0) -> dict:
        """Wait until a fence wait is held at the gate (the loop thread is stuck)."""
        return {"held": AT_GATE.wait(seconds)}

    def release_fence(self) -> dict:
        GATE.set()
        return {}

    def forget_peers(self) -> dict:
        """Invalidate every remote agent in NIXL under the node's feet, so its next
        transfer fails to post (as after a peer re-registers its metadata)."""
        agent = self.node.agent
        self.node.loop.call(lambda: [agent.remove_peer(p) for p in agent.peers])
        return {}

    def injected(self) -> dict:
        """The faults injected so far, as "op/mode" -> count."""
        counts = self.faults.injected if self.faults else {}
        return {"injected": {f"{op}/{mode}": n for (op, mode), n in counts.items()}}

    def close(self) -> dict:
        self.node.close()
        return {}
