"""The action interpreter: what the protocol machines ask for, carried out through ports.

The machines (kvpush.protocol) return actions; this module turns each into a call on
one of two ports — the links (side-channel messages, dialing) and the data path (NIXL
transfers, fences, staging) — or into an Outcome for the engine. What a data-path
transfer settles into goes back to the machine that asked for it, and the follow-up
actions run in turn. The Node wires real ports in; the protocol simulator in the unit
tests wires in its own, so both drive this same code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpush.protocol import actions as act
from kvpush.protocol.consumer import Consumer
from kvpush.protocol.messages import Message
from kvpush.protocol.producer import Producer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What the engine must act on: "delivered", "failed" (consumer) or "released";
    and what it may note: "chunk_sent" (producer, progressive push), and
    "release_refused" (producer: the router's release of KV a consumer wants, `reason`
    saying why it is kept)."""

    kind: str
    transfer_id: str
    reason: str = ""
    detail: str = ""
    nbytes: int = 0
    wall: float = 0.0  # when it happened (time.time)
    ready_wall: float = 0.0  # delivered: when the producer's last prompt step ended

    def said(self) -> str:
        """Why it ended, as a trace or a client reads it: the reason, and its detail
        where there is one."""
        return ": ".join(part for part in (self.reason, self.detail) if part)


@dataclass(frozen=True)
class Settled:
    """How one kvpush transfer's share of a NIXL transfer ended.

    `may_land` says the transfer was given up on unfinished: its bytes may still arrive.
    """

    op: str  # "WRITE" or "READ"
    transfer_id: str
    peer: str  # the link peer the transfer moved bytes to or from
    ok: bool
    detail: str = ""
    nbytes: int = 0
    may_land: bool = False


class LinkPort(Protocol):
    """The side channel, as the interpreter needs it."""

    def send(self, peer: str, message: Message) -> None: ...

    def connect(self, peer: str, engine: str = "", epoch: str = "") -> None: ...

    def disconnect(self, peer: str, reason: str) -> None: ...


class DataPort(Protocol):
    """The data path, as the interpreter needs it."""

    def post_writes(self, writes: list[act.PostWrite]) -> list[Settled]: ...

    def post_read(self, read: act.PostRead) -> list[Settled]: ...

    def expose(self, transfer_id: str, block_ids: list[int]) -> None: ...

    def landed(self, transfer_id: str) -> int: ...

    def drop_expected(self, transfer_id: str) -> None: ...

    def drop_fences(self, transfer_id: str) -> None: ...


class MetricsSink(Protocol):
    """Where counts go: kvpush.metrics.Metrics, or a test's recorder."""

    def inc(self, name: str, value: float = 1, **labels: str) -> None: ...

    def observe(self, name: str, seconds: float) -> None: ...


class Interpreter:
    """Carries out one Node's actions; never raises for a port's failure."""

    def __init__(
        self,
        producer: Producer,
        consumer: Consumer,
        links: LinkPort,
        data: DataPort,
        publish: Callable[[Outcome], None],
        metrics: MetricsSink,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.producer = producer
        self.consumer = consumer
        self.links = links
        self.data = data
        self.publish = publish
        self.metrics = metrics
        self.clock = clock
        self.wall = wall

    def run(self, actions: list[act.Action]) -> None:
        """Carry out `actions` in order; WRITEs go last and together, so a forward
        pass's hand-offs to one consumer share NIXL posts."""
        writes: list[act.PostWrite] = []
        unreadable: set[tuple[str, str]] = set()  # (transfer, peer): KV not exposed
        for action in actions:
            if isinstance(action, act.PostWrite):
                writes.append(action)
                continue
            if (
                isinstance(action, act.Send)
                and (_transfer_of(action.message), action.peer) in unreadable
            ):
                continue  # e.g. the Grant of KV that could not be staged
            try:
                self._do(action)
            except Exception as exc:  # a backend's bug must fail a transfer, not the loop
                log.error("kvpush: %s failed: %s", type(action).__name__, exc, exc_info=True)
                if isinstance(action, act.ExposeBlocks):
                    unreadable.add((action.transfer_id, action.peer))
                    detail = f"staging the KV for a READ failed: {exc}"
                    self.run(
                        self.producer.abandon(
                            action.transfer_id, action.peer, "write_failed", detail, self.clock()
                        )
                    )
        if writes:
            self.settle(self._post_writes(writes))

    def _post_writes(self, writes: list[act.PostWrite]) -> list[Settled]:
        try:
            return self.data.post_writes(writes)
        except Exception as exc:  # a bug below us: none of these may stay WRITING
            log.error("kvpush: posting %d WRITEs failed: %s", len(writes), exc, exc_info=True)
            detail = f"posting the WRITE failed: {exc}"
            # Some may have been posted before it raised: their bytes may still land.
            return [
                Settled("WRITE", w.transfer_id, w.peer, False, detail, may_land=True)
                for w in writes
            ]

    def settle(self, settled: list[Settled]) -> None:
        """Hand each ended transfer back to its machine; run the follow-ups together."""
        if not settled:
            return
        now = self.clock()
        actions: list[act.Action] = []
        for s in settled:
            if s.op == "WRITE":
                actions += self.producer.on_write_done(
                    s.transfer_id, s.peer, s.ok, now, s.detail, s.nbytes, s.may_land
                )
            else:
                actions += self.consumer.on_read_done(
                    s.transfer_id, s.peer, s.ok, now, s.detail, s.may_land
                )
        self.run(actions)

    def _do(self, action: act.Action) -> None:
        if isinstance(action, act.Send):
            self.links.send(action.peer, action.message)
        elif isinstance(action, act.Connect):
            self.links.connect(action.peer, action.engine, action.epoch)
        elif isinstance(action, act.Disconnect):
            self.links.disconnect(action.peer, action.reason)
        elif isinstance(action, act.PostRead):
            self.settle(self.data.post_read(action))
        elif isinstance(action, act.ExposeBlocks):
            self.data.expose(action.transfer_id, action.block_ids)
        elif isinstance(action, act.Delivered):
            self._delivered(action)
        elif isinstance(action, act.TransferFailed):
            self.data.drop_expected(action.transfer_id)
            self.metrics.inc("transfers_failed", reason=action.reason)
            self.report("failed", action.transfer_id, action.reason, action.detail)
        elif isinstance(action, act.ReleaseBlocks):
            self.data.drop_fences(action.transfer_id)
            self.metrics.inc("blocks_released", outcome=action.outcome)
            self.report("released", action.transfer_id, action.outcome, nbytes=action.nbytes)
        elif isinstance(action, act.ReleaseRefused):
            self.report("release_refused", action.transfer_id, action.why)
        elif isinstance(action, act.ChunkSent):
            self.metrics.inc("chunk_writes")
            self.report("chunk_sent", action.transfer_id, nbytes=action.nbytes)
        elif isinstance(action, act.Counted):
            self.metrics.inc(action.name, **action.labels)

    def _delivered(self, action: act.Delivered) -> None:
        try:
            nbytes = self.data.landed(action.transfer_id)
        except Exception as exc:  # the staging copy onto the device failed
            # The consumer machine has let the transfer go already: only this report
            # tells the engine, whose request would otherwise wait for it forever.
            log.error("kvpush: staging %s onto the device failed: %s", action.transfer_id, exc)
            self.metrics.inc("transfers_failed", reason="stage_failed")
            self.report("failed", action.transfer_id, "stage_failed", f"staging failed: {exc}")
            return
        self.metrics.inc("transfers_delivered")
        if action.kv_ready_wall:
            lag = max(0.0, self.wall() - action.kv_ready_wall)
            self.metrics.observe("done_to_ready_seconds", lag)
        self.report("delivered", action.transfer_id, nbytes=nbytes, ready_wall=action.kv_ready_wall)

    def report(
        self,
        kind: str,
        transfer_id: str,
        reason: str = "",
        detail: str = "",
        nbytes: int = 0,
        ready_wall: float = 0.0,
    ) -> None:
        """Hand the engine an Outcome, stamped with the time it happened."""
        self.publish(Outcome(kind, transfer_id, reason, detail, nbytes, self.wall(), ready_wall))


def _transfer_of(message: Any) -> str | None:
    return getattr(message, "transfer_id", None)
