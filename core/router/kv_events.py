"""vLLM's KV-cache events, read into the router's prefix index (prefix.py).

An instance started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'` publishes, on a ZMQ PUB socket,
messages of three frames: its topic, a sequence number (8 bytes, big-endian), and a
msgpack `KVEventBatch` (an array: time, events, data-parallel rank), whose events
are maps tagged by `type`: `BlockStored` (block_hashes, parent_block_hash,
token_ids, block_size, ...), `BlockRemoved` (block_hashes) and `AllBlocksCleared`.
Only the first KV cache group's device blocks are indexed: they hold the prefix a
request reuses. A gap in the sequence means events were lost: the instance's index
starts over, since a lost removal would leave a block it no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from kvpush.metrics import Metrics
from kvpush.router.prefix import Blocks

log = logging.getLogger(__name__)


def apply(blocks: Blocks, batch: Any) -> int:
    """One decoded batch into `blocks`; how many events it held."""
    events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) >= 2 else []
    for event in events:
        if not isinstance(event, dict) or event.get("group_idx") not in (None, 0):
            continue
        if event.get("medium") not in (None, "GPU"):
            continue  # an offloaded copy: not what a request's prefix lookup finds first
        kind = event.get("type")
        if kind == "BlockStored":
            blocks.stored(
                list(event.get("block_hashes") or []),
                event.get("parent_block_hash"),
                list(event.get("token_ids") or []),
                int(event.get("block_size") or blocks.block_size),
            )
        elif kind == "BlockRemoved":
            blocks.removed(list(event.get("block_hashes") or []))
        elif kind == "AllBlocksCleared":
            blocks.clear()
    return len(events)


class Subscription:
    """One instance's event stream, read until closed."""

    def __init__(self, endpoint: str, url: str, blocks: Blocks, metrics: Metrics) -> None:
        self.endpoint, self.url, self.blocks, self.metrics = endpoint, url, blocks, metrics
        self.blocks.from_events = True  # the router's own guesses would mix with vLLM's word
        self._task: asyncio.Future | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._read())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _read(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        log.info("kvpush router: reading %s's KV-cache events from %s", self.url, self.endpoint)
        expected: int | None = None
        decoder = msgspec.msgpack.Decoder()
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    self.metrics.inc("kv_events_malformed", instance=self.url)
                    continue
                seq = int.from_bytes(frames[1], "big")
                if expected is not None and seq != expected:
                    self.metrics.inc("kv_events_gaps", instance=self.url)
                    self.blocks.clear()
                expected = seq + 1
                try:
                    count = apply(self.blocks, decoder.decode(frames[2]))
                except (msgspec.DecodeError, TypeError, ValueError):
                    self.metrics.inc("kv_events_malformed", instance=self.url)
                    continue
                self.metrics.inc("kv_events", count, instance=self.url)
        finally:
            socket.close()
