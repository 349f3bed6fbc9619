"""How a part gets its KV: the producer WRITEs it (push) or we READ it (pull).

The consumer's mode picks one way, once, to ask the producer with; the handlers of
both stay reachable, so a message of the other way is counted as unexpected by its
state, the same as a late one of this way.

A push part finishes when NIXL's notification of its last WRITE came (or the
Complete of a part with nothing to move); a pull part when its READ is over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpush.layout import moving_pairs
from kvpush.protocol.actions import Action, Counted, PostRead
from kvpush.protocol.consumer.moves import Event, State
from kvpush.protocol.consumer.records import Part
from kvpush.protocol.messages import (
    Complete,
    Grant,
    Message,
    PullRequest,
    Register,
    Release,
    decode_notif,
)
from kvpush.protocol.timers import Timer

if TYPE_CHECKING:
    from kvpush.protocol.consumer import Consumer


class Way:
    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer

    def factors(self, part: Part) -> tuple[int, int]:
        """Pages per block, ours and the producer's."""
        return self.c.sessions.peers[part.peer].factors(self.c.block_tokens)

    def pages(self, part: Part) -> list[int]:
        return part.pages(self.factors(part)[0])

    def ask(self, part: Part) -> Message:
        """The claim that tells the producer what we want."""
        raise NotImplementedError


class PushWay(Way):
    def ask(self, part: Part) -> Message:
        part.fire(Event.REGISTER)
        pages, skip = self.pages(part), part.skip_blocks * self.factors(part)[0]
        return Register(part.transfer_id, [pages], self.c.layout_digest, skip, part.parts)

    def on_complete(self, part: Part, message: Complete, now: float) -> list[Action]:
        books = self.c.books
        if part.state == State.CANCELLING:
            # The producer is done with our blocks: the cancel is settled.
            return books.fail(part, now, part.cancel_reason or "aborted")
        if part.state != State.REGISTERED:
            return [Counted("rejected_messages", {"why": "unexpected_complete"})]
        part.complete = message
        books.deadlines.cancel((Timer.WATCHDOG, part.key))
        if not message.notif:
            if part.blocks:
                # Only a transfer with nothing to move may complete without a WRITE.
                detail = "the producer completed without writing the registered blocks"
                return books.fail(part, now, "write_failed", detail)
            return books.deliver(part)
        if part.notified:
            return books.deliver(part)
        part.fire(Event.COMPLETE)
        books.deadlines.set((Timer.LANDING, part.key), now + self.c.config.landing_s)
        return []

    def on_notif(self, peer: str, notif: bytes, now: float) -> list[Action]:
        decoded = decode_notif(notif)
        if decoded is None:
            return [Counted("rejected_notifs", {"why": "foreign"})]
        transfer_id, wall = decoded
        books = self.c.books
        part = books.parts.get((transfer_id, peer))
        if part is None:
            why = "late" if (transfer_id, peer) in books.ended else "unknown_transfer"
            return [Counted("rejected_notifs", {"why": why})]
        part.notified = True
        part.kv_ready_wall = wall
        if part.state in (State.REGISTERED, State.LANDING):
            return books.deliver(part)
        if part.state == State.CANCELLING:
            # The last WRITE landed: nothing more will be written into these blocks.
            return books.fail(part, now, part.cancel_reason or "aborted")
        return []

    def landing_due(self, part: Part, now: float) -> list[Action]:
        if part.state != State.LANDING:
            return []
        detail = "the producer completed but NIXL's notification never came"
        return self.c.books.fail(part, now, "write_failed", detail)


class PullWay(Way):
    def ask(self, part: Part) -> Message:
        part.fire(Event.REQUEST)
        pages, skip = self.pages(part), part.skip_blocks * self.factors(part)[0]
        return PullRequest(part.transfer_id, len(pages), skip, part.parts)

    def on_grant(self, part: Part, message: Grant, now: float) -> list[Action]:
        if part.state != State.REQUESTED:
            return [Counted("rejected_messages", {"why": "unexpected_grant"})]
        c = self.c
        # The lease started when the producer answered, after we asked: counting from
        # the ask (minus a margin for the READ itself) keeps us inside it.
        part.read_deadline = part.claimed_at + message.lease_s - c.config.write_grace_s
        remote = message.block_ids[0] if len(message.block_ids) == 1 else []
        producer = c.sessions.peers[part.peer]
        ours, theirs = self.factors(part)
        problem = producer.grant_problem(len(self.pages(part)), ours, theirs, remote)
        if problem or now >= part.read_deadline:
            reason = "bad_blocks" if problem else "lease_expired"
            release = c.sessions.send(part.peer, Release(part.transfer_id), now)
            detail = problem or "the grant came too late"
            return [release] + c.books.fail(part, now, reason, detail)
        part.fire(Event.GRANT)
        c.books.deadlines.cancel((Timer.WATCHDOG, part.key))
        assert producer.layout is not None
        # Never empty: the last position is inside every window, on both sides.
        theirs_ids, ours_ids = moving_pairs(
            remote, self.pages(part)[: len(remote)], producer.layout.null_block, c.null_block
        )
        return [PostRead(part.transfer_id, part.peer, ours_ids, theirs_ids)]

    def read_done(
        self, part: Part, ok: bool, now: float, detail: str, may_land: bool
    ) -> list[Action]:
        c = self.c
        actions: list[Action] = []
        if c.sessions.ready(part.peer):
            actions.append(c.sessions.send(part.peer, Release(part.transfer_id), now))
        if not ok and may_land:
            reason = part.cancel_reason or "read_failed"
            return actions + c.books.settle_later(part, reason, now)
        if part.cancel_reason:
            return actions + c.books.fail(part, now, part.cancel_reason)
        if not ok:
            return actions + c.books.fail(part, now, "read_failed", detail)
        if now > part.read_deadline:
            detail = "the read outlasted its lease"
            return actions + c.books.fail(part, now, "lease_expired", detail)
        return actions + c.books.deliver(part)
