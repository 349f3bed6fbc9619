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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.device import DeviceKV
from kvpush.errors import KVPushError, ProtocolError, TransportError
from kvpush.layout import BlockTable, pairing_split
from kvpush.metrics import Metrics
from kvpush.plugins import Backends, get_backends
from kvpush.protocol import actions as act
from kvpush.protocol.auth import Session
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer
from kvpush.protocol.handshake import ROLES, pairing_problem
from kvpush.protocol.messages import (
    AgentMetadata,
    Hello,
    Identity,
    Message,
    Reject,
    Verify,
    join_notifs,
    split_notifs,
)
from kvpush.protocol.producer import Producer
from kvpush.transport.agent import AgentConfig, NixlAgent, PreparedList, Transfer
from kvpush.transport.channel import Connection, Listener, connect
from kvpush.transport.loop import Loop, TimerHandle

log = logging.getLogger(__name__)

# A batched WRITE's notification lists every transfer it ends: keep it small.
MAX_WRITES_PER_POST = 64


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
    wall: float = field(default_factory=time.time)  # when it happened


@dataclass
class _Link:
    """One side-channel connection and what pairing it with NIXL produced."""

    peer: str  # the machines' name for it: "host:port" outgoing, "c<n>" incoming
    conn: Connection
    session: Session
    outgoing: bool
    ready: bool = False
    hello: Hello | None = None
    # Handshake: "hello" (waiting for the peer's), then the initiator waits for
    # "verify" and both for "metadata"; ready once NIXL is paired.
    stage: str = "hello"
    agent_peer: str = ""
    split: bool = False
    remote_table: BlockTable | None = None
    remote_list: PreparedList | None = None


@dataclass(frozen=True)
class _Part:
    """One kvpush transfer's rows in a NIXL transfer."""

    transfer_id: str
    local_ids: np.ndarray
    remote_ids: np.ndarray
    nbytes: int
    notif: bytes


@dataclass
class _InFlight:
    """One NIXL transfer and the kvpush transfers it carries, with their bytes.

    A READ carries one; a WRITE carries every transfer one hand-off made ready for
    the same consumer (a forward pass's batch), so a layer costs one post, not one
    per request.
    """

    transfer: Transfer
    posted: float
    deadline: float
    parts: list[tuple[str, int]]


# Turns a settled NIXL transfer into the protocol machines' follow-up actions; the
# keyword may_land says it was given up on unfinished.
Finisher = Callable[..., list[act.Action]]


class Node:
    """One worker rank's kvpush: producer, consumer, or both."""

    def __init__(
        self,
        config: NodeConfig,
        kv: DeviceKV,
        backends: Backends | None = None,
        metrics: Metrics | None = None,
        on_outcome: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        # Called on the loop thread after each outcome is queued: must not block.
        self._on_outcome = on_outcome
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
        self._writes: list[_InFlight] = []
        self._reads: list[_InFlight] = []
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
        self,
        transfer_id: str,
        producer: str,
        block_ids: Sequence[int],
        skip_blocks: int = 0,
        engine: str = "",
        epoch: str = "",
    ) -> None:
        """Consumer: these blocks wait for `transfer_id`'s KV from `producer` (host:port),
        which must be engine `engine` in boot `epoch` when given."""
        blocks = [int(b) for b in block_ids]

        def run(now: float) -> list[act.Action]:
            self._expected[transfer_id] = (blocks, now)
            self.metrics.inc("transfers_started", role="consumer")
            return self.consumer.expect(
                transfer_id, producer, blocks, now, skip_blocks, engine, epoch
            )

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
            actions: list[act.Action] = []
            for transfer_id, blocks in batch:
                if transfer_id not in self._fences:
                    self.metrics.inc("transfers_started", role="producer")
                    self._fences[transfer_id] = {}
                if fence is not None:
                    self._fences[transfer_id][upto] = fence
                actions += self.producer.kv_ready(transfer_id, blocks, now, wall, upto)
                if not self.producer.tracks(transfer_id):
                    # It ended (released, aborted): no WRITE will wait on these fences.
                    self._fences.pop(transfer_id, None)
            self._run(actions)  # together, so their WRITEs share NIXL posts

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
                "fences_held": len(self._fences),
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
        session = Session(self.config.secret, initiator=outgoing, nonce=os.urandom(16))
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
        """Hellos first; NIXL metadata (which opens our memory to the peer) only once
        the peer has proved, under this session's keys, that it holds the secret:

            initiator -> acceptor   Hello
            acceptor  -> initiator  Hello, Verify
            initiator -> acceptor   AgentMetadata
            acceptor  -> initiator  AgentMetadata
        """
        if isinstance(message, Reject):
            self._refuse(link, f"the peer refused to pair: {message.reason}", tell=False)
            return
        expected = {"hello": Hello, "verify": Verify, "metadata": AgentMetadata}[link.stage]
        if not isinstance(message, expected):
            got = type(message).__name__
            self._refuse(link, f"expected {expected.__name__} in the handshake, got {got}")
            return
        if isinstance(message, Hello):
            self._on_hello(link, message)
        elif isinstance(message, Verify):
            link.stage = "metadata"
            self._send(link, AgentMetadata(self._metadata))
        else:
            self._on_metadata(link, message)

    def _on_hello(self, link: _Link, hello: Hello) -> None:
        mine = self._hello(link.session)
        problem = pairing_problem(mine, hello)
        if problem is not None:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, problem)
            return
        link.hello = hello
        if link.outgoing:
            link.stage = "verify"
            return
        self._send(link, mine)
        self._send(link, Verify())
        link.stage = "metadata"

    def _on_metadata(self, link: _Link, message: AgentMetadata) -> None:
        assert link.hello is not None
        try:
            self._pair_nixl(link, link.hello, message.metadata)
        except KVPushError as exc:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, f"NIXL pairing failed: {exc}")
            return
        if not link.outgoing:
            self._send(link, AgentMetadata(self._metadata))
        link.ready = True
        self.metrics.inc("handshakes", result="ok")
        now = time.monotonic()
        if link.outgoing:
            self._run(self.consumer.on_ready(link.peer, link.hello, now))
        else:
            self._run(self.producer.on_ready(link.peer, link.hello, now))

    def _pair_nixl(self, link: _Link, hello: Hello, metadata: bytes) -> None:
        assert self.agent is not None
        if hello.agent_name in self.agent.peers:
            # Already paired over another link (a kv_both peer dialled us too). Agent
            # names carry the boot epoch, so it is the same incarnation: share it, and
            # keep the other link's prepared descriptors valid.
            link.agent_peer = hello.agent_name
        else:
            link.agent_peer = self.agent.add_peer(metadata)
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
        flights = [*self._writes, *self._reads]
        return any(f.transfer.peer == agent_peer for f in flights)

    # -- actions (loop thread) ---------------------------------------------------------

    def _run(self, actions: list[act.Action]) -> None:
        writes: list[act.PostWrite] = []
        unreadable: set[str] = set()  # transfers whose KV could not be exposed
        for action in actions:
            if isinstance(action, act.PostWrite):
                writes.append(action)  # posted last, together
                continue
            if isinstance(action, act.Send) and _transfer_of(action.message) in unreadable:
                continue  # e.g. the Grant of KV that could not be staged
            try:
                self._do(action)
            except Exception as exc:  # a backend's bug must fail a transfer, not the loop
                log.error("kvpush: %s failed: %s", type(action).__name__, exc, exc_info=True)
                if isinstance(action, act.ExposeBlocks):
                    unreadable.add(action.transfer_id)
                    detail = f"staging the KV for a READ failed: {exc}"
                    now = time.monotonic()
                    self._run(
                        self.producer.abandon(action.transfer_id, "write_failed", detail, now)
                    )
        if writes:
            self._post_writes(writes)
        self._reschedule()

    def _do(self, action: act.Action) -> None:
        now = time.monotonic()
        if isinstance(action, act.Send):
            link = self._links.get(action.peer)
            if link is not None and link.ready:
                self._send(link, action.message)
        elif isinstance(action, act.Connect):
            self._connect(action.peer)
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
            self._publish(
                Outcome("released", action.transfer_id, action.outcome, nbytes=action.nbytes)
            )
        elif isinstance(action, act.Counted):
            self.metrics.inc(action.name, **action.labels)

    def _post_writes(self, writes: list[act.PostWrite]) -> None:
        """Post WRITEs: one NIXL transfer per consumer for all of them (up to a cap)."""
        now = time.monotonic()
        by_peer: dict[str, list[act.PostWrite]] = {}
        for write in writes:
            by_peer.setdefault(write.peer, []).append(write)
        actions: list[act.Action] = []
        for peer, group in by_peer.items():
            for start in range(0, len(group), MAX_WRITES_PER_POST):
                actions += self._post_write_group(
                    peer, group[start : start + MAX_WRITES_PER_POST], now
                )
        if actions:
            self._run(actions)

    def _post_write_group(
        self, peer: str, group: list[act.PostWrite], now: float
    ) -> list[act.Action]:
        """Fence and stage each WRITE's source, then post them as one; a WRITE that
        cannot go fails alone, the rest still go."""
        link = self._links.get(peer)
        actions: list[act.Action] = []
        parts: list[_Part] = []
        for write in group:
            try:
                if link is None or not link.ready:
                    raise TransportError("WRITE", "the consumer's session is gone", peer)
                self._wait_fences(write.transfer_id, write.layers[1])
                self.backends.stage(self.kv, write.src_blocks, "to_host")
                parts.append(self._part(link, write.transfer_id, write.src_blocks,
                                        write.dst_blocks, write.layers, write.notif))  # fmt: skip
            except Exception as exc:  # fencing, staging or descriptors: nothing was posted
                if not isinstance(exc, KVPushError):
                    log.error("kvpush: preparing a WRITE failed", exc_info=True)
                actions += self.producer.on_write_done(write.transfer_id, False, now, str(exc))
        if not parts:
            return actions
        assert link is not None
        try:
            flight = self._post(self._writes, "WRITE", link, parts, now)
        except Exception as exc:  # NIXL refused the post: nothing is in flight
            for part in parts:
                actions += self.producer.on_write_done(part.transfer_id, False, now, str(exc))
            return actions
        return actions + self._settle_if_finished(self._writes, flight, self._write_finished)

    def _post_read(self, action: act.PostRead, now: float) -> None:
        link = self._links.get(action.peer)
        try:
            if link is None or not link.ready:
                raise TransportError("READ", "the producer's session is gone", action.peer)
            part = self._part(link, action.transfer_id, action.local_blocks,
                              action.remote_blocks, None, b"")  # fmt: skip
            flight = self._post(self._reads, "READ", link, [part], now)
        except Exception as exc:  # nothing was posted
            self._run(self.consumer.on_read_done(action.transfer_id, False, now, str(exc)))
            return
        self._run(self._settle_if_finished(self._reads, flight, self._read_finished))

    def _part(
        self,
        link: _Link,
        transfer_id: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        layers: tuple[int, int] | None,
        notif: bytes,
    ) -> _Part:
        """One transfer's share of a NIXL transfer: its rows on both sides."""
        assert link.remote_table is not None
        local_table, _ = self._local(link.split)
        local_ids = local_table.ids(local_blocks, layers)
        remote_ids = link.remote_table.ids(remote_blocks, layers)
        nbytes = int(local_table.rows[local_ids, 1].sum())
        return _Part(transfer_id, local_ids, remote_ids, nbytes, notif)

    def _post(
        self, table: list[_InFlight], op: str, link: _Link, parts: list[_Part], now: float
    ) -> _InFlight:
        assert self.agent is not None and link.remote_list is not None
        _, local_list = self._local(link.split)
        local_ids = np.concatenate([part.local_ids for part in parts])
        remote_ids = np.concatenate([part.remote_ids for part in parts])
        notif = join_notifs([part.notif for part in parts if part.notif])
        nbytes = sum(part.nbytes for part in parts)
        started = time.perf_counter()
        transfer = self.agent.post(
            op, local_list, local_ids, link.remote_list, remote_ids, notif, nbytes
        )
        self.metrics.observe("post_seconds", time.perf_counter() - started)
        deadline = now + self.config.protocol.write_grace_s
        sizes = [(part.transfer_id, part.nbytes) for part in parts]
        flight = _InFlight(transfer, time.monotonic(), deadline, sizes)
        table.append(flight)
        return flight

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
        # Counted from our own layout: the notification that delivers a push transfer
        # often beats the Complete message that carries the producer's count.
        table, _ = self._local(False)
        nbytes = int(table.rows[table.ids(blocks), 1].sum()) if blocks else 0
        self._publish(Outcome("delivered", action.transfer_id, nbytes=nbytes))

    def _publish(self, outcome: Outcome) -> None:
        with self._results_ready:
            self._results.append(outcome)
            self._results_ready.notify_all()
        if self._on_outcome is not None:
            self._on_outcome()

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
            actions: list[act.Action] = []
            for notif in split_notifs(message):
                actions += self.consumer.on_notif(peer, notif, now)
            self._run(actions)
        return progressed or bool(notifs)

    def _settle_if_finished(
        self, table: list[_InFlight], flight: _InFlight, finished: Finisher
    ) -> list[act.Action]:
        """A transfer that completed inside its posting call ends now, not at the next poll."""
        if not flight.transfer.finished:
            return []
        table.remove(flight)
        return self._succeeded(flight, time.monotonic(), finished)

    def _succeeded(self, flight: _InFlight, now: float, finished: Finisher) -> list[act.Action]:
        assert self.agent is not None
        self.agent.release(flight.transfer)
        self.metrics.observe("transfer_seconds", now - flight.posted)
        self.metrics.inc("bytes_moved", flight.transfer.nbytes, op=flight.transfer.op)
        return finished(flight, True, "", now)

    def _check_transfers(self, table: list[_InFlight], now: float, finished: Finisher) -> bool:
        """Settle every finished, failed or overdue transfer; their follow-ups run together."""
        assert self.agent is not None
        actions: list[act.Action] = []
        progressed = False
        for flight in list(table):
            try:
                done = self.agent.done(flight.transfer)
            except TransportError as exc:
                table.remove(flight)
                actions += finished(flight, False, str(exc), now)
                progressed = True
                continue
            if done:
                table.remove(flight)
                actions += self._succeeded(flight, now, finished)
                progressed = True
            elif now > flight.deadline:
                table.remove(flight)
                self._abandon(flight.transfer)
                actions += finished(flight, False, "timed out", now, may_land=True)
                progressed = True
        if progressed:
            self._run(actions)
        return progressed

    def _abandon(self, transfer: Transfer) -> None:
        # Releasing an unfinished transfer asks NIXL to abort it.
        assert self.agent is not None
        try:
            self.agent.release(transfer)
        except TransportError as exc:
            log.warning("kvpush: aborting a stuck %s: %s", transfer.op, exc)

    def _write_finished(
        self, flight: _InFlight, ok: bool, detail: str, now: float, may_land: bool = False
    ) -> list[act.Action]:
        actions: list[act.Action] = []
        for transfer_id, nbytes in flight.parts:
            actions += self.producer.on_write_done(
                transfer_id, ok, now, detail, nbytes if ok else 0, may_land
            )
        return actions

    def _read_finished(
        self, flight: _InFlight, ok: bool, detail: str, now: float, may_land: bool = False
    ) -> list[act.Action]:

        actions: list[act.Action] = []
        for transfer_id, _ in flight.parts:
            actions += self.consumer.on_read_done(transfer_id, ok, now, detail, may_land)
        return actions

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


def _transfer_of(message: Any) -> str | None:
    return getattr(message, "transfer_id", None)
