"""A kvpush worker: the protocol machines driven by real sockets, NIXL and timers.

The Node is the I/O half of the sans-I/O core. Engine threads call its methods
(announce, expect, kv_ready, abort, ...); each call is handed to the loop thread,
which owns the NIXL agent, the side-channel connections and the timers, feeds the
event to the producer or consumer machine, and carries out the actions it returns.
Outcomes (KV delivered, transfer failed, source blocks releasable) queue up for the
engine to collect with take_results().
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.device import DeviceKV
from kvpush.errors import KVPushError, ProtocolError, TransportError
from kvpush.layout import BlockTable, pairing_split
from kvpush.metrics import Metrics
from kvpush.plugins import Backends, get_backends
from kvpush.protocol import actions as act
from kvpush.protocol.auth import Session
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer
from kvpush.protocol.handshake import pairing_problem
from kvpush.protocol.messages import Hello, Identity, Message, Reject
from kvpush.protocol.producer import Producer
from kvpush.transport.agent import AgentConfig, NixlAgent, PreparedList, Transfer
from kvpush.transport.channel import Connection, Listener, connect
from kvpush.transport.loop import Loop, TimerHandle

log = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True)
class NodeConfig:
    """How a worker takes part: its identity, role, side channel and protocol timers."""

    engine_id: str
    role: str = "both"
    rank: int = 0
    world: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    secret: bytes = b""
    nixl_backends: tuple[str, ...] = ()  # empty: the device backend's choice
    connect_timeout_s: float = 5.0
    epoch: str = field(default_factory=lambda: os.urandom(4).hex())

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise KVPushError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def identity(self) -> Identity:
        return Identity(self.engine_id, self.rank, self.world, self.epoch)


@dataclass(frozen=True)
class Outcome:
    """What the engine must act on: "delivered", "failed" (consumer) or "released"."""

    kind: str
    transfer_id: str
    reason: str = ""
    detail: str = ""
    nbytes: int = 0


@dataclass
class _Link:
    """One side-channel connection and what pairing it with NIXL produced."""

    peer: str  # the machines' name for it: "host:port" outgoing, "c<n>" incoming
    conn: Connection
    session: Session
    outgoing: bool
    ready: bool = False
    hello: Hello | None = None
    agent_peer: str = ""
    split: bool = False
    remote_table: BlockTable | None = None
    remote_list: PreparedList | None = None


@dataclass
class _InFlight:
    transfer: Transfer
    posted: float
    deadline: float
    blocks: list[int]


class Node:
    """One worker rank's kvpush: producer, consumer, or both."""

    def __init__(
        self,
        config: NodeConfig,
        kv: DeviceKV,
        backends: Backends | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.backends = backends or get_backends()
        self.metrics = metrics or Metrics()
        self.loop = Loop(f"kvpush-{config.engine_id}-r{config.rank}")
        self.producer = Producer(config.protocol, num_layers=len(kv.layout.layers))
        self.consumer = Consumer(config.protocol, kv.layout.digest())
        self.agent: NixlAgent | None = None
        self.listener: Listener | None = None
        self._links: dict[str, _Link] = {}
        self._agent_peers: dict[str, str] = {}  # NIXL agent name -> outgoing link peer id
        self._next_conn = 0
        self._local_tables: dict[bool, tuple[BlockTable, PreparedList]] = {}
        self._writes: dict[str, _InFlight] = {}
        self._reads: dict[str, _InFlight] = {}
        self._fences: dict[str, dict[int, Any]] = {}  # transfer -> layers ready -> fence
        self._expected: dict[str, tuple[list[int], float]] = {}
        self._timer: TimerHandle | None = None
        self._timer_at: float | None = None
        self._results: deque[Outcome] = deque()
        self._results_ready = threading.Condition()
        self._metadata = b""
        self._closed = False

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> Node:
        self.loop.start(self._init_on_loop)
        return self

    def _init_on_loop(self) -> None:
        self.backends.bind_thread(self.kv)
        nixl_backends = self.backends.nixl_backends(self.kv, self.config.nixl_backends)
        agent_config = dataclasses.replace(self.config.agent, backends=tuple(nixl_backends))
        name = f"kvpush-{self.config.engine_id}-r{self.config.rank}-{self.config.epoch}"
        self.agent = NixlAgent(name, agent_config)
        self.agent.register(self.kv.layout.regions)
        self._metadata = self.agent.metadata()
        self._local(False)
        if self.config.role in ("producer", "both"):
            self.listener = Listener(self.loop, self.config.host, self.config.port, self._accept)
        self.loop.add_poller(self)

    @property
    def address(self) -> str:
        """host:port of this node's side channel (producers and kv_both only)."""
        if self.listener is None:
            raise KVPushError("this node does not listen: its role is consumer")
        return f"{self.listener.host}:{self.listener.port}"

    def close(self) -> None:
        """Close connections (peers see it at once), release NIXL, stop the loop."""
        if self._closed:
            return
        self._closed = True
        if self.loop.running:
            try:
                self.loop.call(self._close_on_loop, timeout=10)
            finally:
                self.loop.stop()

    def _close_on_loop(self) -> None:
        self.loop.remove_poller(self)
        if self.listener is not None:
            self.listener.close()
        for link in list(self._links.values()):
            link.conn.close("shutting down")
        if self.agent is not None:
            self.agent.close()

    # -- engine API (any thread) -------------------------------------------------------

    def announce(self, transfer_id: str, producer: str) -> None:
        """Consumer: a request for this transfer arrived; blocks come later."""
        self._submit(self.consumer.announce, transfer_id, producer)

    def expect(
        self, transfer_id: str, producer: str, block_ids: Sequence[int], skip_blocks: int = 0
    ) -> None:
        """Consumer: these blocks wait for `transfer_id`'s KV from `producer` (host:port)."""
        blocks = [int(b) for b in block_ids]

        def run(now: float) -> list[act.Action]:
            self._expected[transfer_id] = (blocks, now)
            self.metrics.inc("transfers_started", role="consumer")
            return self.consumer.expect(transfer_id, producer, blocks, now, skip_blocks)

        self._submit_fn(run, transfer_id)

    def kv_pending(self, transfer_id: str) -> None:
        """Producer: the engine holds the request; it will compute its KV."""
        self._submit(self.producer.kv_pending, transfer_id)

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
        wall = time.time() if ready_wall is None else ready_wall
        batch = [(tid, [int(b) for b in blocks]) for tid, blocks in transfers]

        def run() -> None:
            now = time.monotonic()
            for transfer_id, blocks in batch:
                if transfer_id not in self._fences:
                    self.metrics.inc("transfers_started", role="producer")
                    self._fences[transfer_id] = {}
                if fence is not None:
                    self._fences[transfer_id][upto] = fence
                self._run(self.producer.kv_ready(transfer_id, blocks, now, wall, upto))

        self.loop.call_soon(run)

    def abort(self, transfer_id: str) -> None:
        """Either side: the engine dropped the request for `transfer_id`."""

        def run(now: float) -> list[act.Action]:
            return self.consumer.abort(transfer_id, now) + self.producer.abort(transfer_id, now)

        self._submit_fn(run, transfer_id)

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
        return self.loop.call(
            lambda: {
                "producer_holding": self.producer.holding(),
                "consumer_waiting": self.consumer.waiting(),
                "writes_in_flight": len(self._writes),
                "reads_in_flight": len(self._reads),
                "links": sorted(p for p, link in self._links.items() if link.ready),
            }
        )

    def _submit(self, method: Any, transfer_id: str, *args: Any) -> None:
        self._submit_fn(lambda now: method(transfer_id, *args, now), transfer_id)

    def _submit_fn(self, fn: Any, transfer_id: str) -> None:
        def on_loop() -> None:
            try:
                actions = fn(time.monotonic())
            except KVPushError as exc:
                self._publish(Outcome("failed", transfer_id, "bad_request", str(exc)))
                return
            self._run(actions)

        self.loop.call_soon(on_loop)

    # -- side channel: connecting and handshakes (loop thread) ---------------------------

    def _hello(self, session: Session) -> Hello:
        assert self.agent is not None
        return Hello(
            identity=self.config.identity,
            mode=self.config.protocol.mode,
            role=self.config.role,
            agent_name=self.agent.name,
            agent_metadata=self._metadata,
            layout=self.kv.layout,
            nonce=session.nonce,
            lease_s=self.config.protocol.lease_s,
            registration_ttl_s=self.config.protocol.registration_ttl_s,
        )

    def _connect(self, peer: str) -> None:
        """Dial a producer off the loop thread, so an unreachable host never stalls it."""
        host, _, port = peer.rpartition(":")

        def dial() -> None:
            try:
                sock = connect(host, int(port), self.config.connect_timeout_s)
            except (KVPushError, ValueError) as exc:
                self.loop.call_soon(self._link_failed, peer, f"connect failed: {exc}")
                return
            self.loop.call_soon(self._attach, peer, sock, True)

        threading.Thread(target=dial, name=f"kvpush-dial-{peer}", daemon=True).start()

    def _accept(self, sock: Any) -> None:
        self._next_conn += 1
        self._attach(f"c{self._next_conn}", sock, False)

    def _attach(self, peer: str, sock: Any, outgoing: bool) -> None:
        if self._closed:
            sock.close()
            return
        session = Session(self.config.secret, initiator=outgoing)
        conn = Connection(self.loop, sock, self._on_frame, self._on_close, label=peer)
        link = self._links[peer] = _Link(peer, conn, session, outgoing)
        if outgoing:
            self._send(link, self._hello(session))

    def _on_frame(self, conn: Connection, frame: bytes) -> None:
        link = self._links.get(conn.label)
        if link is None or link.conn is not conn:
            return
        try:
            message = link.session.open(frame)
        except ProtocolError as exc:
            why = "auth" if type(exc).__name__ == "AuthError" else "malformed"
            self.metrics.inc("rejected_messages", why=why)
            log.warning("kvpush: rejected a message from %s: %s", link.peer, exc)
            if not link.ready:
                self._refuse(link, f"handshake message refused: {exc}")
            return
        if not link.ready:
            self._handshake(link, message)
            return
        now = time.monotonic()
        if link.outgoing:
            self._run(self.consumer.on_message(link.peer, message, now))
        else:
            self._run(self.producer.on_message(link.peer, message, now))

    def _handshake(self, link: _Link, message: Message) -> None:
        if isinstance(message, Reject):
            self._refuse(link, f"the peer refused to pair: {message.reason}", tell=False)
            return
        if not isinstance(message, Hello):
            self._refuse(link, f"expected a hello, got {type(message).__name__}")
            return
        mine = self._hello(link.session)
        problem = pairing_problem(mine, message)
        if problem is None:
            try:
                self._pair_nixl(link, message)
            except KVPushError as exc:
                problem = f"NIXL pairing failed: {exc}"
        if problem is not None:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, problem)
            return
        if not link.outgoing:
            self._send(link, mine)
        link.ready = True
        link.hello = message
        self.metrics.inc("handshakes", result="ok")
        now = time.monotonic()
        if link.outgoing:
            self._run(self.consumer.on_ready(link.peer, message, now))
        else:
            self._run(self.producer.on_ready(link.peer, message, now))

    def _pair_nixl(self, link: _Link, hello: Hello) -> None:
        assert self.agent is not None
        if hello.agent_name in self.agent.peers:
            # Already paired over another link (a kv_both peer dialled us too). Agent
            # names carry the boot epoch, so it is the same incarnation: share it, and
            # keep the other link's prepared descriptors valid.
            link.agent_peer = hello.agent_name
        else:
            link.agent_peer = self.agent.add_peer(hello.agent_metadata)
        link.split = pairing_split(self.kv.layout, hello.layout)
        link.remote_table = BlockTable(hello.layout, link.split)
        link.remote_list = self.agent.prepare(
            link.remote_table.rows, hello.layout.mem_type, link.agent_peer
        )
        self._local(link.split)
        if link.outgoing:
            self._agent_peers[link.agent_peer] = link.peer

    def _refuse(self, link: _Link, reason: str, tell: bool = True) -> None:
        log.warning("kvpush: handshake with %s failed: %s", link.peer, reason)
        if tell:
            with contextlib.suppress(KVPushError):
                self._send(link, Reject(reason[:1000]))
        link.conn.close(reason)

    def _send(self, link: _Link, message: Message) -> None:
        link.conn.send(link.session.seal(message))

    def _on_close(self, conn: Connection, reason: str) -> None:
        link = self._links.get(conn.label)
        if link is None or link.conn is not conn:
            return
        del self._links[link.peer]
        now = time.monotonic()
        shared = any(other.agent_peer == link.agent_peer for other in self._links.values())
        if link.agent_peer and not shared and not self._busy_with(link.agent_peer):
            self._forget_agent(link.agent_peer)
        if link.outgoing and not link.ready:
            self._run(self.consumer.on_handshake_failed(link.peer, reason, now))
        elif link.outgoing:
            self._run(self.consumer.on_peer_lost(link.peer, reason, now))
        elif link.ready:
            self._run(self.producer.on_peer_lost(link.peer, reason, now))

    def _link_failed(self, peer: str, reason: str) -> None:
        self.metrics.inc("handshakes", result="unreachable")
        self._run(self.consumer.on_handshake_failed(peer, reason, time.monotonic()))

    def _forget_agent(self, agent_peer: str) -> None:
        assert self.agent is not None
        self._agent_peers.pop(agent_peer, None)
        try:
            self.agent.remove_peer(agent_peer)
        except TransportError as exc:
            log.debug("kvpush: removing NIXL peer %s: %s", agent_peer, exc)

    def _busy_with(self, agent_peer: str) -> bool:
        flights = [*self._writes.values(), *self._reads.values()]
        return any(f.transfer.peer == agent_peer for f in flights)

    # -- actions (loop thread) ---------------------------------------------------------

    def _run(self, actions: list[act.Action]) -> None:
        for action in actions:
            try:
                self._do(action)
            except KVPushError as exc:
                log.error("kvpush: %s failed: %s", type(action).__name__, exc)
        self._reschedule()

    def _do(self, action: act.Action) -> None:
        now = time.monotonic()
        if isinstance(action, act.Send):
            link = self._links.get(action.peer)
            if link is not None and link.ready:
                self._send(link, action.message)
        elif isinstance(action, act.Connect):
            self._connect(action.peer)
        elif isinstance(action, act.PostWrite):
            self._post_write(action, now)
        elif isinstance(action, act.PostRead):
            self._post_read(action, now)
        elif isinstance(action, act.ExposeBlocks):
            # A READ copies whatever the memory holds: make it the finished KV first.
            self._wait_fences(action.transfer_id, len(self.kv.layout.layers))
            self.backends.stage(self.kv, action.block_ids, "to_host")
        elif isinstance(action, act.Delivered):
            self._delivered(action)
        elif isinstance(action, act.TransferFailed):
            self._expected.pop(action.transfer_id, None)
            self.metrics.inc("transfers_failed", reason=action.reason)
            self._publish(Outcome("failed", action.transfer_id, action.reason, action.detail))
        elif isinstance(action, act.ReleaseBlocks):
            self._fences.pop(action.transfer_id, None)
            self.metrics.inc("blocks_released", outcome=action.outcome)
            self._publish(Outcome("released", action.transfer_id, action.outcome))
        elif isinstance(action, act.Counted):
            self.metrics.inc(action.name, **action.labels)

    def _post_write(self, action: act.PostWrite, now: float) -> None:
        link = self._links.get(action.peer)
        try:
            if link is None or not link.ready:
                raise TransportError("WRITE", "the consumer's session is gone", action.peer)
            self._wait_fences(action.transfer_id, action.layers[1])
            self.backends.stage(self.kv, action.src_blocks, "to_host")
            self._post(self._writes, "WRITE", link, action.transfer_id, action.src_blocks,
                       action.dst_blocks, action.notif, now, action.layers)  # fmt: skip
        except KVPushError as exc:
            self._run(self.producer.on_write_done(action.transfer_id, False, now, str(exc)))
            return
        self._settle_if_finished(self._writes, action.transfer_id, self._write_finished)

    def _post_read(self, action: act.PostRead, now: float) -> None:
        link = self._links.get(action.peer)
        try:
            if link is None or not link.ready:
                raise TransportError("READ", "the producer's session is gone", action.peer)
            self._post(self._reads, "READ", link, action.transfer_id, action.local_blocks,
                       action.remote_blocks, b"", now)  # fmt: skip
        except KVPushError as exc:
            self._run(self.consumer.on_read_done(action.transfer_id, False, now, str(exc)))
            return
        self._settle_if_finished(self._reads, action.transfer_id, self._read_finished)

    def _post(
        self,
        table: dict[str, _InFlight],
        op: str,
        link: _Link,
        transfer_id: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes,
        now: float,
        layers: tuple[int, int] | None = None,
    ) -> None:
        assert self.agent is not None and link.remote_table and link.remote_list
        local_table, local_list = self._local(link.split)
        local_ids = local_table.ids(local_blocks, layers)
        remote_ids = link.remote_table.ids(remote_blocks, layers)
        nbytes = int(local_table.rows[local_ids, 1].sum())
        started = time.perf_counter()
        transfer = self.agent.post(
            op, local_list, local_ids, link.remote_list, remote_ids, notif, nbytes
        )
        self.metrics.observe("post_seconds", time.perf_counter() - started)
        deadline = now + self.config.protocol.write_grace_s
        table[transfer_id] = _InFlight(transfer, time.monotonic(), deadline, local_blocks)

    def _wait_fences(self, transfer_id: str, upto: int) -> None:
        """Wait on the fence of every layer the WRITE reads.

        Each, not just the latest: a backend's fence may cover only its own layer.
        """
        fences = self._fences.get(transfer_id, {})
        for layers in sorted(layers for layers in fences if layers <= upto):
            self.backends.wait_fence(self.kv, fences.pop(layers))

    def _local(self, split: bool) -> tuple[BlockTable, PreparedList]:
        if split not in self._local_tables:
            assert self.agent is not None
            table = BlockTable(self.kv.layout, split)
            self._local_tables[split] = (
                table,
                self.agent.prepare(table.rows, self.kv.layout.mem_type),
            )
        return self._local_tables[split]

    def _delivered(self, action: act.Delivered) -> None:
        blocks, started = self._expected.pop(action.transfer_id, ([], time.monotonic()))
        self.backends.stage(self.kv, blocks, "to_device")
        self.metrics.inc("transfers_delivered")
        self.metrics.observe("consumer_wait_seconds", time.monotonic() - started)
        if action.kv_ready_wall:
            self.metrics.observe(
                "done_to_ready_seconds", max(0.0, time.time() - action.kv_ready_wall)
            )
        self._publish(Outcome("delivered", action.transfer_id, nbytes=action.nbytes))

    def _publish(self, outcome: Outcome) -> None:
        with self._results_ready:
            self._results.append(outcome)
            self._results_ready.notify_all()

    # -- polling and timers (loop thread) --------------------------------------------------

    def pending(self) -> bool:
        # Also while a peer may be moving bytes into or out of our memory: some transports
        # (UCX over TCP) complete one-sided operations only when the target calls NIXL.
        return (
            bool(self._writes or self._reads)
            or self.consumer.awaiting_writes()
            or self.producer.awaiting_reads()
        )

    def poll(self) -> bool:
        assert self.agent is not None
        now = time.monotonic()
        progressed = self._check_transfers(self._writes, now, self._write_finished)
        progressed |= self._check_transfers(self._reads, now, self._read_finished)
        try:
            notifs = self.agent.notifs()
        except TransportError as exc:
            log.warning("kvpush: polling notifications: %s", exc)
            notifs = []
        for agent_peer, message in notifs:
            peer = self._agent_peers.get(agent_peer)
            if peer is None:
                self.metrics.inc("rejected_notifs", why="unknown_agent")
                continue
            self._run(self.consumer.on_notif(peer, message, now))
        return progressed or bool(notifs)

    def _settle_if_finished(self, table: dict[str, _InFlight], tid: str, finished: Any) -> None:
        """A transfer that completed inside its posting call ends now, not at the next poll."""
        flight = table.get(tid)
        if flight is not None and flight.transfer.finished:
            del table[tid]
            self._succeeded(tid, flight, time.monotonic(), finished)

    def _succeeded(self, tid: str, flight: _InFlight, now: float, finished: Any) -> None:
        assert self.agent is not None
        self.agent.release(flight.transfer)
        self.metrics.observe("transfer_seconds", now - flight.posted)
        self.metrics.inc("bytes_moved", flight.transfer.nbytes, op=flight.transfer.op)
        finished(tid, flight, True, "", now)

    def _check_transfers(self, table: dict[str, _InFlight], now: float, finished: Any) -> bool:
        assert self.agent is not None
        progressed = False
        for transfer_id, flight in list(table.items()):
            try:
                done = self.agent.done(flight.transfer)
            except TransportError as exc:
                del table[transfer_id]
                finished(transfer_id, flight, False, str(exc), now)
                progressed = True
                continue
            if done:
                del table[transfer_id]
                self._succeeded(transfer_id, flight, now, finished)
                progressed = True
            elif now > flight.deadline:
                del table[transfer_id]
                self._abandon(flight.transfer)
                finished(transfer_id, flight, False, "timed out", now)
                progressed = True
        return progressed

    def _abandon(self, transfer: Transfer) -> None:
        # Releasing an unfinished transfer asks NIXL to abort it.
        assert self.agent is not None
        try:
            self.agent.release(transfer)
        except TransportError as exc:
            log.warning("kvpush: aborting a stuck %s: %s", transfer.op, exc)

    def _write_finished(
        self, tid: str, flight: _InFlight, ok: bool, detail: str, now: float
    ) -> None:
        nbytes = flight.transfer.nbytes if ok else 0
        self._run(self.producer.on_write_done(tid, ok, now, detail, nbytes))

    def _read_finished(
        self, tid: str, flight: _InFlight, ok: bool, detail: str, now: float
    ) -> None:
        self._run(self.consumer.on_read_done(tid, ok, now, detail))

    def _reschedule(self) -> None:
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
        now = time.monotonic()
        self._run(self.producer.tick(now) + self.consumer.tick(now))
