"""The producer (prefill) side of a transfer, as a state machine.

Events come in as method calls with the current time; the returned actions say what
to send, what to WRITE and when the engine may free a request's blocks. No sockets,
threads or clocks: the I/O layer (kvpush.node) does those.

For every transfer whose KV became ready the producer emits exactly one
ReleaseBlocks; it never posts a WRITE into blocks the consumer did not register,
nor after it told the consumer nothing more would come.

KV may become ready layer by layer (`kv_ready(..., layers=k)`: layers 0..k-1 are
computed), or block by block before the prompt's last step (`kv_progress`). Once
the consumer has registered, what is computed is written at once, one WRITE per
claim at a time (kvpush.protocol.producer.cursor); the last WRITE carries the
NIXL notification and is followed by Complete.

Two levels, as the consumer has: a Source per transfer id (the engine's KV, its
hold, one release; .source) and a claim per consumer on it, push or pull (.claims).
This module holds the sessions and hands each message and each expired timer to
its handler by a table.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from kvpush.layout import KVLayout, moving_pairs
from kvpush.protocol.actions import Action, Counted, Disconnect, ReleaseRefused, Send
from kvpush.protocol.config import Machine, ProtocolConfig
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Failed,
    Heartbeat,
    Hello,
    Message,
    PullRequest,
    Register,
    Release,
)
from kvpush.protocol.producer.books import Books
from kvpush.protocol.producer.claims import Claim, PullClaim, PushClaim
from kvpush.protocol.producer.moves import (
    READABLE,
    TRANSITIONS,
    Event,
    State,
)
from kvpush.protocol.producer.source import Peer, Source
from kvpush.protocol.timers import Deadlines, Timer, arm_heartbeat

__all__ = ["DECODE_CANCELLED", "ROUTER_RELEASED", "TRANSITIONS", "Producer", "State"]

# The outcome of KV released because a consumer cancelled the transfer before claiming
# it: its decode request ended first (client gone, decode failed), or it needs none
# of the KV (another choice of n > 1 brings the prompt, or decode has it cached).
DECODE_CANCELLED = "decode_cancelled"
# The outcome of KV released on the router's word: the transfer's decode leg failed
# before decode's engine took it (refused, unreachable, its client gone), so no
# consumer will announce or claim it (release_unclaimed).
ROUTER_RELEASED = "router_released"

# The kind of claim each claiming message makes, chosen once, when it arrives.
CLAIM_KINDS: dict[type[Message], type[Claim]] = {Register: PushClaim, PullRequest: PullClaim}


class Producer(Machine):
    """All transfers of one prefill worker rank."""

    def __init__(
        self,
        config: ProtocolConfig,
        num_layers: int = 1,
        block_tokens: int | None = None,
        null_block: int = -1,
    ) -> None:
        super().__init__(config, block_tokens, null_block)
        self.num_layers = num_layers
        self.deadlines = Deadlines()
        self.books = Books(config, num_layers, self.deadlines)
        self._peers = self.books.peers
        self._on_timer: dict[Timer, Callable[[Any, float], list[Action]]] = {
            Timer.HEARTBEAT: lambda _, now: self.books.heartbeats(now),
            Timer.SILENT: self._on_silence,
            Timer.LEASE: lambda key, now: self.books.expire(key, "lease_expired", now),
            Timer.REGISTRATION: lambda key, now: self.books.expire(
                key, "registration_expired", now
            ),
            Timer.REWRITE: lambda key, now: self.books.rewrite(self, key, now),
        }
        self._on_message: dict[type[Message], Callable[[str, Any, float], list[Action]]] = {
            Register: self._on_claim,
            PullRequest: self._on_claim,
            Release: self._on_release,
            Heartbeat: self._on_heartbeat,
            Cancel: self._on_cancel,
        }

    # -- sessions --------------------------------------------------------------------

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, now: float) -> list[Action]:
        """A consumer (its KV laid out as `layout`) completed its handshake as `peer`."""
        self._peers[peer] = Peer(hello, layout)
        self.deadlines.set((Timer.SILENT, peer), now + self.config.silence_s)
        return []

    def on_peer_lost(self, peer: str, reason: str, now: float) -> list[Action]:
        """The consumer's side channel closed: drop what it claimed, free what it held,
        and hold what only it announced a few heartbeats more, not the whole lease."""
        if self._peers.pop(peer, None) is None:
            return []  # ended already (we dropped it for its silence)
        self.deadlines.cancel((Timer.SILENT, peer))
        self.books.peer_lost(peer, now)
        actions: list[Action] = []
        for claim in self.books.claims():
            if claim.peer == peer and not claim.give_up("peer_lost", reason):
                # (A WRITE in flight ends it when it can no longer land.)
                actions += self.books.end(claim, "peer_lost", now)
        return actions

    def has_session(self, peer: str) -> bool:
        return peer in self._peers

    def factors(self, peer: str) -> tuple[int, int]:
        """Pages per block, ours and the consumer's at `peer`."""
        return self._peers[peer].factors(self.block_tokens)

    def moving(
        self, peer: str, sources: list[int], dests: list[int]
    ) -> tuple[list[int], list[int]]:
        """The pairs that move bytes (not a null block on either side)."""
        return moving_pairs(sources, dests, self.null_block, self._peers[peer].layout.null_block)

    # -- engine events ---------------------------------------------------------------

    def kv_pending(self, transfer_id: str, now: float, sequential: bool = False) -> list[Action]:
        """The engine has the request: registrations for it are worth keeping.
        `sequential`: the producer named the transfer, and the consumer's leg comes
        only once the engine answered (see orphan_grace_s)."""
        source = self.books.sources.get(transfer_id)
        if source is None and transfer_id not in self.books.tombstones:
            source = self.books.new(transfer_id, State.COMPUTING)
            deadline = now + self.config.registration_ttl_s
            self.deadlines.set((Timer.REGISTRATION, (transfer_id, None)), deadline)
        if source is not None:
            source.reported()
            source.sequential = sequential
        arm_heartbeat(self.deadlines, now, self.config.heartbeat_s)
        return []

    def kv_ready(
        self,
        transfer_id: str,
        block_ids: list[int],
        now: float,
        ready_wall: float = 0.0,
        layers: int | None = None,
    ) -> list[Action]:
        """Layers 0..layers-1 of the request's KV are computed (all when `layers` is None).

        The KV is fenced before any WRITE reads it. `ready_wall` (the engine's wall
        clock when the last layer was ready) travels to the consumer for metrics.
        """
        layers = self.num_layers if layers is None else min(layers, self.num_layers)
        final = layers == self.num_layers
        if final:
            if transfer_id in self.books.final_seen:
                return [Counted("duplicate_kv_ready")]
            self.books.final_seen.remember(transfer_id, None)
        if transfer_id in self.books.released or transfer_id in self.books.tombstones:
            return self.books.reported_after_end(transfer_id, final)
        source = self.books.sources.get(transfer_id) or self.books.new(transfer_id, State.COMPUTING)
        if layers <= source.layers_ready:
            return [Counted("duplicate_kv_ready")]
        if not source.whole:
            source.kv_blocks = list(block_ids)  # the whole list now, earlier chunks' too
            source.whole = True
        source.layers_ready = layers
        source.engine_done = final
        source.reported()
        if final:
            source.kv_ready_wall = ready_wall
            for record in self.books.records(source):
                self.deadlines.cancel((Timer.REGISTRATION, record.key))
            if not source.claims:
                self.books.hold(source, now)
        return self._proceed(source, now)

    def kv_progress(
        self, transfer_id: str, block_ids: list[int], full_blocks: int, now: float
    ) -> list[Action]:
        """A step computed part of the prompt, not its last token (chunked prefill): the
        request holds `block_ids` so far, and the first `full_blocks` of them are
        complete in every layer. Push writes those now, so that the last step leaves
        only its own blocks to move.

        The engine then reports the last step with kv_ready, as for a prompt computed
        in one step; nothing is final before that.
        """
        if transfer_id in self.books.released or transfer_id in self.books.tombstones:
            return self.books.reported_after_end(transfer_id, final=False)
        source = self.books.sources.get(transfer_id) or self.books.new(transfer_id, State.COMPUTING)
        if source.whole:
            return [Counted("duplicate_kv_ready")]
        source.kv_blocks = list(block_ids)  # held now: they go back through us
        source.reported()
        full_blocks = min(full_blocks, len(block_ids))
        if full_blocks <= source.blocks_ready:
            return []
        source.blocks_ready = full_blocks
        return self._proceed(source, now)

    def _proceed(self, source: Source, now: float) -> list[Action]:
        actions: list[Action] = []
        for claim in list(source.claims.values()):
            actions += claim.proceed(self, now)
        return actions

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine dropped the request (client gone, router cancelled the leg): it
        reports nothing more for it."""
        source = self.books.sources.get(transfer_id)
        if source is None:
            self.books.released.forget(transfer_id)
            self.books.tombstone(transfer_id, "aborted", now)
            return []
        source.engine_done = True
        actions: list[Action] = []
        for record in self.books.records(source):
            if not record.give_up("aborted", "the prefill request was aborted"):
                actions += self.books.end(record, "aborted", now, notify=True)
        return actions

    def release_unclaimed(self, transfer_id: str, now: float) -> list[Action]:
        """The router says no consumer will come for the transfer: its decode leg
        failed before decode's engine took it. Free the KV now rather than at the end
        of its lease, unless a consumer claimed or announced it (the router may be
        wrong about a leg that reached decode after all: that consumer's word wins)."""
        source = self.books.sources.get(transfer_id)
        if source is None:
            why = "ended" if transfer_id in self.books.tombstones else "unknown"
            return [ReleaseRefused(transfer_id, why)]
        if source.claims:
            return [ReleaseRefused(transfer_id, "claimed")]
        deserted = transfer_id in self.books.deserted  # its announcers were all lost
        if transfer_id in self.books.announcers or (source.announced and not deserted):
            return [ReleaseRefused(transfer_id, "announced")]
        return self.books.end(source, ROUTER_RELEASED, now)

    def on_write_done(
        self,
        transfer_id: str,
        peer: str,
        ok: bool,
        now: float,
        detail: str = "",
        nbytes: int = 0,
        may_land: bool = False,
    ) -> list[Action]:
        """The WRITE in flight for `transfer_id` to `peer` completed (ok) or failed;
        `may_land`: it was given up on unfinished, so its bytes may still arrive."""
        claim = self.books.claim_of(transfer_id, peer)
        if claim is None:
            return [Counted("unexpected_write_completion")]
        return claim.write_done(self, ok, now, detail, nbytes, may_land)

    # -- messages --------------------------------------------------------------------

    def on_message(self, peer: str, message: Message, now: float) -> list[Action]:
        if peer not in self._peers:
            return [Counted("rejected_messages", {"why": "no_session"})]
        self.deadlines.set((Timer.SILENT, peer), now + self.config.silence_s)
        handler = self._on_message.get(type(message))
        if handler is None:
            why = f"unexpected_{type(message).__name__}"
            return [Counted("rejected_messages", {"why": why})]
        return handler(peer, message, now)

    def _on_claim(self, peer: str, message: Register | PullRequest, now: float) -> list[Action]:
        """A consumer claims the KV: for its blocks (push) or to READ ours (pull)."""
        tid, kind = message.transfer_id, CLAIM_KINDS[type(message)]
        refusal = self._refusal(peer, tid, kind.MODE)
        if refusal is None:
            problem = kind.layout_problem(self._peers[peer], message, self.block_tokens)
            refusal = ("bad_blocks", problem) if problem else None
        existing = self.books.claim_of(tid, peer)
        if refusal is None and existing is not None:
            if existing.same_as(message):
                return [Counted(kind.DUPLICATE)]
            refusal = ("conflict", "this consumer claimed the transfer for other blocks")
        too_little = kind.size_problem(message)
        if refusal is None and too_little:
            refusal = ("bad_blocks", too_little)
        source = self.books.sources.get(tid)
        refusal = refusal or (source.refusal(message.parts) if source else None)
        if refusal is not None:
            return self._refuse(peer, tid, *refusal, now)
        source = source or self.books.new(tid, State.COMPUTING)
        if not source.claims:
            source.fire(Event.CLAIM)  # its claims hold it from now on
            for timer in (Timer.LEASE, Timer.REGISTRATION):
                self.deadlines.cancel((timer, (tid, None)))
        state = State.CLAIMED if source.known else State.EARLY
        claim = source.claims[peer] = kind.of(source, peer, state, message)
        claim.seq = next(self.books.claim_seq)
        source.accepted += 1
        source.expected = message.parts
        return claim.start(self, now)

    def _refusal(self, peer: str, tid: str, mode: str) -> tuple[str, str] | None:
        """Why a claim on `tid` from `peer` must be refused before looking at it."""
        if self.config.mode != mode:
            return "handshake_failed", f"this producer is in {self.config.mode} mode"
        refused = self.books.refused.get((peer, tid))
        if refused is not None:
            return refused, "this claim was refused before"
        if tid in self.books.tombstones:
            return self.books.tombstones[tid], "the transfer already ended"
        return None

    def _refuse(self, peer: str, tid: str, reason: str, detail: str, now: float) -> list[Action]:
        """Tell `peer` the transfer failed, and keep that promise: nothing more is
        written for `tid` into its blocks, whatever it sends later."""
        failed = Send(peer, Failed(tid, reason, detail))
        claim = self.books.claim_of(tid, peer)
        if claim is not None:
            held = claim.hold_off(reason, detail, failed, cancel=False)
            return held if held is not None else self.books.end(claim, reason, now, True, detail)
        self.books.refused.remember((peer, tid), reason, now + self.config.tombstone_s)
        return [failed]

    def _on_release(self, peer: str, message: Release, now: float) -> list[Action]:
        claim = self.books.claim_of(message.transfer_id, peer)
        if claim is None:
            return [Counted("rejected_messages", {"why": "unexpected_release"})]
        return claim.released(self, now)

    def _on_heartbeat(self, peer: str, message: Heartbeat, now: float) -> list[Action]:
        for tid in message.transfer_ids:
            self.books.heartbeat(peer, tid, now)
        return []

    def _on_cancel(self, peer: str, message: Cancel, now: float) -> list[Action]:
        tid = message.transfer_id
        source = self.books.sources.get(tid)
        ack = Send(peer, CancelAck(tid))
        if source is None:
            # The consumer gave up before we heard of it: free the KV as soon as it exists.
            self.books.tombstone(tid, DECODE_CANCELLED, now)
            return [ack]
        if not source.claims:
            # Unclaimed, it would be held for the whole lease: no claim is coming from here.
            return [ack] + self.books.end(source, DECODE_CANCELLED, now)
        claim = source.claims.get(peer)
        if claim is None:
            return [ack]  # someone else's claim: not yours to end
        held = claim.hold_off(message.reason, "", ack, cancel=True)
        return held if held is not None else [ack] + self.books.end(claim, message.reason, now)

    # -- time ------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        for memory in self.books.memories:
            memory.expire(now)
        actions: list[Action] = []
        for timer, what in self.deadlines.pop_expired(now):
            actions += self._on_timer[timer](what, now)
        return actions

    def next_deadline(self) -> float | None:
        deadlines = [self.deadlines.next_deadline()]
        deadlines += [memory.next_deadline() for memory in self.books.memories]
        return min((d for d in deadlines if d is not None), default=None)

    def _on_silence(self, peer: str, now: float) -> list[Action]:
        """Nothing from `peer` for silence_s. Its link may be broken on its side only:
        it then reuses the blocks it registered here once silence_s (and a WRITE's
        landing time) has passed since it last sent anything, so write nothing more
        into them, and close the link, which ends its transfers as a loss."""
        writable = [
            claim
            for claim in self.books.claims()
            if claim.peer == peer and claim.writes_into_peer()
        ]
        if peer not in self._peers or not writable:
            return []  # a consumer with nothing registered owes us no heartbeats
        detail = f"nothing heard for {self.config.silence_s} s while it had blocks registered"
        actions = self.on_peer_lost(peer, f"silent consumer: {detail}", now)
        return [*actions, Counted("silent_consumers"), Disconnect(peer, detail)]

    # -- endings ---------------------------------------------------------------------

    def abandon(
        self, transfer_id: str, peer: str | None, reason: str, detail: str, now: float
    ) -> list[Action]:
        """The I/O layer could not make the KV readable for `peer`'s claim (a staging
        copy failed): fail that claim before anything reads it."""
        record = self.books.record_of(transfer_id, peer)
        if record is None:
            return []
        return self.books.end(record, reason, now, notify=True, detail=detail)

    # -- inspection (tests, metrics) -------------------------------------------------

    def tracks(self, transfer_id: str) -> bool:
        """Whether the transfer is live here (its KV may still be read for a WRITE)."""
        return transfer_id in self.books.sources

    def counts(self) -> dict[str, int]:
        """How many transfers are in each state (states with none left out)."""
        records = [r for s in self.books.sources.values() for r in self.books.records(s)]
        return dict(collections.Counter(str(record.state) for record in records))

    def holding(self) -> list[str]:
        """Transfers whose KV blocks the producer still holds."""
        return sorted(tid for tid, s in self.books.sources.items() if s.kv_blocks is not None)

    def claimed(self) -> int:
        """How many live claims consumers have made (registered, or asked to read)."""
        return len(self.books.claims())

    def state_of(self, transfer_id: str, peer: str | None = None) -> State | None:
        """The state of `peer`'s claim on the transfer (None: the unclaimed source; a
        transfer claimed by one consumer alone answers for it too)."""
        source = self.books.sources.get(transfer_id)
        if source is None:
            return None
        if peer is not None:
            claim = source.claims.get(peer)
            return claim.state if claim else None
        records = self.books.records(source)
        return records[0].state if len(records) == 1 else None

    def awaiting_reads(self) -> bool:
        """True while a consumer may be reading our blocks (pull)."""
        return any(claim.state in READABLE for claim in self.books.claims())
