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

One module, past 550 lines, because it is one machine: every handler next to the
moves it makes, so that each state's ways out can be read in one place (the
TRANSITIONS table is the index).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from kvpush.errors import ProtocolError
from kvpush.layout import KVLayout, moving_pairs, page_factors, to_pages
from kvpush.protocol.actions import (
    Action,
    Connect,
    Counted,
    Delivered,
    PostRead,
    Send,
    TransferFailed,
)
from kvpush.protocol.config import ProtocolConfig
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
    PullRequest,
    Register,
    Release,
    Writing,
    decode_notif,
)
from kvpush.protocol.states import TransitionTable
from kvpush.protocol.timers import HEARTBEAT, Deadlines, arm_heartbeat

# Ended transfers remembered so their late messages are not counted as strays.
_ENDED_MEMORY = 4096

# A part's key: (transfer id, the producer peer it takes its KV from).
Key = tuple[str, str]


class State(enum.StrEnum):
    """A transfer on the decode side."""

    ANNOUNCED = "announced"  # the request arrived; its blocks are not allocated yet
    CONNECTING = "connecting"  # blocks allocated; the session to the producer is not up
    REGISTERED = "registered"  # push: our blocks are the producer's to write into
    LANDING = "landing"  # push: the producer is done; NIXL's notification is due
    REQUESTED = "requested"  # pull: a read grant asked for
    READING = "reading"  # pull: our READ is in flight
    CANCELLING = "cancelling"  # ended, but a WRITE may still land: the blocks are held
    ENDED = "ended"  # delivered or failed (and forgotten)


# Every move a transfer may make; any other is a bug, refused loudly.
TRANSITIONS = TransitionTable(
    "consumer",
    {
        State.ANNOUNCED: {State.CONNECTING, State.ENDED},
        State.CONNECTING: {State.REGISTERED, State.REQUESTED, State.ENDED},
        State.REGISTERED: {State.LANDING, State.CANCELLING, State.ENDED},
        State.LANDING: {State.CANCELLING, State.ENDED},
        State.REQUESTED: {State.READING, State.ENDED},
        State.READING: {State.CANCELLING, State.ENDED},
        State.CANCELLING: {State.CANCELLING, State.ENDED},
        State.ENDED: set(),
    },
)

# States in which the producer may hold our blocks and write into them.
_PRODUCER_MAY_WRITE = (State.REGISTERED,)
# States whose heartbeats keep the producer's hold on the transfer alive.
_HEARTBEATING = (State.ANNOUNCED, State.REGISTERED, State.REQUESTED, State.READING)
# States in which a WRITE the producer posted may still land in our blocks.
_WRITES_MAY_LAND = (State.REGISTERED, State.LANDING, State.CANCELLING)


@dataclass
class _Peer:
    state: str  # connecting | ready
    hello: Hello | None = None
    layout: KVLayout | None = None


@dataclass(frozen=True)
class Source:
    """A producer rank a transfer takes KV from: its side channel `peer`, its boot
    `epoch` as the decode leg names it ("": any), and how many consumer ranks claim
    the transfer from it (`parts`; more than one when it holds KV heads several
    consumer ranks hold)."""

    peer: str
    epoch: str = ""
    parts: int = 1


@dataclass
class _Request:
    """A transfer as the engine sees it: its parts, and how they ended so far."""

    keys: set[Key]
    blocks: bool = False  # the engine allocated blocks (an outcome is owed)
    reason: str = ""  # the first part's failure
    detail: str = ""
    kv_ready_wall: float = 0.0


@dataclass
class _Transfer:
    transfer_id: str
    peer: str
    blocks: list[int] | None = None
    skip_blocks: int = 0
    engine: str = ""  # the producer engine the decode leg names ("": any)
    epoch: str = ""  # and that engine's boot ("": any)
    state: State = State.ANNOUNCED
    claimed_at: float = 0.0  # last Register/Heartbeat that extended the producer's hold
    give_up_at: float = 0.0  # max_wait_s after the blocks were allocated
    read_deadline: float = 0.0
    notified: bool = False
    writing: bool = False  # push: the producer said Writing
    kv_ready_wall: float = 0.0
    complete: Complete | None = None
    cancel_reason: str | None = None
    parts: int = 1  # consumer ranks claiming the transfer from this producer


def _key(transfer: _Transfer) -> Key:
    return (transfer.transfer_id, transfer.peer)


class Consumer:
    """All transfers of one decode worker rank."""

    def __init__(
        self,
        config: ProtocolConfig,
        layout_digest: str,
        block_tokens: int | None = None,
        null_block: int = -1,
    ) -> None:
        self.config = config
        self.layout_digest = layout_digest
        # Tokens per block of our KV cache (None: as every peer's, as in models of one).
        self.block_tokens = block_tokens
        self.null_block = null_block  # our layout's (kvpush.layout.moving_pairs)
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[Key, _Transfer] = {}
        self._requests: dict[str, _Request] = {}
        self._ended: dict[Key, None] = {}  # insertion-ordered, bounded
        # Peer whose session is still coming -> (transfer id, reason) to cancel there.
        self._held_cancels: dict[str, list[tuple[str, str]]] = {}
        self._last_sent: dict[str, float] = {}  # peer -> when we last sent it anything
        self._deadlines = Deadlines()

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
        self._add(_Transfer(transfer_id, peer, engine=engine, epoch=epoch))
        actions = self._ensure_session(peer, engine, epoch)
        if self._ready(peer):
            actions.append(self._send(peer, Heartbeat([transfer_id]), now))
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
        for transfer in [t for t in self._parts(transfer_id) if t.peer not in wanted]:
            self._forget(transfer)  # announced to a producer this claim does not name
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
            transfer = self._add(_Transfer(transfer_id, peer))
        transfer.blocks = list(blocks)
        transfer.skip_blocks = skip_blocks
        transfer.engine = engine
        transfer.epoch = source.epoch
        transfer.parts = source.parts
        TRANSITIONS.move(transfer, State.CONNECTING)
        transfer.give_up_at = now + self.config.max_wait_s
        self._deadlines.set(("watchdog", _key(transfer)), now + self.config.watchdog_s)
        actions = self._ensure_session(peer, engine, source.epoch)
        if self._ready(peer):
            actions += self._claim(transfer, now)
        return actions

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine gave the request up. Its blocks come back only once it is safe."""
        actions: list[Action] = []
        for transfer in self._parts(transfer_id):
            actions += self._give_up(transfer, "aborted", now)
        return actions

    def _give_up(self, transfer: _Transfer, reason: str, now: float) -> list[Action]:
        """End one part for `reason` (the engine aborted, or another part failed),
        as soon as nothing can write into its blocks any more."""
        if transfer.state == State.CANCELLING:
            return []
        if transfer.state == State.READING:
            transfer.cancel_reason = transfer.cancel_reason or reason  # our own READ ends it
            return []
        cancel = self._cancel(transfer, reason, now)
        if transfer.state == State.ANNOUNCED:
            self._forget(transfer)
            return cancel
        if transfer.state in (State.CONNECTING, State.LANDING, State.REQUESTED):
            # Nobody else writes into these blocks (not claimed yet, already written,
            # or pull, where only our own READ would).
            return cancel + self._fail(transfer, now, reason)
        return cancel + self._start_cancel(transfer, reason, now)

    def _cancel(self, transfer: _Transfer, reason: str, now: float) -> list[Action]:
        """Tell the producer we give the transfer up: now, or once the session to it is
        up. The producer may hold KV for it already, computed or on its way, and with
        no claim or announcement from us it would keep it for its whole lease."""
        if self._ready(transfer.peer):
            return [self._send(transfer.peer, Cancel(transfer.transfer_id, reason), now)]
        if transfer.peer in self._peers:  # the session is coming: on_ready sends it
            self._held_cancels.setdefault(transfer.peer, []).append((transfer.transfer_id, reason))
        return []

    # -- session events --------------------------------------------------------------

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, now: float) -> list[Action]:
        """The handshake with the producer at `peer` (its KV laid out as `layout`)
        completed."""
        self._peers[peer] = _Peer("ready", hello, layout)
        actions: list[Action] = [
            self._send(peer, Cancel(tid, reason), now)
            for tid, reason in self._held_cancels.pop(peer, ())
        ]
        waiting = [t for t in self._transfers.values() if t.peer == peer]
        announced = [t.transfer_id for t in waiting if t.state == State.ANNOUNCED]
        if announced:
            actions.append(self._send(peer, Heartbeat(announced), now))
        for transfer in waiting:
            if transfer.state == State.CONNECTING:
                actions += self._claim(transfer, now)
        return actions

    def on_handshake_failed(self, peer: str, reason: str, now: float) -> list[Action]:
        """The session to `peer` could not be set up; nothing was claimed there."""
        actions: list[Action] = []
        for transfer in self._drop_peer(peer):
            if transfer.state == State.CONNECTING:
                actions += self._fail(transfer, now, "handshake_failed", reason)
        return actions

    def on_peer_lost(
        self, peer: str, reason: str, now: float, by_peer: bool = False
    ) -> list[Action]:
        """The side channel to the producer closed: it died, or the network did.
        `by_peer`: the producer's end closed it (FIN or RST came), so it knows too."""
        hello = self._peers[peer].hello if peer in self._peers else None
        settle = self._quiet_after_loss(peer, hello, now, by_peer)
        actions: list[Action] = []
        for transfer in self._drop_peer(peer):
            if transfer.state in (State.CONNECTING, State.REQUESTED, State.LANDING):
                actions += self._fail(transfer, now, "peer_lost", reason)
            elif transfer.state == State.READING:
                transfer.cancel_reason = transfer.cancel_reason or "peer_lost"
            elif transfer.state == State.REGISTERED:
                TRANSITIONS.move(transfer, State.CANCELLING)
                transfer.cancel_reason = "peer_lost"
                self._deadlines.cancel(("watchdog", _key(transfer)))
                self._deadlines.set(("settle", _key(transfer)), settle)
            elif transfer.state == State.CANCELLING:
                earlier = self._deadlines.get(("settle", _key(transfer))) or float("inf")
                self._deadlines.set(("settle", _key(transfer)), min(earlier, settle))
        return actions

    def _quiet_after_loss(self, peer: str, hello: Hello | None, now: float, by_peer: bool) -> float:
        """When nothing the producer at `peer` posted can land in our blocks any more,
        after we lost the link to it.

        If its end closed the link, it stopped posting then: a WRITE posted just
        before lands within the landing bound. If only our end saw the link break,
        it may not know yet, and keeps writing until its silence rule (or, for a
        producer without one, its registration's end) counts from the last thing
        we sent it.
        """
        if by_peer:
            return now + self._landing_bound()
        last = self._last_sent.get(peer, now)
        hold = self.config.registration_ttl_s
        if hello is not None:
            hold = hello.silence_s or hello.registration_ttl_s
        return max(now, last + hold) + self._landing_bound()

    def _drop_peer(self, peer: str) -> list[_Transfer]:
        """Forget the session to `peer` and the transfers only announced to it; the
        others bound to it, for the caller to end as its event says."""
        self._peers.pop(peer, None)
        self._held_cancels.pop(peer, None)
        self._last_sent.pop(peer, None)
        bound = []
        for transfer in [t for t in self._transfers.values() if t.peer == peer]:
            if transfer.state == State.ANNOUNCED:
                self._forget(transfer)
            else:
                bound.append(transfer)
        return bound

    def on_message(self, peer: str, message: Message, now: float) -> list[Action]:
        transfer_id = getattr(message, "transfer_id", None)
        transfer = self._transfers.get((transfer_id, peer)) if transfer_id else None
        if isinstance(message, Heartbeat):
            return self._on_heartbeat(peer, message, now)
        if transfer is None:
            if (transfer_id, peer) in self._ended:
                return []  # e.g. the Complete after the notification already delivered
            return [Counted("rejected_messages", {"why": "unknown_transfer"})]
        if isinstance(message, Writing):
            transfer.writing = True
            return []
        if isinstance(message, Complete):
            return self._on_complete(transfer, message, now)
        if isinstance(message, Failed):
            return self._on_failed(transfer, message, now)
        if isinstance(message, CancelAck):
            if transfer.state == State.READING:
                # The producer let go of what we are reading: the bytes cannot be trusted.
                transfer.cancel_reason = transfer.cancel_reason or "aborted"
                return []
            if transfer.state != State.CANCELLING:
                return [Counted("rejected_messages", {"why": "unexpected_cancel_ack"})]
            if message.may_land:
                return self._settle_later(transfer, transfer.cancel_reason or "aborted", now)
            return self._fail(transfer, now, transfer.cancel_reason or "aborted")
        if isinstance(message, Grant):
            return self._on_grant(transfer, message, now)
        return [Counted("rejected_messages", {"why": f"unexpected_{type(message).__name__}"})]

    def on_notif(self, peer: str, notif: bytes, now: float) -> list[Action]:
        """NIXL delivered the notification of a transfer's last WRITE.

        NIXL sends it only after that WRITE's bytes, and the producer posts each WRITE
        of a transfer after the previous one completed, so all the KV has landed: the
        transfer is delivered without waiting for the Complete message.
        """
        decoded = decode_notif(notif)
        if decoded is None:
            return [Counted("rejected_notifs", {"why": "foreign"})]
        transfer_id, wall = decoded
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None:
            why = "late" if (transfer_id, peer) in self._ended else "unknown_transfer"
            return [Counted("rejected_notifs", {"why": why})]
        transfer.notified = True
        transfer.kv_ready_wall = wall
        if transfer.state in (State.REGISTERED, State.LANDING):
            return self._deliver(transfer)
        if transfer.state == State.CANCELLING:
            # The last WRITE landed: nothing more will be written into these blocks.
            return self._fail(transfer, now, transfer.cancel_reason or "aborted")
        return []

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
        actions: list[Action] = []
        if self._ready(transfer.peer):
            actions.append(self._send(transfer.peer, Release(transfer_id), now))
        if not ok and may_land:
            return actions + self._settle_later(
                transfer, transfer.cancel_reason or "read_failed", now
            )
        if transfer.cancel_reason:
            return actions + self._fail(transfer, now, transfer.cancel_reason)
        if not ok:
            return actions + self._fail(transfer, now, "read_failed", detail)
        if now > transfer.read_deadline:
            detail = "the read outlasted its lease"
            return actions + self._fail(transfer, now, "lease_expired", detail)
        return actions + self._deliver(transfer)

    # -- time ------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for kind, key in self._deadlines.pop_expired(now):
            if kind == "heartbeat":
                actions += self._heartbeats(now)
                continue
            transfer = self._transfers.get(key)
            if transfer is None:
                continue
            if kind == "watchdog":
                actions += self._on_watchdog(transfer, now)
            elif kind == "landing" and transfer.state == State.LANDING:
                detail = "the producer completed but NIXL's notification never came"
                actions += self._fail(transfer, now, "write_failed", detail)
            elif kind == "settle" and transfer.state == State.CANCELLING:
                actions += self._fail(transfer, now, transfer.cancel_reason or "aborted")
        return actions

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
            t.state == State.LANDING or (t.writing and t.state in _WRITES_MAY_LAND)
            for t in self._transfers.values()
        )

    # -- internals -------------------------------------------------------------------

    def _ready(self, peer: str) -> bool:
        record = self._peers.get(peer)
        return record is not None and record.state == "ready"

    def _ensure_session(self, peer: str, engine: str, epoch: str) -> list[Action]:
        """Dial `peer` unless a session to it exists or is coming; only a producer
        that is `engine` in `epoch` (as the transfer that dials it names) gets our
        NIXL metadata."""
        if peer in self._peers:
            return []
        self._peers[peer] = _Peer("connecting")
        return [Connect(peer, engine, epoch)]

    def _claim(self, transfer: _Transfer, now: float) -> list[Action]:
        """Tell the producer what we want: destinations (push) or a read lease (pull)."""
        assert transfer.blocks is not None
        hello = self._peers[transfer.peer].hello
        assert hello is not None
        problem = unexpected_producer(hello, transfer.engine, transfer.epoch)
        if problem:
            # A stale route (the instance restarted, or another deployment's instance
            # now has that address): its KV is not this prompt's.
            return self._fail(transfer, now, "handshake_failed", problem)
        transfer.claimed_at = now
        pages, skip = self._pages(transfer), transfer.skip_blocks * self._factors(transfer)[0]
        if self.config.mode == "push":
            TRANSITIONS.move(transfer, State.REGISTERED)
            message: Message = Register(
                transfer.transfer_id, [pages], self.layout_digest, skip, transfer.parts
            )
        else:
            TRANSITIONS.move(transfer, State.REQUESTED)
            message = PullRequest(transfer.transfer_id, len(pages), skip, transfer.parts)
        return [self._send(transfer.peer, message, now)]

    def _on_heartbeat(self, peer: str, message: Heartbeat, now: float) -> list[Action]:
        for transfer_id in message.transfer_ids:
            transfer = self._transfers.get((transfer_id, peer))
            if transfer is not None:
                deadline = min(now + self.config.watchdog_s, transfer.give_up_at)
                self._deadlines.extend(("watchdog", _key(transfer)), deadline)
        return []

    def _on_complete(self, transfer: _Transfer, message: Complete, now: float) -> list[Action]:
        if transfer.state == State.CANCELLING:
            # The producer is done with our blocks: the cancel is settled.
            return self._fail(transfer, now, transfer.cancel_reason or "aborted")
        if transfer.state != State.REGISTERED:
            return [Counted("rejected_messages", {"why": "unexpected_complete"})]
        transfer.complete = message
        self._deadlines.cancel(("watchdog", _key(transfer)))
        if not message.notif:
            if transfer.blocks:
                # Only a transfer with nothing to move may complete without a WRITE.
                detail = "the producer completed without writing the registered blocks"
                return self._fail(transfer, now, "write_failed", detail)
            return self._deliver(transfer)
        if transfer.notified:
            return self._deliver(transfer)
        TRANSITIONS.move(transfer, State.LANDING)
        self._deadlines.set(("landing", _key(transfer)), now + self.config.landing_s)
        return []

    def _on_failed(self, transfer: _Transfer, message: Failed, now: float) -> list[Action]:
        if transfer.state == State.READING:
            transfer.cancel_reason = message.reason  # our READ still runs; it ends it
            return []
        if message.may_land and transfer.state in _WRITES_MAY_LAND:
            # A WRITE the producer gave up on may still be landing in our blocks.
            return self._settle_later(transfer, message.reason, now)
        # The producer wrote nothing more after saying so: the blocks are ours again.
        return self._fail(transfer, now, message.reason, message.detail)

    def _settle_later(self, transfer: _Transfer, reason: str, now: float) -> list[Action]:
        """Fail the transfer once a WRITE posted into its blocks can no longer land."""
        TRANSITIONS.move(transfer, State.CANCELLING)
        transfer.cancel_reason = reason
        self._deadlines.cancel(("watchdog", _key(transfer)))
        self._deadlines.cancel(("landing", _key(transfer)))
        self._deadlines.set(("settle", _key(transfer)), now + self._landing_bound())
        return []

    def _on_grant(self, transfer: _Transfer, message: Grant, now: float) -> list[Action]:
        if transfer.state != State.REQUESTED:
            return [Counted("rejected_messages", {"why": "unexpected_grant"})]
        assert transfer.blocks is not None
        # The lease started when the producer answered, after we asked: counting from
        # the ask (minus a margin for the READ itself) keeps us inside it.
        transfer.read_deadline = transfer.claimed_at + message.lease_s - self.config.write_grace_s
        remote = message.block_ids[0] if len(message.block_ids) == 1 else []
        problem = self._check_grant(transfer, remote)
        if problem or now >= transfer.read_deadline:
            reason = "bad_blocks" if problem else "lease_expired"
            release = self._send(transfer.peer, Release(transfer.transfer_id), now)
            detail = problem or "the grant came too late"
            return [release] + self._fail(transfer, now, reason, detail)
        TRANSITIONS.move(transfer, State.READING)
        self._deadlines.cancel(("watchdog", _key(transfer)))
        producer = self._peers[transfer.peer].layout
        assert producer is not None
        # Never empty: the last position is inside every window, on both sides.
        theirs, ours = moving_pairs(
            remote, self._pages(transfer)[: len(remote)], producer.null_block, self.null_block
        )
        return [PostRead(transfer.transfer_id, transfer.peer, ours, theirs)]

    def _factors(self, transfer: _Transfer) -> tuple[int, int]:
        """Pages per block, ours and the producer's: with different block sizes a pair
        counts blocks in pages of the smaller (ids on the wire are page ids)."""
        producer = self._peers[transfer.peer].layout
        assert producer is not None
        theirs = producer.tokens_per_block
        return page_factors(self.block_tokens or theirs, theirs)

    def _pages(self, transfer: _Transfer) -> list[int]:
        assert transfer.blocks is not None
        return to_pages(transfer.blocks, self._factors(transfer)[0])

    def _check_grant(self, transfer: _Transfer, remote: list[int]) -> str:
        producer = self._peers[transfer.peer].layout
        assert producer is not None
        ours, theirs = self._factors(transfer)
        asked = len(self._pages(transfer))
        # Our last block may reach past the prompt's last page by less than a block.
        if not asked - ours < len(remote) <= asked:
            return f"granted {len(remote)} blocks for {asked} asked"
        count = producer.num_blocks * theirs
        bad = [b for b in remote if b >= count]
        if bad:
            return f"granted block ids {bad[:8]} outside the producer's {count}"
        if remote and remote[-1] == producer.null_block:
            return "the last granted block is the null block"
        return ""

    def _on_watchdog(self, transfer: _Transfer, now: float) -> list[Action]:
        if transfer.state == State.CONNECTING:
            cancel = self._cancel(transfer, "watchdog_expired", now)  # if the session comes
            return cancel + self._fail(
                transfer, now, "watchdog_expired", "no session with the producer"
            )
        cancel = self._send(transfer.peer, Cancel(transfer.transfer_id, "watchdog_expired"), now)
        if transfer.state == State.REQUESTED:
            return [cancel] + self._fail(transfer, now, "watchdog_expired", "no grant in time")
        if transfer.state in _PRODUCER_MAY_WRITE:
            return [cancel] + self._start_cancel(transfer, "watchdog_expired", now)
        return []

    def _start_cancel(self, transfer: _Transfer, reason: str, now: float) -> list[Action]:
        """Hold the blocks until the producer acks, or until it provably cannot write.

        The producer posts WRITEs only while its registration is alive, which ends
        `registration_ttl_s` after the last claim we sent; a WRITE posted just before
        then lands within `write_grace_s`.
        """
        TRANSITIONS.move(transfer, State.CANCELLING)
        transfer.cancel_reason = reason
        self._deadlines.cancel(("watchdog", _key(transfer)))
        hello = self._peers[transfer.peer].hello if transfer.peer in self._peers else None
        ttl = hello.registration_ttl_s if hello else self.config.registration_ttl_s
        settle = transfer.claimed_at + ttl + self._landing_bound()
        self._deadlines.set(("settle", _key(transfer)), max(settle, now))
        return []

    def _landing_bound(self) -> float:
        """How long after the producer's last chance to post a WRITE it may still land:
        its Node aborts a WRITE after write_grace_s; a heartbeat's worth of margin
        covers the two sides' timer granularity."""
        return self.config.write_grace_s + self.config.heartbeat_s

    def _send(self, peer: str, message: Message, now: float) -> Send:
        """A message for the producer at `peer`; its silence rule counts from the last."""
        self._last_sent[peer] = now
        return Send(peer, message)

    def _heartbeats(self, now: float) -> list[Action]:
        wanted: dict[str, list[str]] = {}
        for transfer in self._transfers.values():
            if transfer.state in _HEARTBEATING and self._ready(transfer.peer):
                wanted.setdefault(transfer.peer, []).append(transfer.transfer_id)
                if transfer.state == State.REGISTERED:
                    transfer.claimed_at = now
        if self._transfers:
            self._deadlines.set(HEARTBEAT, now + self.config.heartbeat_s)
        return [self._send(peer, Heartbeat(tids), now) for peer, tids in wanted.items()]

    def _deliver(self, transfer: _Transfer) -> list[Action]:
        """One part's KV landed; the transfer is delivered once every part's has."""
        complete = transfer.complete
        wall = complete.kv_ready_wall if complete else transfer.kv_ready_wall
        request = self._requests[transfer.transfer_id]
        request.kv_ready_wall = max(request.kv_ready_wall, wall)
        self._forget(transfer)
        return self._outcome(transfer.transfer_id, request)

    def _fail(self, transfer: _Transfer, now: float, reason: str, detail: str = "") -> list[Action]:
        """One part is over without its KV: the transfer fails, once no other part can
        write into its blocks any more (they are given up now)."""
        request = self._requests[transfer.transfer_id]
        if not request.reason:
            request.reason, request.detail = reason, detail
        self._forget(transfer)
        actions: list[Action] = []
        for other in self._parts(transfer.transfer_id):
            actions += self._give_up(other, reason, now)
        return actions + self._outcome(transfer.transfer_id, request)

    def _outcome(self, transfer_id: str, request: _Request) -> list[Action]:
        """The transfer's one outcome, once its last part ended (none without blocks)."""
        if transfer_id not in self._requests or request.keys:
            return []
        del self._requests[transfer_id]
        if not request.blocks:
            return []
        if request.reason:
            return [TransferFailed(transfer_id, request.reason, request.detail)]
        return [Delivered(transfer_id, request.kv_ready_wall)]

    def _add(self, transfer: _Transfer) -> _Transfer:
        self._transfers[_key(transfer)] = transfer
        self._requests.setdefault(transfer.transfer_id, _Request(set())).keys.add(_key(transfer))
        return transfer

    def _parts(self, transfer_id: str) -> list[_Transfer]:
        request = self._requests.get(transfer_id)
        return [self._transfers[key] for key in request.keys] if request else []

    def _forget(self, transfer: _Transfer) -> None:
        TRANSITIONS.move(transfer, State.ENDED)
        key = _key(transfer)
        self._transfers.pop(key, None)
        request = self._requests[transfer.transfer_id]
        request.keys.discard(key)
        if not request.keys and not request.blocks:
            del self._requests[transfer.transfer_id]  # only announced: no outcome owed
        self._ended[key] = None
        if len(self._ended) > _ENDED_MEMORY:
            del self._ended[next(iter(self._ended))]
        for kind in ("watchdog", "landing", "settle"):
            self._deadlines.cancel((kind, key))

    # -- inspection ------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """How many transfer parts are in each state (states with none left out)."""
        return dict(collections.Counter(str(t.state) for t in self._transfers.values()))

    def waiting(self) -> list[str]:
        """Transfers with blocks that have not ended yet."""
        return sorted(tid for tid, request in self._requests.items() if request.blocks)

    def state_of(self, transfer_id: str, peer: str | None = None) -> State | None:
        """The state of the transfer's part from `peer` (None: its only part)."""
        parts = self._parts(transfer_id)
        if peer is None:
            return parts[0].state if len(parts) == 1 else None
        transfer = self._transfers.get((transfer_id, peer))
        return transfer.state if transfer else None
