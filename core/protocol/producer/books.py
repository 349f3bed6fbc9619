"""The producer's books: its consumers' sessions, its live sources by transfer id,
and what outlives them.

A source ends once (Books.end): its blocks go back, and a tombstone answers the
claims and engine reports that come after. What the books remember beyond the
sources is in six bounded memories (kvpush.protocol.memory), one class for all.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvpush.protocol.actions import Action, ReleaseBlocks, Send
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.memory import Memory
from kvpush.protocol.messages import Failed, Heartbeat
from kvpush.protocol.producer.claims import Claim
from kvpush.protocol.producer.moves import ENDING, HEARTBEATING, MAY_HEARTBEAT, Event, State
from kvpush.protocol.producer.source import Peer, Source
from kvpush.protocol.timers import HEARTBEAT, Deadlines, Timer

if TYPE_CHECKING:
    from kvpush.protocol.producer import Producer


class Books:
    """Sessions, live sources, the ways they end, and what outlives them."""

    def __init__(self, config: ProtocolConfig, num_layers: int, deadlines: Deadlines) -> None:
        self.config = config
        self.num_layers = num_layers
        self.deadlines = deadlines
        self.peers: dict[str, Peer] = {}  # consumers with a session
        self.sources: dict[str, Source] = {}
        self.claim_seq = itertools.count(1)
        self.tombstones: Memory[str, str] = Memory()  # ended transfer id -> why
        self.released: Memory[str, None] = Memory()  # released before the last report
        # Transfers whose last-layer report was acted on: the engine may report the
        # last layer twice (the layer's own hook, then the end of the step).
        self.final_seen: Memory[str, None] = Memory()
        self.refused: Memory[tuple[str, str], str] = Memory()  # (peer, id) told Failed
        # Consumers whose heartbeats named a transfer nobody has claimed yet: should
        # every one of them be lost, no claim will come (a retry takes a new id).
        self.announcers: Memory[str, frozenset[str]] = Memory()
        self.deserted: Memory[str, None] = Memory()  # every announcer was lost
        self.memories = (
            self.tombstones, self.released, self.final_seen,
            self.refused, self.announcers, self.deserted,
        )  # fmt: skip

    def new(self, tid: str, state: State) -> Source:
        source = self.sources[tid] = Source(tid, self.num_layers, state)
        return source

    def claims(self) -> list[Claim]:
        """Every live claim, in the order they came."""
        claims = [claim for source in self.sources.values() for claim in source.claims.values()]
        return sorted(claims, key=lambda claim: claim.seq)

    def claim_of(self, tid: str, peer: str) -> Claim | None:
        source = self.sources.get(tid)
        return source.claims.get(peer) if source else None

    def record_of(self, tid: str, peer: str | None) -> Source | Claim | None:
        """`peer`'s claim on `tid`, or (peer None) its source while nobody claims it."""
        source = self.sources.get(tid)
        if source is None:
            return None
        if peer is None:
            return None if source.claims else source
        return source.claims.get(peer)

    def records(self, source: Source) -> list[Source | Claim]:
        """A source's claims, or the source itself while nobody claims it."""
        return list(source.claims.values()) or [source]

    # -- announcements ---------------------------------------------------------------

    def heartbeat(self, peer: str, tid: str, now: float) -> None:
        """`peer` says it still waits for `tid`: hold what it claimed or may claim."""
        source = self.sources.get(tid)
        if source is None:
            if tid not in self.tombstones:
                # A consumer already waits for KV this engine has not produced yet.
                self.announced_by(tid, peer, now + self.config.lease_s)
            return
        record = source.claims.get(peer) if source.claims else source
        if record is None or record.state in ENDING:
            return
        source.announced = True
        if record is source:
            self.announced_by(tid, peer, self.announcers.until(tid))
        self.deadlines.extend((Timer.LEASE, record.key), now + self.config.lease_s)
        deadline = now + self.config.registration_ttl_s
        self.deadlines.extend((Timer.REGISTRATION, record.key), deadline)

    def announced_by(self, tid: str, peer: str, until: float | None) -> None:
        peers = (self.announcers.get(tid) or frozenset()) | {peer}
        self.announcers.remember(tid, peers, until)
        self.deserted.forget(tid)

    def peer_lost(self, peer: str, now: float) -> None:
        """`peer` will announce nothing more: what only it announced is deserted."""
        for tid in self.announcers:
            peers = self.announcers[tid]
            if peer not in peers:
                continue
            if peers - {peer}:
                self.announcers.remember(tid, peers - {peer}, self.announcers.until(tid))
            else:
                self.desert(tid, now)

    def desert(self, tid: str, now: float) -> None:
        """Every consumer that announced `tid` is gone: what it waits for will not be
        claimed. Cut an unclaimed source's hold to a few heartbeats."""
        self.announcers.forget(tid)
        self.deserted.remember(tid, None)
        source = self.sources.get(tid)
        if source is not None and source.state == State.HELD and not source.claims:
            key = (Timer.LEASE, (tid, None))
            cut = now + self.deserted_hold()
            if cut < (self.deadlines.get(key) or float("inf")):
                self.deadlines.set(key, cut)

    def deserted_hold(self) -> float:
        """How long KV whose announcers were all lost is kept: a claim already on its
        way (sent just before the loss) still lands in that."""
        return 2 * self.config.heartbeat_s

    # -- holding and ending ----------------------------------------------------------

    def hold(self, source: Source, now: float) -> None:
        """All of the KV is computed and nobody (more) has claimed it: keep it under a
        lease (short for a transfer the producer named, unless a consumer announced it)."""
        tid = source.transfer_id
        source.fire(Event.HOLD)
        announced = self.announcers.until(tid)
        source.announced = source.announced or announced is not None
        hold = self.config.lease_s
        if source.sequential and not source.announced:
            hold = min(self.config.orphan_grace_s, hold)
        if tid in self.deserted:
            hold, announced = min(self.deserted_hold(), hold), None
        self.announcers.keep(tid)
        self.deadlines.set((Timer.LEASE, (tid, None)), max(now + hold, announced or 0))

    def end(
        self,
        record: Source | Claim,
        outcome: str,
        now: float,
        notify: bool = False,
        detail: str = "",
    ) -> list[Action]:
        """End the record, telling its consumer if asked; free the KV (once) when it
        was the source's last, and no claim the consumers announced is still to come."""
        actions: list[Action] = []
        if notify and record.peer in self.peers:
            actions.append(Send(record.peer, Failed(record.transfer_id, outcome, detail)))
        return actions + self._end(record, outcome, now)

    def _end(self, record: Source | Claim, outcome: str, now: float) -> list[Action]:
        record.fire(Event.END)
        for timer in (Timer.LEASE, Timer.REGISTRATION, Timer.REWRITE):
            self.deadlines.cancel((timer, record.key))
        source, tid = record.source, record.transfer_id
        if record.peer is not None:  # a claim: the source ends with its last one
            del source.claims[record.peer]
            source.nbytes += record.nbytes
            if outcome != "sent":
                source.outcome = source.outcome or outcome
            if source.claims:
                return []  # another consumer rank's claim still uses the KV
            if outcome == "sent" and source.more_expected():
                source.announced = True  # a consumer of this transfer exists
                self.hold(source, now)  # for the consumer rank still to claim it
                return []
            source.fire(Event.END)
        del self.sources[tid]
        self.announcers.forget(tid)
        self.deserted.forget(tid)
        outcome = source.outcome or outcome
        self.tombstone(tid, outcome if outcome != "sent" else "completed", now)
        if source.kv_blocks is None:
            return []
        if not source.engine_done:
            self.released.remember(tid, None)  # more reports will come: ignore them
        return [ReleaseBlocks(tid, outcome, source.nbytes)]

    def expire(self, key: tuple[str, str | None], reason: str, now: float) -> list[Action]:
        """A lease or registration deadline of the record at `key` expired."""
        record = self.record_of(*key)
        if record is None:
            return []
        source = record.source
        held = record.state == State.HELD and not source.announced
        if reason == "lease_expired" and held and source.sequential:
            reason = "orphaned"
        if record.give_up(reason, ""):
            return []
        if record.state == State.COMPUTING:
            # Nobody claimed it yet and the engine still works on it: keep waiting.
            ttl = self.config.registration_ttl_s
            self.deadlines.set((Timer.REGISTRATION, key), now + ttl)
            return []
        if record.state == State.ABANDONED:
            # The consumer was told when it was abandoned; only the blocks are left.
            return self.end(record, record.reason, now)
        return self.end(record, reason, now, notify=True)

    def rewrite(self, p: Producer, key: tuple[str, str], now: float) -> list[Action]:
        """A failed WRITE's back-off is over: its claim, if still alive, posts it again."""
        claim = self.claim_of(*key)
        return claim.rewrite(p, now) if claim is not None else []

    def heartbeats(self, now: float) -> list[Action]:
        """Tell each consumer which of its claims are still being computed or written."""
        waiting: dict[str, list[str]] = {}
        records = self.claims() + [s for s in self.sources.values() if not s.claims]
        for claim in self.claims():
            if claim.state in HEARTBEATING and claim.peer in self.peers:
                waiting.setdefault(claim.peer, []).append(claim.transfer_id)
        if any(record.state in MAY_HEARTBEAT for record in records):
            self.deadlines.set(HEARTBEAT, now + self.config.heartbeat_s)
        return [Send(peer, Heartbeat(tids)) for peer, tids in waiting.items()]

    def tombstone(self, tid: str, why: str, now: float) -> None:
        self.tombstones.remember(tid, why, now + self.config.tombstone_s)

    def reported_after_end(self, tid: str, final: bool) -> list[Action]:
        """The engine reports KV of a transfer that ended. Its blocks go back once: now,
        if they never came before; the reports after that are ignored until the last
        one (or an abort) ends the story. A tombstone may expire meanwhile: that must not."""
        if tid in self.released:
            if final:
                self.released.forget(tid)
            return []
        if not final:
            self.released.remember(tid, None)
        return [ReleaseBlocks(tid, self.tombstones[tid])]
