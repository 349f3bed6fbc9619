"""`kvpush bench protocol`: time from "producer done" to "consumer ready", push vs pull.

Two OS processes run kvpush Nodes over real NIXL, each beside a small engine loop
shaped like vLLM's: the prefill engine computes queued requests in batched steps,
layer by layer, and reports each layer's KV as it is written (as the connector does
from vLLM's save_kv_layer hook); the decode engine admits new requests and sees
finished transfers only at step boundaries, as vLLM's scheduler does. A third
process plays the router:

- push: both legs at once; decode allocates and registers while prefill computes;
- pull: the prefill leg, then, when prefill reports done, the decode leg.

Per request the bench records producer done (wall clock, when prefill marked the KV
ready) and consumer ready (when the decode engine saw it usable) and checks every
transferred byte. Identical Node code runs both modes; only the protocol differs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import statistics
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.backend.plugins import get_backends
from kvpush.bench import children
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.errors import KVPushError
from kvpush.node import Node, NodeConfig
from kvpush.protocol.config import ProtocolConfig

# 32 layers, as an 8B-parameter model has; 8 blocks of 8 KiB each per layer: 2 MiB a request.
LAYERS, POOL_BLOCKS, BLOCK_BYTES, BLOCKS_PER_REQUEST = 32, 512, 8 * 1024, 8
SAMPLE_STRIDE = 1024
START_S = 120.0  # a producer process up and listening


@dataclass(frozen=True)
class Settings:
    prefill_s_per_request: float = 0.020
    decode_step_s: float = 0.010
    requests_per_stream: int = 8
    idle_seconds: float = 3.0
    secret: bytes = field(default_factory=lambda: os.urandom(16))  # the pair's, per run


@dataclass
class PointResult:
    mode: str
    in_flight: int
    requests: int
    done_to_ready_p50_ms: float
    done_to_ready_p90_ms: float
    done_to_ready_mean_ms: float
    failed: int
    verified: bool
    kv_mib_per_request: float
    decode_step_ms: float
    producer_idle_cpu_pct: float
    consumer_idle_cpu_pct: float


def _kv(fill: int) -> tuple[np.ndarray, Any]:
    buf = np.full((LAYERS, POOL_BLOCKS, BLOCK_BYTES), fill, dtype=np.uint8)
    tensors = {f"layer.{i}": buf[i] for i in range(LAYERS)}
    return buf, get_backends(["host"]).describe(tensors, ("blocks", "bytes"))


class _Pool:
    def __init__(self) -> None:
        self.free = deque(range(POOL_BLOCKS))

    def take(self) -> list[int]:
        return [self.free.popleft() for _ in range(BLOCKS_PER_REQUEST)]

    def give(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def _idle_cpu(seconds: float) -> float:
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (time.process_time() - cpu0) / (time.monotonic() - wall0)


def _value(transfer_id: str) -> int:
    return 1 + zlib.crc32(transfer_id.encode()) % 250


def _commands(conn: Any, wait: bool) -> list[tuple[str, Any]] | None:
    """The router's commands queued on `conn` (waiting for one if `wait`), or None
    once it says stop. A request to measure idle CPU is served here, in passing."""
    commands: list[tuple[str, Any]] = []
    while conn.poll(None if wait and not commands else 0):
        kind, payload = conn.recv()
        if kind == "stop":
            return None
        if kind == "idle":
            conn.send(("idle", _idle_cpu(payload)))
        else:
            commands.append((kind, payload))
    return commands


def _producer_main(mode: str, settings: Settings, conn: Any) -> None:
    """The prefill engine: steps of compute, each step's KV ready together."""
    buf, kv = _kv(0)
    config = NodeConfig(
        "bench-prefill", "producer", protocol=ProtocolConfig(mode=mode), secret=settings.secret
    )
    node = Node(config, kv, get_backends(["host"])).start()
    conn.send(("address", node.address))
    pool, queue, held = _Pool(), deque(), {}
    rng = random.Random(7)
    while (commands := _commands(conn, wait=not queue)) is not None:
        for _, tid in commands:  # "prefill"
            queue.append(tid)
            node.kv_pending(tid)
        for outcome in node.take_results():
            pool.give(held.pop(outcome.transfer_id))
        if not queue:
            continue
        batch = [queue.popleft() for _ in range(len(queue))]
        blocks = {tid: pool.take() for tid in batch}
        held.update(blocks)
        # The forward pass, layer by layer. Prefill is compute-bound: its time grows
        # with the batch's tokens, and varies as real batches' do.
        step = settings.prefill_s_per_request * len(batch) * rng.uniform(0.5, 1.5)
        layer_time = step / LAYERS
        for layer in range(LAYERS):
            time.sleep(layer_time)  # the layer's attention writes every request's KV:
            for tid in batch:
                buf[layer, blocks[tid]] = _value(tid)
            wall = time.time()  # then the engine hook reports the layer for the batch
            node.kv_ready_many([(t, blocks[t]) for t in batch], ready_wall=wall, layers=layer + 1)
        for tid in batch:
            conn.send(("done", (tid, wall)))
    node.close()


def _consumer_main(mode: str, settings: Settings, producer: str, conn: Any) -> None:
    """The decode engine: admits and notices only at step boundaries."""
    buf, kv = _kv(0)
    config = NodeConfig(
        "bench-decode", "consumer", protocol=ProtocolConfig(mode=mode), secret=settings.secret
    )
    node = Node(config, kv, get_backends(["host"])).start()
    pool, waiting = _Pool(), {}
    arrivals: deque[str] = deque()
    while (commands := _commands(conn, wait=not (waiting or arrivals))) is not None:
        arrivals.extend(tid for _, tid in commands)  # "decode"
        # Step boundary: admit arrivals, then look at finished transfers.
        while arrivals:
            tid = arrivals.popleft()
            blocks = pool.take()
            waiting[tid] = blocks
            node.expect(tid, producer, blocks)
        if settings.decode_step_s or arrivals or not waiting:
            outcomes = node.take_results()
        else:
            outcomes = node.wait_results(0.05)  # no steps: notice the moment it lands
        seen = time.time()  # readiness is when the engine sees it; checking bytes is extra
        for outcome in outcomes:
            blocks = waiting.pop(outcome.transfer_id)
            # A strided sample of every block of every layer, then cleared: enough to
            # catch a block that got another request's bytes or none, cheap enough to
            # keep the engine's step short.
            sample = buf[:, blocks, ::SAMPLE_STRIDE]
            ok = outcome.kind == "delivered" and bool((sample == _value(outcome.transfer_id)).all())
            buf[:, blocks, ::SAMPLE_STRIDE] = 0
            pool.give(blocks)
            conn.send(("ready", (outcome.transfer_id, seen, ok, outcome.kind)))
        if settings.decode_step_s:
            time.sleep(settings.decode_step_s)  # the decode forward pass
    node.close()


def run_point(mode: str, in_flight: int, settings: Settings) -> PointResult:
    """One mode at one concurrency: `in_flight` closed-loop request streams."""
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    started = [children.start("producer", _producer_main, mode, settings, p_child)]
    # Only the child holds its end now: if it dies, our end reads EOF instead of waiting.
    p_child.close()
    try:
        ((_, _, address),) = _messages([p_conn], START_S)
        started.append(children.start("consumer", _consumer_main, mode, settings, address, d_child))
        d_child.close()
        return _drive(mode, in_flight, settings, p_conn, d_conn)
    finally:
        for conn in (p_conn, d_conn):
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        children.stop(started, grace=20)


def _messages(conns: list[Any], timeout: float) -> list[tuple[Any, str, Any]]:
    """The messages waiting on `conns`, waiting up to `timeout` for the first."""
    ready = mp.connection.wait(conns, timeout=timeout)
    if not ready:
        raise KVPushError(f"bench protocol: no side said anything in {timeout:g}s")
    messages = []
    for conn in ready:
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise KVPushError("bench protocol: a side ended early (its error is above)") from None
        messages.append((conn, kind, payload))
    return messages


def _drive(mode: str, in_flight: int, settings: Settings, p_conn: Any, d_conn: Any) -> PointResult:
    """The router: keeps `in_flight` requests outstanding, records done and ready."""
    total = in_flight * settings.requests_per_stream
    issued, failed, verified = 0, 0, True
    # Decode may report a transfer before prefill's "done" reaches us: pair them up.
    done_at: dict[str, float] = {}
    ready_at: dict[str, float] = {}
    latencies: list[float] = []

    def pair(tid: str) -> None:
        if tid in done_at and tid in ready_at:
            latencies.append(ready_at.pop(tid) - done_at.pop(tid))

    def issue() -> None:
        nonlocal issued
        tid = f"{mode}-{in_flight}-{issued}"
        issued += 1
        p_conn.send(("prefill", tid))
        if mode == "push":
            d_conn.send(("decode", tid))

    # The first transfer pays NIXL's connection set-up; keep it out of the numbers.
    warm = f"{mode}-{in_flight}-warmup"
    p_conn.send(("prefill", warm))
    if mode == "push":
        d_conn.send(("decode", warm))
    _wait_ready(p_conn, d_conn, mode, warm)
    for _ in range(in_flight):
        issue()
    while len(latencies) < total:
        for _, kind, payload in _messages([p_conn, d_conn], 60):
            if kind == "done":
                tid, when = payload
                done_at[tid] = when
                if mode == "pull":
                    d_conn.send(("decode", tid))
            elif kind == "ready":
                tid, when, ok, outcome = payload
                ready_at[tid] = when
                failed += outcome != "delivered"
                verified &= ok
                if issued < total:
                    issue()
            pair(tid)
    p_conn.send(("idle", settings.idle_seconds))
    d_conn.send(("idle", settings.idle_seconds))
    idle = {id(c): _messages([c], settings.idle_seconds + 30)[0][2] for c in (p_conn, d_conn)}
    return PointResult(
        mode=mode,
        in_flight=in_flight,
        requests=total,
        done_to_ready_p50_ms=round(1e3 * statistics.median(latencies), 3),
        done_to_ready_p90_ms=round(1e3 * sorted(latencies)[int(0.9 * (len(latencies) - 1))], 3),
        done_to_ready_mean_ms=round(1e3 * statistics.fmean(latencies), 3),
        failed=failed,
        verified=verified,
        kv_mib_per_request=LAYERS * BLOCKS_PER_REQUEST * BLOCK_BYTES / (1 << 20),
        decode_step_ms=settings.decode_step_s * 1e3,
        producer_idle_cpu_pct=round(idle[id(p_conn)], 3),
        consumer_idle_cpu_pct=round(idle[id(d_conn)], 3),
    )


def _wait_ready(p_conn: Any, d_conn: Any, mode: str, tid: str) -> None:
    while True:
        for _, kind, payload in _messages([p_conn, d_conn], 120):
            if kind == "done" and mode == "pull":
                d_conn.send(("decode", payload[0]))
            if kind == "ready" and payload[0] == tid:
                return


def _median_of(runs: list[PointResult]) -> PointResult:
    """One point from repeated runs: medians of the timings, all checks combined."""

    def median(field: str) -> float:
        return round(statistics.median(getattr(r, field) for r in runs), 3)

    first = runs[0]
    return PointResult(
        mode=first.mode,
        in_flight=first.in_flight,
        requests=sum(r.requests for r in runs),
        done_to_ready_p50_ms=median("done_to_ready_p50_ms"),
        done_to_ready_p90_ms=median("done_to_ready_p90_ms"),
        done_to_ready_mean_ms=median("done_to_ready_mean_ms"),
        failed=sum(r.failed for r in runs),
        verified=all(r.verified for r in runs),
        kv_mib_per_request=first.kv_mib_per_request,
        decode_step_ms=first.decode_step_ms,
        producer_idle_cpu_pct=median("producer_idle_cpu_pct"),
        consumer_idle_cpu_pct=median("consumer_idle_cpu_pct"),
    )


def main(points: tuple[int, ...], settings: Settings, as_json: bool, repeat: int = 1) -> int:
    steps = Progress("kvpush bench protocol", "point", 2 * len(points))
    report = Report(as_json, steps)
    for in_flight in points:
        for mode in ("push", "pull"):
            runs = []
            for attempt in range(repeat):
                report.step(f"{mode} x{in_flight} ({attempt + 1}/{repeat})")
                runs.append(run_point(mode, in_flight, settings))
            report.add(_median_of(runs))
    results = report.finish(_print_table)
    return 0 if all(r.verified and not r.failed for r in results) else 1


def _print_table(results: list[PointResult]) -> None:
    by_point = {(r.mode, r.in_flight): r for r in results}
    print(
        f"{'in flight':>9} {'push p50 ms':>12} {'pull p50 ms':>12} {'push/pull':>10} "
        f"{'push p90':>9} {'pull p90':>9} {'idle CPU P/D (push)':>20} ok"
    )
    for in_flight in sorted({r.in_flight for r in results}):
        push, pull = by_point[("push", in_flight)], by_point[("pull", in_flight)]
        ratio = push.done_to_ready_p50_ms / pull.done_to_ready_p50_ms
        ok = push.verified and pull.verified and not (push.failed or pull.failed)
        print(
            f"{in_flight:>9} {push.done_to_ready_p50_ms:>12.3f} {pull.done_to_ready_p50_ms:>12.3f} "
            f"{ratio:>10.2f} {push.done_to_ready_p90_ms:>9.3f} {pull.done_to_ready_p90_ms:>9.3f} "
            f"{push.producer_idle_cpu_pct:>9.2f}%/{push.consumer_idle_cpu_pct:.2f}% {ok}"
        )
