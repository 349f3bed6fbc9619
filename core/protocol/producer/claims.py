"""One consumer's claim on a source: push (its blocks, for our WRITEs) or pull (a
READ of ours). The kind is chosen once, by the message that claims, as the class of
the claim; what differs between the two is in their methods, not in branches.

A push claim finishes when the WRITE that gives the consumer its last layer lands
(Complete), or when it fails, once no WRITE of it is in flight. A WRITE that fails
outright is posted again, a heartbeat later, up to write_retries times, before the
claim fails as write_failed. A pull claim
finishes when the consumer releases its grant, or when the grant's lease runs out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvpush.layout import blocks_of, to_pages
from kvpush.protocol.actions import (
    Action,
    ChunkSent,
    Counted,
    ExposeBlocks,
    PostWrite,
    Send,
)
from kvpush.protocol.messages import (
    CancelAck,
    Complete,
    Failed,
    Grant,
    Message,
    PullRequest,
    Register,
    Writing,
    encode_notif,
)
from kvpush.protocol.producer.cursor import Run, WriteCursor
from kvpush.protocol.producer.moves import PULL, PUSH, READABLE, WRITE_IN_FLIGHT, Event, State
from kvpush.protocol.producer.source import Peer, Source
from kvpush.protocol.states import EventTable
from kvpush.protocol.timers import Timer, arm_heartbeat

if TYPE_CHECKING:
    from kvpush.protocol.producer import Producer


@dataclass
class Claim:
    """What every claim has: its source, its consumer, and how it ends."""

    TABLE: ClassVar[EventTable[State, Event]]
    MODE: ClassVar[str]  # the producer mode that takes this kind of claim
    DUPLICATE: ClassVar[str]  # the counter a repeated claim counts in

    source: Source
    peer: str
    state: State
    skip: int = 0  # leading pages the consumer holds already
    nbytes: int = 0
    reason: str = ""  # cancelling, failing, abandoned: why the claim ends
    detail: str = ""  # failing: what the consumer is told
    seq: int = 0  # claims are served in the order they came

    @property
    def transfer_id(self) -> str:
        return self.source.transfer_id

    @property
    def key(self) -> tuple[str, str]:
        return (self.source.transfer_id, self.peer)

    def fire(self, event: Event) -> None:
        self.TABLE.fire(self, event)

    def pages(self, p: Producer) -> list[int]:
        """The KV's pages, after those the consumer holds already."""
        assert self.source.kv_blocks is not None
        ours, _ = p.factors(self.peer)
        return to_pages(self.source.kv_blocks, ours)[self.skip :]

    @classmethod
    def of(cls, source: Source, peer: str, state: State, message: Any) -> Claim:
        """The claim `message` makes, in `state`."""
        raise NotImplementedError

    @classmethod
    def layout_problem(cls, peer: Peer, message: Any, block_tokens: int | None) -> str | None:
        """What is wrong with the blocks the claim names, given the consumer's layout
        (checked before the claim is compared with an earlier one)."""
        return None

    @classmethod
    def size_problem(cls, message: Any) -> str | None:
        """What is wrong with how much the claim asks for (checked after)."""
        return None

    def same_as(self, message: Any) -> bool:
        """Whether `message` (a claim of this kind) repeats this claim."""
        raise NotImplementedError

    def start(self, p: Producer, now: float) -> list[Action]:
        """The claim arrived: act on what the engine computed so far."""
        raise NotImplementedError

    def proceed(self, p: Producer, now: float) -> list[Action]:
        """The engine computed more of the KV."""
        raise NotImplementedError

    def give_up(self, reason: str, detail: str) -> bool:
        """The claim is over; True when a WRITE in flight makes it end later."""
        return False

    def hold_off(self, reason: str, detail: str, notice: Send, cancel: bool) -> list[Action] | None:
        """The consumer no longer wants the claim (it cancelled, or its claim was
        refused): the actions that keep it alive a while, or None to end it now."""
        return None

    def write_done(
        self, p: Producer, ok: bool, now: float, detail: str, nbytes: int, may_land: bool
    ) -> list[Action]:
        return [Counted("unexpected_write_completion")]

    def released(self, p: Producer, now: float) -> list[Action]:
        return [Counted("rejected_messages", {"why": "unexpected_release"})]

    def writes_into_peer(self) -> bool:
        """Whether WRITEs of this claim may still go into the consumer's blocks."""
        return False

    def rewrite(self, p: Producer, now: float) -> list[Action]:
        """A failed WRITE's back-off is over (push only)."""
        return []


@dataclass
class PushClaim(Claim):
    """A consumer's blocks, registered for our WRITEs."""

    TABLE = PUSH
    MODE = "push"
    DUPLICATE = "duplicate_registrations"

    destinations: list[int] = field(default_factory=list)
    cursor: WriteCursor = field(default_factory=lambda: WriteCursor(1))
    told_writing: bool = False  # the consumer got Writing

    @classmethod
    def of(cls, source: Source, peer: str, state: State, message: Register) -> PushClaim:
        return cls(
            source, peer, state, message.skip_blocks,
            destinations=list(message.block_ids[0]),
            cursor=WriteCursor(source.num_layers),
        )  # fmt: skip

    @classmethod
    def layout_problem(cls, peer: Peer, message: Register, block_tokens: int | None) -> str | None:
        return peer.destination_problem(message, block_tokens)

    def same_as(self, message: Register) -> bool:
        return self.destinations == message.block_ids[0]

    def start(self, p: Producer, now: float) -> list[Action]:
        p.deadlines.set((Timer.REGISTRATION, self.key), now + p.config.registration_ttl_s)
        # The consumer hears from us while prefill computes.
        arm_heartbeat(p.deadlines, now, p.config.heartbeat_s)
        return self.proceed(p, now) if self.source.kv_blocks is not None else []

    def proceed(self, p: Producer, now: float) -> list[Action]:
        """Post the next WRITE, if none is in flight: what is computed and not written."""
        if self.state in WRITE_IN_FLIGHT:
            return []  # its completion posts what became ready meanwhile
        source = self.source
        p.deadlines.cancel((Timer.LEASE, self.key))
        if source.all_computed:
            p.deadlines.cancel((Timer.REGISTRATION, self.key))
        sources = self.pages(p)
        ours, theirs = p.factors(self.peer)
        count = source.span(len(self.destinations), len(sources), theirs)
        if count is None:
            detail = (
                f"{len(self.destinations)} destination blocks for {len(sources)} source "
                f"blocks (after skipping {self.skip})"
            )
            return p.books.end(self, "bad_blocks", now, notify=True, detail=detail)
        ready = source.blocks_ready * ours - self.skip
        run = self.cursor.next(ready, source.layers_ready, count)
        if run is None:
            if not (source.all_computed and self.cursor.covers(count)):
                return []
            # Nothing (more) to move: decode holds every block in its prefix cache, or
            # earlier WRITEs moved them all.
            complete = Complete(self.transfer_id, b"", self.nbytes, source.kv_ready_wall)
            return [Send(self.peer, complete)] + p.books.end(self, "sent", now)
        return self._post(p, run, sources)

    def rewrite(self, p: Producer, now: float) -> list[Action]:
        """The back-off after a failed WRITE is over: post the same run again, into
        the same blocks, which the claim still holds (else it would have ended)."""
        if self.state != State.RETRYING or self.cursor.flight is None:
            return []
        return self._post(p, self.cursor.flight, self.pages(p))

    def _post(self, p: Producer, run: Run, sources: list[int]) -> list[Action]:
        src, dst = p.moving(
            self.peer, sources[run.start : run.stop], self.destinations[run.start : run.stop]
        )
        if not src:
            self.cursor.advance(run)  # positions a sliding window left: no bytes
            return []
        self.fire(Event.POST)
        self.cursor.post(run)
        notif = encode_notif(self.transfer_id, self.source.kv_ready_wall) if run.last else b""
        write = PostWrite(self.transfer_id, self.peer, src, dst, notif, run.layers)
        if self.told_writing:
            return [write]
        self.told_writing = True
        return [Send(self.peer, Writing(self.transfer_id)), write]

    def give_up(self, reason: str, detail: str) -> bool:
        """Failed goes out once the WRITE in flight is over; a cancel already under
        way says it first."""
        if self.state not in WRITE_IN_FLIGHT:
            return False
        self.fire(Event.GIVE_UP)
        if not self.reason:  # a cancel or an earlier failure already said why
            self.reason, self.detail = reason, detail
        return True

    def hold_off(self, reason: str, detail: str, notice: Send, cancel: bool) -> list[Action] | None:
        if not cancel:
            return [] if self.give_up(reason, detail) else None
        if self.state not in WRITE_IN_FLIGHT:
            return None
        self.fire(Event.CANCEL)  # the WRITE cannot be recalled: the ack waits for it
        self.reason = reason
        return []

    def write_done(
        self, p: Producer, ok: bool, now: float, detail: str, nbytes: int, may_land: bool
    ) -> list[Action]:
        if self.state not in WRITE_IN_FLIGHT:
            return super().write_done(p, ok, now, detail, nbytes, may_land)
        # A WRITE that failed outright (nothing of it can still land) goes again while
        # the claim holds the blocks: a short cut takes UCX's route, not the claim.
        outright = self.state == State.WRITING and not ok and not may_land
        if outright and self.cursor.fail(p.config.write_retries):
            self.fire(Event.WRITE_FAILED)
            p.deadlines.set((Timer.REWRITE, self.key), now + p.config.heartbeat_s)
            return [Counted("write_retries")]
        ended_as = self.state
        self.fire(Event.WRITE_DONE)  # nothing is in flight any more
        tid = self.transfer_id
        if ended_as == State.CANCELLING:
            outcome = self.reason
            message: Message = CancelAck(tid, may_land)
        elif ended_as == State.FAILING:
            outcome = self.reason
            message = Failed(tid, outcome, self.detail, may_land)
        elif not ok:
            outcome = "write_failed"
            message = Failed(tid, outcome, detail, may_land)
        else:
            self.nbytes += nbytes
            run = self.cursor.land()
            if run.chunk:
                return [ChunkSent(tid, nbytes), *self.proceed(p, now)]
            if not run.last:
                return self.proceed(p, now)
            outcome = "sent"
            wall = self.source.kv_ready_wall
            message = Complete(tid, encode_notif(tid, wall), self.nbytes, wall)
        actions: list[Action] = [Send(self.peer, message)] if p.has_session(self.peer) else []
        return actions + p.books.end(self, outcome, now)

    def writes_into_peer(self) -> bool:
        return self.state not in (State.CANCELLING, State.FAILING)


@dataclass
class PullClaim(Claim):
    """A consumer's request to READ the KV from our blocks."""

    TABLE = PULL
    MODE = "pull"
    DUPLICATE = "duplicate_pull_requests"

    blocks: int = 0  # pages the consumer asked for

    @classmethod
    def of(cls, source: Source, peer: str, state: State, message: PullRequest) -> PullClaim:
        return cls(source, peer, state, message.skip_blocks, blocks=message.num_blocks)

    @classmethod
    def size_problem(cls, message: PullRequest) -> str | None:
        return "a pull must ask for at least a block" if message.num_blocks <= 0 else None

    def same_as(self, message: PullRequest) -> bool:
        return (self.blocks, self.skip) == (message.num_blocks, message.skip_blocks)

    def start(self, p: Producer, now: float) -> list[Action]:
        if self.source.all_computed:
            return self.proceed(p, now)
        p.deadlines.set((Timer.REGISTRATION, self.key), now + p.config.registration_ttl_s)
        return []

    def proceed(self, p: Producer, now: float) -> list[Action]:
        """Grant the KV once all of it is computed."""
        if not self.source.all_computed:
            return []
        sources = self.pages(p)
        ours, theirs = p.factors(self.peer)
        fits = self.source.span(self.blocks, len(sources), theirs)
        if fits is None:
            detail = (
                f"{self.blocks} blocks asked after skipping {self.skip}, "
                f"{len(sources)} held after it"
            )
            return p.books.end(self, "bad_blocks", now, notify=True, detail=detail)
        self.fire(Event.GRANT)
        p.deadlines.cancel((Timer.REGISTRATION, self.key))
        p.deadlines.set((Timer.LEASE, self.key), now + p.config.lease_s)
        # The consumer holds the first blocks already (prefix cache): grant the rest.
        pages = sources[:fits]
        grant = Grant(self.transfer_id, [pages], p.config.lease_s)
        return [
            ExposeBlocks(self.transfer_id, blocks_of(pages, ours), self.peer),
            Send(self.peer, grant),
        ]

    def hold_off(self, reason: str, detail: str, notice: Send, cancel: bool) -> list[Action] | None:
        """A READ may still be copying a granted KV: keep the blocks until the
        consumer's Release or the lease's end, renewing nothing."""
        if self.state not in READABLE:
            return None
        self.fire(Event.ABANDON)
        self.reason = self.reason or reason
        return [notice]

    def released(self, p: Producer, now: float) -> list[Action]:
        if self.state not in READABLE:
            return super().released(p, now)
        outcome = self.reason if self.state == State.ABANDONED else "sent"
        return p.books.end(self, outcome, now)
