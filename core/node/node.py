"""A kvpush worker: the protocol machines driven by real sockets, NIXL and timers.

The Node is the I/O half of the sans-I/O core. Engine threads call its methods
(announce, expect, kv_ready, abort, ...); each call is handed to the loop thread,
which owns the NIXL agent, the side-channel connections and the timers, feeds the
event to the producer or consumer machine, and has the interpreter carry out the
actions it returns — over the Links (side channel) and the DataPath (NIXL).
Outcomes (KV delivered, transfer failed, source blocks releasable) queue up for the
engine to collect with take_results().
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvpush.addresses import loopback_problem, machine_id, network_id
from kvpush.backend import DeviceKV
from kvpush.backend.plugins import Backends, get_backends
from kvpush.errors import KVPushError
from kvpush.layout import KVLayout
from kvpush.metrics import Metrics
from kvpush.node.datapath import DataPath
from kvpush.node.faults import Faults, FaultyAgent, FaultyBackends
from kvpush.node.interpreter import Interpreter, Outcome
from kvpush.node.links import Links
from kvpush.node.write_order import choose as choose_write_order
from kvpush.protocol import actions as act
from kvpush.protocol.auth import Session
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer, Source
from kvpush.protocol.handshake import ROLES
from kvpush.protocol.messages import Hello, Identity, Message, split_notifs
from kvpush.protocol.producer import Producer
from kvpush.transport.agent import AgentConfig, NixlAgent
from kvpush.transport.channel import Listener
from kvpush.transport.loop import Loop, TimerHandle

__all__ = ["Node", "NodeConfig", "Outcome", "Source"]


@dataclass(frozen=True)
class NodeConfig:
    """How a worker takes part: its identity, role, side channel and protocol timers."""

    engine_id: str
    role: str = "both"
    rank: int = 0
    world: int = 1
    host: str = "127.0.0.1"  # the address peers dial, advertised
    port: int = 0
    listen: str = ""  # where the side channel binds ("": `host`)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    secret: bytes = b""
    insecure: bool = False  # an empty secret is refused unless this is set
    nixl_backends: tuple[str, ...] = ()  # empty: the device backend's choice
    connect_timeout_s: float = 5.0
    handshake_s: float = 10.0  # from connect to paired, or the link is dropped
    epoch: str = field(default_factory=lambda: os.urandom(4).hex())
    # Where this process's loopback leads (kvpush.addresses.network_id): a producer
    # elsewhere that advertises a loopback address is refused before any dial.
    network: str = field(default_factory=network_id)
    machine: str = field(default_factory=machine_id)  # kvpush.addresses.machine_id

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise KVPushError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.secret and not self.insecure:
            raise KVPushError(
                "a kvpush node needs a shared secret: without one, anyone who reaches "
                "its side channel can read and write its KV memory (set insecure to "
                "run without one on purpose)"
            )

    @property
    def identity(self) -> Identity:
        return Identity(self.engine_id, self.rank, self.world, self.epoch)


class Node:
    """One worker rank's kvpush: producer, consumer, or both.

    `clock` (monotonic seconds: the machines' deadlines, which the Loop's timers
    wait for, so it must run with time.monotonic) and `wall` (time.time, for
    latencies measured across processes) are every clock the Node and its parts read.
    """

    def __init__(
        self,
        config: NodeConfig,
        kv: DeviceKV,
        backends: Backends | None = None,
        metrics: Metrics | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        faults: Faults | None = None,
    ) -> None:
        self.config = config
        self.faults = faults  # tests and drills: the data path's calls fail on purpose
        # Called on the loop thread after each outcome is queued: must not block.
        self._on_outcome = on_outcome
        self.kv = kv
        self.backends = backends or get_backends()
        if faults is not None:
            self.backends = FaultyBackends(self.backends, faults)
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.wall = wall
        self.loop = Loop(f"kvpush-{config.engine_id}-r{config.rank}")
        tokens = kv.layout.tokens_per_block
        null = kv.layout.null_block
        self.producer = Producer(config.protocol, len(kv.layout.layers), tokens, null)
        self.consumer = Consumer(config.protocol, kv.layout.digest(), tokens, null)
        # Made on the loop thread, which owns NIXL:
        self.agent: NixlAgent | None = None
        self.data: DataPath | None = None
        self.links: Links | None = None
        self.interpreter: Interpreter | None = None
        # Transfers per machine state, as of the last thing the node did (see _reschedule).
        self.state_counts: dict[str, dict[str, int]] = {"producer": {}, "consumer": {}}
        self.listener: Listener | None = None
        self._timer: TimerHandle | None = None
        self._timer_at: float | None = None
        self._results: deque[Outcome] = deque()
        self._results_ready = threading.Condition()
        self._closed = False

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> Node:
        self.loop.start(self._init_on_loop)
        return self

    def _init_on_loop(self) -> None:
        try:
            self._make_parts()
        except BaseException:
            # The caller gets the error and never a Node to close: undo what was made.
            if self.listener is not None:
                self.listener.close()
            if self.agent is not None:
                self.agent.close()
            self.backends.release(self.kv)
            raise

    def _make_parts(self) -> None:
        config = self.config
        self.backends.bind_thread(self.kv)
        nixl_backends = self.backends.nixl_backends(self.kv, config.nixl_backends)
        agent_config = dataclasses.replace(config.agent, backends=tuple(nixl_backends))
        self.agent = NixlAgent(
            f"kvpush-{config.engine_id}-r{config.rank}-{config.epoch}", agent_config
        )
        self.agent.register(self.kv.layout.regions)
        agent = self.agent if self.faults is None else FaultyAgent(self.agent, self.faults)
        self.data = DataPath(
            agent,
            self.kv,
            self.backends,
            self.metrics,
            config.protocol.write_grace_s,
            self.clock,
            order=partial(
                choose_write_order,
                config.agent.write_order,
                config.machine,
                ucx="UCX" in nixl_backends,
            ),
        )
        self.links = Links(
            self.loop,
            self.data,
            self,
            self._hello,
            config.secret,
            self.metrics,
            config.connect_timeout_s,
            config.handshake_s,
            config.protocol.link_timeout_s,
        )
        self.interpreter = Interpreter(
            self.producer,
            self.consumer,
            self.links,
            self.data,
            self._publish,
            self.metrics,
            self.clock,
            self.wall,
        )
        if config.role in ("producer", "both"):
            listen = config.listen or config.host
            self.listener = Listener(self.loop, listen, config.port, self.links.accept)
        self.loop.add_poller(self)

    @property
    def address(self) -> str:
        """host:port of this node's side channel (producers and kv_both only)."""
        if self.listener is None:
            raise KVPushError("this node does not listen: its role is consumer")
        # Bound to every interface, the listener's own address says nothing to peers.
        host = self.config.host if self.config.listen else self.listener.host
        return f"{host}:{self.listener.port}"

    def close(self) -> None:
        """Close connections (peers see it at once), release NIXL, stop the loop, then
        let the backend free what it holds for the KV (pinned staging buffers)."""
        if self._closed:
            return
        self._closed = True
        if self.loop.running:
            try:
                self.loop.call(self._close_on_loop, timeout=10)
            finally:
                self.loop.stop()
        # NIXL has let go of the memory and no copy can start: free staging buffers.
        self.backends.release(self.kv)

    def _close_on_loop(self) -> None:
        self.loop.remove_poller(self)
        if self.listener is not None:
            self.listener.close()
        if self.links is not None:
            self.links.close()
        if self.agent is not None:
            self.agent.close()

    # -- engine API (any thread) -------------------------------------------------------

    def announce(
        self, transfer_id: str, producer: str, engine: str = "", epoch: str = "", network: str = ""
    ) -> None:
        """Consumer: a request for this transfer arrived; blocks come later. The
        producer at `producer` must be engine `engine` in boot `epoch` when given;
        `network`: where its loopback leads, as its identity says ("": unknown)."""
        if self._loopback_refused([producer], network):
            return  # expect() fails the transfer, with the reason
        self._submit_fn(
            lambda now: self.consumer.announce(transfer_id, producer, now, engine, epoch),
            transfer_id,
        )

    def expect(
        self,
        transfer_id: str,
        producer: str | Sequence[Source],
        block_ids: Sequence[int],
        skip_blocks: int = 0,
        engine: str = "",
        epoch: str = "",
        network: str = "",
    ) -> None:
        """Consumer: these blocks wait for `transfer_id`'s KV from `producer` (host:port,
        in boot `epoch` when given), or from each of several producer ranks (Sources);
        every one must be engine `engine` when given, on `network` (as announce's)."""
        blocks = [int(b) for b in block_ids]
        sources = [Source(producer, epoch)] if isinstance(producer, str) else list(producer)
        problem = self._loopback_refused([s.peer for s in sources], network)
        if problem:
            self.loop.call_soon(self._refuse_transfer, transfer_id, problem)
            return

        def run(now: float) -> list[act.Action]:
            assert self.data is not None
            self.data.expect(transfer_id, blocks)
            self.metrics.inc("transfers_started", role="consumer")
            return self.consumer.expect(transfer_id, sources, blocks, now, skip_blocks, engine)

        self._submit_fn(run, transfer_id)

    def kv_pending(self, transfer_id: str, sequential: bool = False) -> None:
        """Producer: the engine holds the request; it will compute its KV.
        `sequential`: the producer named the transfer (Producer.kv_pending)."""
        self._submit_fn(
            lambda now: self.producer.kv_pending(transfer_id, now, sequential), transfer_id
        )

    def kv_ready(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        fence: Any = None,
        ready_wall: float | None = None,
        layers: int | None = None,
    ) -> None:
        """Producer: layers 0..layers-1 (all if None) of the request's KV are computed.

        `fence` (from Backends.fence) marks the last device write of those layers; the
        WRITE that reads them waits on it. Staged KV moves only once complete.
        """
        self.kv_ready_many([(transfer_id, block_ids)], fence, ready_wall, layers)

    def kv_ready_many(
        self,
        transfers: Sequence[tuple[str, Sequence[int]]],
        fence: Any = None,
        ready_wall: float | None = None,
        layers: int | None = None,
    ) -> None:
        """kv_ready for a batch that one forward pass computed together: one hand-off
        to the loop thread for all of them, so their WRITEs go out back to back."""
        total = len(self.kv.layout.layers)
        upto = total if layers is None else min(layers, total)
        if upto < total and self.kv.path == "staged":
            return  # staging copies whole blocks; it waits for the last layer
        wall = self.wall() if ready_wall is None else ready_wall
        reports = [
            (
                tid,
                partial(
                    self.producer.kv_ready,
                    tid,
                    [int(b) for b in blocks],
                    ready_wall=wall,
                    layers=upto,
                ),
            )
            for tid, blocks in transfers
        ]
        self._report_kv(reports, upto, fence)

    def kv_progress_many(
        self, transfers: Sequence[tuple[str, Sequence[int], int]], fence: Any = None
    ) -> None:
        """Producer, chunked prefill: a step computed part of these prompts, not their
        last token. Each is (transfer id, its blocks so far, how many leading ones are
        complete in every layer); push writes those before the last chunk runs.

        `fence` marks the end of the step; it is kept as the fence of every earlier
        layer (key 0), so whichever WRITE reads these blocks next waits on it. A later
        step's fence stands in for an earlier one's: a device runs steps in order.
        """
        if self.kv.path == "staged":
            return  # staging copies whole requests: it waits for the last step
        reports = [
            (tid, partial(self.producer.kv_progress, tid, [int(b) for b in blocks], int(full)))
            for tid, blocks, full in transfers
        ]
        self._report_kv(reports, 0, fence)

    def _report_kv(
        self,
        reports: list[tuple[str, Callable[[float], list[act.Action]]]],
        fence_key: int,
        fence: Any,
    ) -> None:
        """Hand a step's KV reports to the loop thread in one go, so that their WRITEs
        share NIXL posts; each report is the producer call, waiting only for `now`."""

        def run() -> None:
            assert self.data is not None
            now = self.clock()
            actions: list[act.Action] = []
            for transfer_id, report in reports:
                if self.data.add_fence(transfer_id, fence_key, fence):
                    self.metrics.inc("transfers_started", role="producer")
                actions += report(now)
                if not self.producer.tracks(transfer_id):
                    # It ended (released, aborted): no WRITE will wait on these fences.
                    self.data.drop_fences(transfer_id)
            self._run(actions)

        self.loop.call_soon(run)

    def abort(self, transfer_id: str) -> None:
        """Either side: the engine dropped the request for `transfer_id`."""

        def run(now: float) -> list[act.Action]:
            return self.consumer.abort(transfer_id, now) + self.producer.abort(transfer_id, now)

        self._submit_fn(run, transfer_id)

    def _loopback_refused(self, peers: list[str], network: str) -> str | None:
        """Why a producer on `network` must not be dialled at `peers`, or None."""
        for peer in peers:
            problem = loopback_problem(peer, network, self.config.network)
            if problem:
                return problem
        return None

    def _refuse_transfer(self, transfer_id: str, problem: str) -> None:
        """A claim ends before any dial: nothing was sent, so nothing can land."""
        assert self.interpreter is not None
        self.metrics.inc("handshakes", result="refused")
        self.interpreter.report("failed", transfer_id, "handshake_failed", problem)

    def release_unclaimed(self, transfer_id: str) -> None:
        """Producer: the router says no consumer will come for `transfer_id`
        (Producer.release_unclaimed): a "released" outcome, or "release_refused"."""
        self._submit_fn(lambda now: self.producer.release_unclaimed(transfer_id, now), transfer_id)

    def take_results(self) -> list[Outcome]:
        """Outcomes since the last call, oldest first."""
        with self._results_ready:
            results = list(self._results)
            self._results.clear()
        return results

    def wait_results(self, timeout: float) -> list[Outcome]:
        """take_results(), waiting up to `timeout` seconds for at least one."""
        with self._results_ready:
            self._results_ready.wait_for(lambda: bool(self._results), timeout)
        return self.take_results()

    def stats(self) -> dict[str, Any]:
        """Live counts for debugging and leak checks."""

        def on_loop() -> dict[str, Any]:
            assert self.data is not None and self.links is not None
            return {
                "producer_holding": self.producer.holding(),
                "consumer_waiting": self.consumer.waiting(),
                **self.data.counts(),
                "links": self.links.ready_peers(),
            }

        return self.loop.call(on_loop)

    def _submit(self, method: Any, transfer_id: str, *args: Any) -> None:
        self._submit_fn(lambda now: method(transfer_id, *args, now), transfer_id)

    def _submit_fn(self, fn: Any, transfer_id: str) -> None:
        def on_loop() -> None:
            try:
                actions = fn(self.clock())
            except KVPushError as exc:
                assert self.interpreter is not None
                self.interpreter.report("failed", transfer_id, "bad_request", str(exc))
                return
            self._run(actions)

        self.loop.call_soon(on_loop)

    def _publish(self, outcome: Outcome) -> None:
        with self._results_ready:
            self._results.append(outcome)
            self._results_ready.notify_all()
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    # -- what the links report (loop thread) ---------------------------------------------

    def _hello(self, session: Session) -> Hello:
        assert self.agent is not None
        return Hello(
            identity=self.config.identity,
            mode=self.config.protocol.mode,
            role=self.config.role,
            agent_name=self.agent.name,
            layout_digest=self.kv.layout.digest(),
            nonce=session.nonce,
            lease_s=self.config.protocol.lease_s,
            registration_ttl_s=self.config.protocol.registration_ttl_s,
            silence_s=self.config.protocol.silence_s,
            heartbeat_s=self.config.protocol.heartbeat_s,
            machine=self.config.machine,
        )

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, outgoing: bool) -> None:
        machine = self.consumer if outgoing else self.producer
        self._run(machine.on_ready(peer, hello, layout, self.clock()))

    def on_message(self, peer: str, message: Message, outgoing: bool) -> None:
        machine = self.consumer if outgoing else self.producer
        self._run(machine.on_message(peer, message, self.clock()))

    def on_lost(
        self, peer: str, reason: str, outgoing: bool, was_ready: bool, by_peer: bool = False
    ) -> None:
        now = self.clock()
        if outgoing and not was_ready:
            self._run(self.consumer.on_handshake_failed(peer, reason, now))
        elif outgoing:
            self._run(self.consumer.on_peer_lost(peer, reason, now, by_peer))
        elif was_ready:
            self._run(self.producer.on_peer_lost(peer, reason, now))

    # -- polling and timers (loop thread) --------------------------------------------------

    def _run(self, actions: list[act.Action]) -> None:
        assert self.interpreter is not None
        try:
            self.interpreter.run(actions)
        finally:
            # Whatever raised, the timers that end stuck transfers keep running.
            self._reschedule()

    def busy(self) -> bool:
        # Also while a peer may be moving bytes into or out of our memory: some transports
        # (UCX over TCP) complete one-sided operations only when the target calls NIXL.
        assert self.data is not None
        return self.data.busy() or self.consumer.awaiting_writes() or self.producer.awaiting_reads()

    def poll(self) -> bool:
        assert self.data is not None and self.interpreter is not None
        settled = self.data.progress()
        if settled:
            self.interpreter.settle(settled)
            # Each consumer's next WRITEs, once the follow-ups of those that ended are
            # queued with the rest (kvpush.node.write_order: oldest transfer first).
            self.interpreter.settle(self.data.post_queued())
        notifs = self.data.notifs()
        now = self.clock()
        for peer, message in notifs:
            actions: list[act.Action] = []
            for notif in split_notifs(message):
                actions += self.consumer.on_notif(peer, notif, now)
            self.interpreter.run(actions)
        if settled or notifs:
            self._reschedule()
        return bool(settled or notifs)

    def _reschedule(self) -> None:
        """After anything ran: re-arm the timers, and note the machines' state counts."""
        # Read from other threads (the engine's), swapped whole: no lock needed.
        self.state_counts = {
            "producer": self.producer.counts(),
            "consumer": self.consumer.counts(),
        }
        deadlines = [d for d in (self.producer.next_deadline(), self.consumer.next_deadline()) if d]
        due = min(deadlines) if deadlines else None
        if due == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self.loop.call_at(due, self._tick) if due is not None else None

    def _tick(self) -> None:
        self._timer = self._timer_at = None
        now = self.clock()
        self._run(self.producer.tick(now) + self.consumer.tick(now))
