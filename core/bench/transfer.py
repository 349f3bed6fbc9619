"""`kvpush bench transfer`: raw NIXL WRITE bandwidth between two processes.

Two OS processes each hold a KV-shaped buffer (layers x blocks; per block K and V,
each KV heads x tokens x dim, a GPU's HND layout) and register it with NIXL. The
sender WRITEs a scattered half of the blocks into the receiver's matching blocks,
with a notification, and times it. In the same run the sender times a one-process
memcpy of the same number of bytes after each WRITE: the practical limit on this
machine, and the baseline every ratio is against.

Each size is measured twice: at equal tensor parallelism (TP 1 -> TP 1, whole
blocks) and mixed (TP 2 -> TP 1: prefill rank 0's block fills the first half of
the KV heads of decode's, K and V apart, by the descriptors kvpush's layout plan
makes). Both move the same bytes from sender blocks of the same size; the mixed
row's `vs equal` is its NIXL rate over the equal row's.

The receiver runs kvpush's loop exactly as the connector does, so its idle CPU
(measured while connected and nothing is sent) is the idle cost of a real peer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpush.backend.plugins import get_backends
from kvpush.bench import children
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.errors import KVPushError
from kvpush.layout import BlockTable, KVLayout, Shard, plan
from kvpush.transport.agent import AgentConfig, NixlAgent
from kvpush.transport.channel import Connection, Listener, connect
from kvpush.transport.loop import Loop

MiB = 1 << 20
LAYERS = 4
SIZES_MIB = (1, 16, 256)
START_S, RESULT_S = 120.0, 300.0  # a process's start; one size's whole measurement
WRITE_S = 60.0  # one WRITE, from prepare to done: far past any size measured here
HEADS, TOKENS = 8, 16  # the model's KV heads; tokens per block
DIMS = ("blocks", "kv", "heads", "tokens", "dim")


@dataclass(frozen=True)
class Shape:
    """A KV-shaped buffer: `layers` layers of `pool` blocks. The sender's blocks are
    `block_bytes` (K+V) and hold the heads its TP rank holds; the receiver, at TP 1,
    holds every head."""

    total_bytes: int
    sender_tp: int = 1
    layers: int = LAYERS

    @property
    def selected(self) -> int:
        # Blocks moved per transfer: 16 at 1 MiB, growing so blocks stay 16 KiB-2 MiB.
        return max(16, min(64, self.total_bytes // (self.layers * 256 * 1024)))

    @property
    def block_bytes(self) -> int:
        return self.total_bytes // (self.layers * self.selected)

    @property
    def pool(self) -> int:
        return 2 * self.selected

    @property
    def sender_heads(self) -> int:
        return HEADS // self.sender_tp

    def array(self, fill: int, heads: int) -> np.ndarray:
        dim = self.block_bytes // (2 * self.sender_heads * TOKENS)
        return np.full((self.layers, self.pool, 2, heads, TOKENS, dim), fill, dtype=np.uint8)

    def picked_blocks(self, seed: int) -> np.ndarray:
        return np.sort(np.random.default_rng(seed).permutation(self.pool)[: self.selected])


@dataclass
class SizeResult:
    size_mib: float
    tp: str  # "1->1" or "2->1"
    block_kib: float
    blocks_per_transfer: int
    descriptors: int
    runs: int
    nixl_gbps: float
    memcpy_gbps: float
    ratio: float
    prepare_us: float
    post_us: float
    first_transfer_ms: float
    receiver_idle_cpu_pct: float
    verified: bool
    vs_equal: float | None = None  # mixed rows: NIXL rate over the equal-TP row's


def _describe(buf: np.ndarray, shard: Shard) -> KVLayout:
    tensors = {f"layer.{i}": buf[i] for i in range(buf.shape[0])}
    layout = get_backends(["host"]).describe(tensors, DIMS).layout
    return msgspec.structs.replace(layout, shard=shard)


class _Side:
    """One process's half: a loop thread owning the agent, and its side channel."""

    def __init__(self, name: str, buf: np.ndarray, shard: Shard) -> None:
        self.buf = buf
        self.layout = _describe(buf, shard)
        self.loop = Loop(f"bench-{name}")
        self.agent: NixlAgent = self.loop.start(lambda: NixlAgent(name, AgentConfig()))
        self.loop.call(self.agent.register, self.layout.regions)
        self.inbox: list[dict[str, Any]] = []
        self.conn: Connection | None = None

    def attach(self, sock: Any) -> None:
        self.conn = Connection(self.loop, sock, self._on_frame, self._on_close)

    def _on_frame(self, conn: Connection, frame: bytes) -> None:
        self.inbox.append(msgspec.msgpack.decode(frame))

    def _on_close(self, conn: Connection, reason: str) -> None:
        self.inbox.append({"kind": "closed", "reason": reason})

    def send(self, **message: Any) -> None:
        self.loop.call(self.conn.send, msgspec.msgpack.encode(message))

    def receive(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inbox:
                message = self.loop.call(self.inbox.pop, 0)
                if message["kind"] == "closed":
                    raise RuntimeError(f"bench peer went away: {message['reason']}")
                return message
            time.sleep(0.001)
        raise TimeoutError("bench peer did not answer")


class _NotifWaiter:
    """The receiver's poller: fast polling only while notifications are expected."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.expected = 0
        self.received: list[bytes] = []

    def busy(self) -> bool:
        return len(self.received) < self.expected

    def poll(self) -> bool:
        batch = self.agent.notifs()
        self.received.extend(message for _, message in batch)
        return bool(batch)


def _receiver_main(
    shape: Shape, port_queue: Any, idle_seconds: float, host: str = "127.0.0.1"
) -> None:
    side = _Side("bench-receiver", shape.array(0, HEADS), Shard(0, 1, HEADS))
    listener = side.loop.call(lambda: Listener(side.loop, host, 0, side.attach))
    port_queue.put(listener.port)
    waiter = _NotifWaiter(side.agent)
    side.loop.call(side.loop.add_poller, waiter)
    hello = side.receive()
    side.loop.call(side.agent.add_peer, hello["metadata"])
    side.send(kind="hello", metadata=side.loop.call(side.agent.metadata), layout=side.layout)
    while True:
        message = side.receive(timeout=600)
        if message["kind"] == "idle":
            # Connected, registered, nothing in flight: what does sitting here cost?
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(idle_seconds)
            cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
            side.send(kind="idle", cpu_pct=100.0 * cpu)
        elif message["kind"] == "expect":
            side.loop.call(setattr, waiter, "expected", waiter.expected + 1)
            side.send(kind="ready")
        elif message["kind"] == "check":
            deadline = time.monotonic() + 30
            while waiter.busy() and time.monotonic() < deadline:
                time.sleep(0.0005)
            side.send(kind="checked", ok=_verify(side.buf, shape, message["blocks"]))
        elif message["kind"] == "bye":
            break
    side.loop.stop()


def _verify(buf: np.ndarray, shape: Shape, blocks: list[int]) -> bool:
    """The picked blocks hold the sender's bytes in the sender's heads, and nothing
    else was touched."""
    written = np.zeros(buf.shape, dtype=bool)
    picked = np.zeros(shape.pool, dtype=bool)
    picked[blocks] = True
    written[:, picked, :, : shape.sender_heads] = True
    return bool((buf[written] == 0xAB).all() and (buf[~written] == 0).all())


class _Memcpy:
    """The baseline: one in-process copy of the same number of bytes, timed between the
    WRITEs so that both see the same moment of a shared, noisy machine."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 1, dtype=np.uint8)
        self.dst = np.full(nbytes, 2, dtype=np.uint8)  # touched: no page faults in the timing

    def time_one(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


@dataclass
class Writer:
    """The sender's end once paired: WRITEs of `blocks` into the receiver's, each timed."""

    side: _Side
    shape: Shape
    blocks: np.ndarray
    nbytes: int
    descriptors: int
    write: Callable[[int], tuple[float, float, float]]  # on the loop: prepare, post, total

    def timed(self, tag: int) -> tuple[float, float, float]:
        """One WRITE once the receiver expects its notification: seconds to prepare,
        to post, and in all."""
        self.side.send(kind="expect")
        self.side.receive()
        return self.side.loop.call(self.write, tag)

    def verified(self) -> bool:
        self.side.send(kind="check", blocks=self.blocks.tolist())
        return self.side.receive()["ok"]

    def receiver_idle_cpu(self, idle_seconds: float) -> float:
        self.side.send(kind="idle")
        return self.side.receive(timeout=idle_seconds + 30)["cpu_pct"]

    def close(self) -> None:
        self.side.send(kind="bye")
        self.side.loop.stop()


def open_writer(shape: Shape, host: str, port: int, nap_s: float = 0.0) -> Writer:
    """Pair with the receiver at host:port and prepare both sides' descriptors.

    `nap_s`: the sender sleeps this long between completion checks; 0 spins."""
    shard = Shard(0, shape.sender_tp, HEADS)
    side = _Side("bench-sender", shape.array(0xAB, shape.sender_heads), shard)
    sock = connect(host, port, timeout=10)
    side.loop.call(side.attach, sock)
    side.send(kind="hello", metadata=side.loop.call(side.agent.metadata))
    hello = side.receive()
    peer = side.loop.call(side.agent.add_peer, hello["metadata"])
    remote_layout = msgspec.convert(hello["layout"], KVLayout)
    mine, theirs = plan(side.layout, remote_layout)
    local_table = BlockTable(side.layout, layout_units=mine)
    remote_table = BlockTable(remote_layout, layout_units=theirs)
    local = side.loop.call(side.agent.prepare, local_table.rows, side.layout.mem_type)
    remote = side.loop.call(side.agent.prepare, remote_table.rows, remote_layout.mem_type, peer)

    blocks = shape.picked_blocks(seed=shape.total_bytes)
    local_ids, remote_ids = local_table.ids(blocks), remote_table.ids(blocks)
    nbytes = len(blocks) * shape.layers * shape.block_bytes

    def one_write(tag: int) -> tuple[float, float, float]:
        # The sender checks at once, again and again (or every `nap_s`): this measures
        # the wire, not kvpush's poller.
        agent = side.agent
        t0 = time.perf_counter()
        transfer = agent.make_transfer(
            "WRITE", local, local_ids, remote, remote_ids, b"bench-%d" % tag, nbytes
        )
        t1 = time.perf_counter()
        finished = agent.start(transfer)
        t2 = time.perf_counter()
        while not finished:
            if nap_s:
                time.sleep(nap_s)
            finished = agent.done(transfer)
            if not finished and time.perf_counter() - t0 > WRITE_S:
                raise KVPushError(f"WRITE {tag} of {nbytes} bytes not done after {WRITE_S:g}s")
        t3 = time.perf_counter()
        agent.release(transfer)
        return t1 - t0, t2 - t1, t3 - t0

    return Writer(side, shape, blocks, nbytes, len(local_ids), one_write)


def _sender_main(shape: Shape, port: int, runs: int, idle_seconds: float, out: Any) -> None:
    writer = open_writer(shape, "127.0.0.1", port)
    prepare, post, total, copies = [], [], [], []
    baseline = _Memcpy(writer.nbytes)
    for tag in range(runs + 1):
        p, q, t = writer.timed(tag)
        prepare.append(p)
        post.append(q)
        total.append(t)
        copies.append(baseline.time_one())
    verified = writer.verified()
    idle = writer.receiver_idle_cpu(idle_seconds)
    writer.close()
    nbytes = writer.nbytes
    memcpy = nbytes / statistics.median(copies[1:]) / 1e9
    nixl = nbytes / statistics.median(total[1:]) / 1e9
    out.put(
        SizeResult(
            size_mib=nbytes / MiB,
            tp=f"{shape.sender_tp}->1",
            block_kib=shape.block_bytes / 1024,
            blocks_per_transfer=len(writer.blocks),
            descriptors=writer.descriptors,
            runs=runs,
            nixl_gbps=round(nixl, 3),
            memcpy_gbps=round(memcpy, 3),
            ratio=round(nixl / memcpy, 3),
            prepare_us=round(statistics.median(prepare[1:]) * 1e6, 1),
            post_us=round(statistics.median(post[1:]) * 1e6, 1),
            first_transfer_ms=round(total[0] * 1e3, 2),
            receiver_idle_cpu_pct=round(idle, 3),
            verified=verified,
        )
    )


def run_size(shape: Shape, runs: int, idle_seconds: float) -> SizeResult:
    """Measure one shape with a fresh pair of processes."""
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    receiver = children.start("receiver", _receiver_main, shape, ports, idle_seconds)
    started = [receiver]
    try:
        port = children.take(ports, "the receiver's port", START_S, started)
        sender = children.start("sender", _sender_main, shape, port, runs, idle_seconds, results)
        started.append(sender)
        return children.take(results, "the sender's result", RESULT_S + idle_seconds, started)
    finally:
        children.stop(started[::-1])


def main(sizes_mib: tuple[float, ...], runs: int, idle_seconds: float, as_json: bool) -> int:
    # Two results a size: TP 1->1, then 2->1.
    report = Report(as_json, Progress("kvpush bench transfer", "result", 2 * len(sizes_mib)))
    for size in sizes_mib:
        report.step(f"{size:g} MiB, TP 1->1 then 2->1")
        equal = run_size(Shape(int(size * MiB)), runs, idle_seconds)
        report.add(equal)
        mixed = run_size(Shape(int(size * MiB), sender_tp=2), runs, idle_seconds)
        mixed.vs_equal = round(mixed.nixl_gbps / equal.nixl_gbps, 3)
        report.add(mixed)
    results = report.finish(_print_table)
    return 0 if all(r.verified for r in results) else 1


def _print_table(results: list[SizeResult]) -> None:
    head = (
        f"{'size':>8} {'TP':>5} {'block':>9} {'descs':>6} {'NIXL GB/s':>10} {'memcpy GB/s':>12} "
        f"{'ratio':>6} {'vs equal':>9} {'prep us':>8} {'post us':>9} {'first ms':>9} "
        f"{'rx idle CPU':>12} ok"
    )
    print(head)
    for r in results:
        vs_equal = "" if r.vs_equal is None else f"{r.vs_equal:.2f}"
        print(
            f"{r.size_mib:>6g}Mi {r.tp:>5} {r.block_kib:>7g}Ki {r.descriptors:>6} "
            f"{r.nixl_gbps:>10.2f} {r.memcpy_gbps:>12.2f} {r.ratio:>6.2f} {vs_equal:>9} "
            f"{r.prepare_us:>8.1f} {r.post_us:>9.1f} {r.first_transfer_ms:>9.2f} "
            f"{r.receiver_idle_cpu_pct:>11.2f}% {r.verified}"
        )
    print(f"(pid {os.getpid()}; medians of {results[0].runs if results else 0} runs per size)")
