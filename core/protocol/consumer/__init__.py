"""The consumer (decode) side of a transfer, as a state machine.

Every transfer the engine expects ends in exactly one Delivered or TransferFailed,
and a TransferFailed comes only once nothing can write into the transfer's blocks
any more: after the producer said so (Failed, CancelAck, Complete), or after the
longest time a WRITE it might have posted could still land. Until then the blocks
stay out of the engine's pool, so a retry can never receive an old transfer's bytes.

With tensor parallelism of different sizes on the two sides, one decode rank takes
its KV heads from several producer ranks: the transfer has a part per producer
(its records are keyed (transfer id, peer)). It is delivered once every part is;
a part that fails gives up the others, and the transfer fails once none can still
write into its blocks.

The parts and requests are kept in .records and .books; the machine's table, keyed
(state, event), in .moves. This module takes the events: the engine's, the
sessions', and the producer's messages and the timers, each handed to its handler
by a table.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from kvpush.errors import ProtocolError
from kvpush.layout import KVLayout
from kvpush.protocol.actions import Action, Counted
from kvpush.protocol.config import Machine, ProtocolConfig
from kvpush.protocol.consumer.books import Books
from kvpush.protocol.consumer.moves import (
    HEARTBEATING,
    PRODUCER_MAY_WRITE,
    TRANSITIONS,
    WRITES_MAY_LAND,
    Event,
    State,
)
from kvpush.protocol.consumer.records import Part, Source
from kvpush.protocol.consumer.sessions import Sessions
from kvpush.protocol.consumer.ways import PullWay, PushWay
from kvpush.protocol.handshake import unexpected_producer
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Complete,
    Failed,
    Grant,
    Heartbeat,
    Hello,
    Message,
    Writing,
)
from kvpush.protocol.timers import HEARTBEAT, Deadlines, Timer, arm_heartbeat

__all__ = ["TRANSITIONS", "Consumer", "Source", "State"]


class Consumer(Machine):
    """All transfers of one decode worker rank."""

    def __init__(
        self,
        config: ProtocolConfig,
        layout_digest: str,
        block_tokens: int | None = None,
        null_block: int = -1,
    ) -> None:
        super().__init__(config, block_tokens, null_block)
        self.layout_digest = layout_digest
        self.sessions = Sessions()
        self._peers = self.sessions.peers
        self._deadlines = Deadlines()
        self.books = Books(config, self._deadlines, self.sessions)
        self._transfers = self.books.parts  # (transfer id, producer peer) -> part
        self._requests = self.books.requests
        self._push, self._pull = PushWay(self), PullWay(self)
        self._on_timer: dict[Timer, Callable[[Any, float], list[Action]]] = {
            Timer.HEARTBEAT: lambda _, now: self._heartbeats(now),
            Timer.WATCHDOG: self._of_part(self._on_watchdog),
            Timer.LANDING: self._of_part(self._push.landing_due),
            Timer.SETTLE: self._of_part(self._on_settled),
        }
        self._on_message: dict[type[Message], Callable[[Part, Any, float], list[Action]]] = {
            Writing: self._on_writing,
            Complete: self._push.on_complete,
            Failed: self._on_failed,
            CancelAck: self._on_cancel_ack,
            Grant: self._pull.on_grant,
        }
        # What a part asks its producer for, chosen once by the mode: its blocks
        # written (push) or a READ granted (pull).
        self._ask = {"push": self._push, "pull": self._pull}[config.mode].ask

    # -- engine events ---------------------------------------------------------------

    def announce(
        self, transfer_id: str, peer: str, now: float, engine: str = "", epoch: str = ""
    ) -> list[Action]:
        """A request for `transfer_id` arrived; its blocks are not allocated yet. Its
        decode leg names the producer engine `engine` in boot `epoch` ("": any).

        Heartbeats for it start at once, so the producer keeps finished KV for it
        while this engine's queue drains.
        """
        if (transfer_id, peer) in self._transfers:
            return []
        self.books.add(Part(transfer_id, peer, engine=engine, epoch=epoch))
        actions = self.sessions.dial(peer, engine, epoch)
        if self.sessions.ready(peer):
            actions.append(self.sessions.send(peer, Heartbeat([transfer_id]), now))
        arm_heartbeat(self._deadlines, now, self.config.heartbeat_s)
        return actions

    def expect(
        self,
        transfer_id: str,
        sources: list[Source],
        blocks: list[int],
        now: float,
        skip_blocks: int = 0,
        engine: str = "",
    ) -> list[Action]:
        """Blocks are allocated for `transfer_id`: claim its KV for them from each of
        `sources` (the producer ranks holding our heads), which must be engine
        `engine` (when given) in their boots."""
        request = self._requests.get(transfer_id)
        if request is not None and request.blocks:
            raise ProtocolError(f"transfer {transfer_id!r} is already expected")
        if not sources:
            raise ProtocolError(f"transfer {transfer_id!r} names no producer")
        wanted = {source.peer for source in sources}
        for transfer in [t for t in self.books.of(transfer_id) if t.peer not in wanted]:
            self.books.forget(transfer)  # announced to a producer this claim does not name
        actions: list[Action] = []
        for source in sources:
            actions += self._expect_part(transfer_id, source, blocks, now, skip_blocks, engine)
        self._requests[transfer_id].blocks = True
        arm_heartbeat(self._deadlines, now, self.config.heartbeat_s)
        return actions

    def _expect_part(
        self,
        transfer_id: str,
        source: Source,
        blocks: list[int],
        now: float,
        skip_blocks: int,
        engine: str,
    ) -> list[Action]:
        peer = source.peer
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None:
            transfer = self.books.add(Part(transfer_id, peer))
        transfer.blocks = list(blocks)
        transfer.skip_blocks = skip_blocks
        transfer.engine = engine
        transfer.epoch = source.epoch
        transfer.parts = source.parts
        transfer.fire(Event.EXPECT)
        transfer.give_up_at = now + self.config.max_wait_s
        self._deadlines.set((Timer.WATCHDOG, transfer.key), now + self.config.watchdog_s)
        actions = self.sessions.dial(peer, engine, source.epoch)
        if self.sessions.ready(peer):
            actions += self._claim(transfer, now)
        return actions

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine gave the request up. Its blocks come back only once it is safe."""
        actions: list[Action] = []
        for transfer in self.books.of(transfer_id):
            actions += self.books.give_up(transfer, "aborted", now)
        return actions

    # -- session events --------------------------------------------------------------

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, now: float) -> list[Action]:
        """The handshake with the producer at `peer` (its KV laid out as `layout`)
        completed."""
        actions = self.sessions.opened(peer, hello, layout, now)
        waiting = [t for t in self._transfers.values() if t.peer == peer]
        announced = [t.transfer_id for t in waiting if t.state == State.ANNOUNCED]
        if announced:
            actions.append(self.sessions.send(peer, Heartbeat(announced), now))
        for transfer in waiting:
            if transfer.state == State.CONNECTING:
                actions += self._claim(transfer, now)
        return actions

    def on_handshake_failed(self, peer: str, reason: str, now: float) -> list[Action]:
        """The session to `peer` could not be set up; nothing was claimed there."""
        actions: list[Action] = []
        for transfer in self._drop_peer(peer):
            if transfer.state == State.CONNECTING:
                actions += self.books.fail(transfer, now, "handshake_failed", reason)
        return actions

    def on_peer_lost(
        self, peer: str, reason: str, now: float, by_peer: bool = False
    ) -> list[Action]:
        """The side channel to the producer closed: it died, or the network did.
        `by_peer`: the producer's end closed it (FIN or RST came), so it knows too."""
        settle = self.sessions.quiet_after_loss(
            peer, now, by_peer, self.config, self.books.landing_bound()
        )
        actions: list[Action] = []
        for transfer in self._drop_peer(peer):
            if transfer.state in (State.CONNECTING, State.REQUESTED, State.LANDING):
                actions += self.books.fail(transfer, now, "peer_lost", reason)
            elif transfer.state == State.READING:
                transfer.cancel_reason = transfer.cancel_reason or "peer_lost"
            elif transfer.state == State.REGISTERED:
                transfer.fire(Event.LOST)
                transfer.cancel_reason = "peer_lost"
                self._deadlines.cancel((Timer.WATCHDOG, transfer.key))
                self._deadlines.set((Timer.SETTLE, transfer.key), settle)
            elif transfer.state == State.CANCELLING:
                earlier = self._deadlines.get((Timer.SETTLE, transfer.key)) or float("inf")
                self._deadlines.set((Timer.SETTLE, transfer.key), min(earlier, settle))
        return actions

    def _drop_peer(self, peer: str) -> list[Part]:
        """Forget the session to `peer` and the transfers only announced to it; the
        others bound to it, for the caller to end as its event says."""
        self.sessions.drop(peer)
        bound = []
        for transfer in [t for t in self._transfers.values() if t.peer == peer]:
            if transfer.state == State.ANNOUNCED:
                self.books.forget(transfer)
            else:
                bound.append(transfer)
        return bound

    def on_message(self, peer: str, message: Message, now: float) -> list[Action]:
        if isinstance(message, Heartbeat):
            return self._on_heartbeat(peer, message, now)
        transfer_id = getattr(message, "transfer_id", None)
        transfer = self._transfers.get((transfer_id, peer)) if transfer_id else None
        if transfer is None:
            if (transfer_id, peer) in self.books.ended:
                return []  # e.g. the Complete after the notification already delivered
            return [Counted("rejected_messages", {"why": "unknown_transfer"})]
        handler = self._on_message.get(type(message))
        if handler is None:
            return [Counted("rejected_messages", {"why": f"unexpected_{type(message).__name__}"})]
        return handler(transfer, message, now)

    def _on_writing(self, transfer: Part, message: Writing, now: float) -> list[Action]:
        transfer.writing = True
        return []

    def _on_cancel_ack(self, transfer: Part, message: CancelAck, now: float) -> list[Action]:
        if transfer.state == State.READING:
            # The producer let go of what we are reading: the bytes cannot be trusted.
            transfer.cancel_reason = transfer.cancel_reason or "aborted"
            return []
        if transfer.state != State.CANCELLING:
            return [Counted("rejected_messages", {"why": "unexpected_cancel_ack"})]
        if message.may_land:
            return self.books.settle_later(transfer, transfer.cancel_reason or "aborted", now)
        return self.books.fail(transfer, now, transfer.cancel_reason or "aborted")

    def on_notif(self, peer: str, notif: bytes, now: float) -> list[Action]:
        """NIXL delivered the notification of a transfer's last WRITE.

        NIXL sends it only after that WRITE's bytes, and the producer posts each WRITE
        of a transfer after the previous one completed, so all the KV has landed: the
        transfer is delivered without waiting for the Complete message.
        """
        return self._push.on_notif(peer, notif, now)

    def on_read_done(
        self,
        transfer_id: str,
        peer: str,
        ok: bool,
        now: float,
        detail: str = "",
        may_land: bool = False,
    ) -> list[Action]:
        """Pull: our READ from `peer` finished (ok) or failed; `may_land`: it was given
        up on unfinished, and may still copy into our blocks for a while."""
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None or transfer.state != State.READING:
            return [Counted("unexpected_read_completion")]
        return self._pull.read_done(transfer, ok, now, detail, may_land)

    # -- time ------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for timer, key in self._deadlines.pop_expired(now):
            actions += self._on_timer[timer](key, now)
        return actions

    def _of_part(
        self, handler: Callable[[Part, float], list[Action]]
    ) -> Callable[[Any, float], list[Action]]:
        """`handler` for the part a deadline is keyed by, if it is still live."""

        def on_part(key: Any, now: float) -> list[Action]:
            part = self._transfers.get(key)
            return handler(part, now) if part is not None else []

        return on_part

    def _on_settled(self, transfer: Part, now: float) -> list[Action]:
        """No WRITE can land in a cancelled part's blocks any more."""
        if transfer.state != State.CANCELLING:
            return []
        return self.books.fail(transfer, now, transfer.cancel_reason or "aborted")

    def _landing_bound(self) -> float:
        return self.books.landing_bound()

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    def landing(self) -> bool:
        """True while a completed WRITE's notification is still to be polled for."""
        return any(t.state == State.LANDING for t in self._transfers.values())

    def awaiting_writes(self) -> bool:
        """True while a producer may be writing into our blocks, or its notification
        is due: from its Writing (or Complete) until the transfer ends.

        Over transports where the target must drive progress (UCX over TCP), the I/O
        layer keeps calling into NIXL meanwhile. Not before Writing: a decode holding
        requests whose prefill has not started would otherwise poll NIXL for nothing.
        """
        return any(
            t.state == State.LANDING or (t.writing and t.state in WRITES_MAY_LAND)
            for t in self._transfers.values()
        )

    # -- internals -------------------------------------------------------------------

    def _claim(self, transfer: Part, now: float) -> list[Action]:
        """Tell the producer what we want: destinations (push) or a read lease (pull)."""
        assert transfer.blocks is not None
        hello = self._peers[transfer.peer].hello
        assert hello is not None
        problem = unexpected_producer(hello, transfer.engine, transfer.epoch)
        if problem:
            # A stale route (the instance restarted, or another deployment's instance
            # now has that address): its KV is not this prompt's.
            return self.books.fail(transfer, now, "handshake_failed", problem)
        transfer.claimed_at = now
        return [self.sessions.send(transfer.peer, self._ask(transfer), now)]

    def _on_heartbeat(self, peer: str, message: Heartbeat, now: float) -> list[Action]:
        for transfer_id in message.transfer_ids:
            transfer = self._transfers.get((transfer_id, peer))
            if transfer is not None:
                deadline = min(now + self.config.watchdog_s, transfer.give_up_at)
                self._deadlines.extend((Timer.WATCHDOG, transfer.key), deadline)
        return []

    def _on_failed(self, transfer: Part, message: Failed, now: float) -> list[Action]:
        if transfer.state == State.READING:
            transfer.cancel_reason = message.reason  # our READ still runs; it ends it
            return []
        # Where our own cancel came first (the watchdog, an abort), that is why the
        # transfer ended; the producer's reason then only says how its side ended.
        reason = transfer.cancel_reason or message.reason
        if message.may_land and transfer.state in WRITES_MAY_LAND:
            # A WRITE the producer gave up on may still be landing in our blocks.
            return self.books.settle_later(transfer, reason, now)
        # The producer wrote nothing more after saying so: the blocks are ours again.
        return self.books.fail(transfer, now, reason, message.detail)

    def _on_watchdog(self, transfer: Part, now: float) -> list[Action]:
        if transfer.state == State.CONNECTING:
            cancel = self.sessions.cancel(
                transfer.peer, transfer.transfer_id, "watchdog_expired", now
            )  # if the session comes
            return cancel + self.books.fail(
                transfer, now, "watchdog_expired", "no session with the producer"
            )
        cancel = self.sessions.send(
            transfer.peer, Cancel(transfer.transfer_id, "watchdog_expired"), now
        )
        if transfer.state == State.REQUESTED:
            return [cancel] + self.books.fail(transfer, now, "watchdog_expired", "no grant in time")
        if transfer.state in PRODUCER_MAY_WRITE:
            return [cancel] + self.books.start_cancel(transfer, "watchdog_expired", now)
        return []

    def _heartbeats(self, now: float) -> list[Action]:
        wanted: dict[str, list[str]] = {}
        for transfer in self._transfers.values():
            if transfer.state in HEARTBEATING and self.sessions.ready(transfer.peer):
                wanted.setdefault(transfer.peer, []).append(transfer.transfer_id)
                if transfer.state == State.REGISTERED:
                    transfer.claimed_at = now
        if self._transfers:
            self._deadlines.set(HEARTBEAT, now + self.config.heartbeat_s)
        return [self.sessions.send(peer, Heartbeat(tids), now) for peer, tids in wanted.items()]

    # -- inspection ------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """How many transfer parts are in each state (states with none left out)."""
        return dict(collections.Counter(str(t.state) for t in self._transfers.values()))

    def waiting(self) -> list[str]:
        """Transfers with blocks that have not ended yet."""
        return sorted(tid for tid, request in self._requests.items() if request.blocks)

    def state_of(self, transfer_id: str, peer: str | None = None) -> State | None:
        """The state of the transfer's part from `peer` (None: its only part)."""
        parts = self.books.of(transfer_id)
        if peer is None:
            return parts[0].state if len(parts) == 1 else None
        transfer = self._transfers.get((transfer_id, peer))
        return transfer.state if transfer else None
