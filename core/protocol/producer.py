"""The producer (prefill) side of a transfer, as a state machine.

Events come in as method calls with the current time; the returned actions say what
to send, what to WRITE and when the engine may free a request's blocks. No sockets,
threads or clocks: the I/O layer (kvpush.node) does those.

For every transfer whose KV became ready the producer emits exactly one
ReleaseBlocks; it never posts a WRITE into blocks the consumer did not register,
nor after it told the consumer nothing more would come.

KV may become ready layer by layer (`kv_ready(..., layers=k)`: layers 0..k-1 are
computed). Once the consumer has registered, each newly ready run of layers is
written at once, one WRITE per transfer at a time, so by the time the last layer is
computed most of the KV has already crossed; the last WRITE carries the NIXL
notification and is followed by Complete.

With tensor parallelism of different sizes on the two sides, several consumer ranks
may claim one transfer's KV from this rank (each takes the heads it holds; how many
is in their claims). Each claim is a record of its own, keyed (transfer id, peer);
the records of one transfer id form its family, which the engine's events reach
all at once, and whose source blocks go back once, when the last record ends and
no claim the consumers announced is still to come.

One module, past 550 lines, because it is one machine: every event handler beside
the moves it makes (TRANSITIONS is the index), in the order a transfer meets them:
engine reports, claims, WRITEs and grants, heartbeats and timers, and the end.
Splitting it by mode would put one state's ways out in two places.
"""

from __future__ import annotations

import collections
import enum
from collections import OrderedDict
from dataclasses import dataclass

from kvpush.layout import KVLayout, blocks_of, moving_pairs, page_factors, to_pages
from kvpush.protocol.actions import (
    Action,
    ChunkSent,
    Counted,
    Disconnect,
    ExposeBlocks,
    PostWrite,
    ReleaseBlocks,
    ReleaseRefused,
    Send,
)
from kvpush.protocol.config import ProtocolConfig
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
    encode_notif,
)
from kvpush.protocol.states import TransitionTable
from kvpush.protocol.timers import HEARTBEAT, Deadlines, arm_heartbeat

# Final-report memory: far more transfers than can end between two reports of one.
_FINAL_MEMORY = 65536
# The outcome of KV released because a consumer cancelled the transfer before claiming
# it: its decode request ended first (client gone, decode failed), or it needs none
# of the KV (another choice of n > 1 brings the prompt, or decode has it cached).
DECODE_CANCELLED = "decode_cancelled"
# The outcome of KV released on the router's word: the transfer's decode leg failed
# before decode's engine took it (refused, unreachable, its client gone), so no
# consumer will announce or claim it (release_unclaimed).
ROUTER_RELEASED = "router_released"

# A record's key: (transfer id, the consumer peer that claimed it; None until one did).
Key = tuple[str, "str | None"]


@dataclass
class _Peer:
    hello: Hello
    layout: KVLayout

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks


class State(enum.StrEnum):
    """A transfer on the prefill side."""

    COMPUTING = "computing"  # the engine computes its KV; no consumer has claimed it
    HELD = "held"  # all its KV is computed, nobody claimed it yet: kept under a lease
    EARLY = "early"  # claimed before the engine had the request: nothing to heartbeat
    CLAIMED = "claimed"  # a consumer claimed it (push: its blocks; pull: a READ); idle
    WRITING = "writing"  # push: a WRITE is in flight
    CANCELLING = "cancelling"  # the consumer cancelled during a WRITE: ack when it ends
    FAILING = "failing"  # given up on during a WRITE: Failed when it ends
    GRANTED = "granted"  # pull: the consumer may READ the KV under a lease
    ABANDONED = "abandoned"  # a grant given up on: kept while a READ may still copy it
    ENDED = "ended"  # released or never computed (and forgotten)


# Every move a transfer may make; any other is a bug, refused loudly. A transfer with
# a WRITE in flight never ends directly: the WRITE's completion brings it back to
# claimed first, so nothing releases blocks a WRITE is still reading or landing.
TRANSITIONS = TransitionTable(
    "producer",
    {
        State.COMPUTING: {State.HELD, State.CLAIMED, State.ENDED},
        State.HELD: {State.CLAIMED, State.ENDED},
        State.EARLY: {State.CLAIMED, State.ENDED},
        State.CLAIMED: {State.WRITING, State.GRANTED, State.ENDED},
        State.WRITING: {State.CLAIMED, State.CANCELLING, State.FAILING},
        State.CANCELLING: {State.CLAIMED, State.CANCELLING},
        State.FAILING: {State.CLAIMED, State.CANCELLING},
        State.GRANTED: {State.ABANDONED, State.ENDED},
        State.ABANDONED: {State.ENDED},
        State.ENDED: set(),
    },
)

# States with a WRITE in flight: it cannot be recalled, only waited for.
_WRITE_IN_FLIGHT = (State.WRITING, State.CANCELLING, State.FAILING)
# States a consumer's READ may be copying the KV in (pull).
_READABLE = (State.GRANTED, State.ABANDONED)
# States that end on their own terms, whatever the consumer's heartbeats say.
_ENDING = (State.CANCELLING, State.FAILING, State.ABANDONED)
# States whose consumer hears, by our heartbeats, that the KV is still coming.
_HEARTBEATING = (State.CLAIMED, *_WRITE_IN_FLIGHT)
# States that may yet need heartbeats: the round keeps running while any is present.
_MAY_HEARTBEAT = (State.COMPUTING, State.EARLY, *_HEARTBEATING)


@dataclass
class _Family:
    """The records of one transfer id, and what their consumers said to expect."""

    keys: set[Key]
    claims: int = 0  # claims accepted (one per consumer rank)
    expected: int = 1  # claims the consumer ranks said would come (Register.parts)
    outcome: str = ""  # the first failed claim's reason ("" while every claim was sent)
    nbytes: int = 0  # what the ended claims wrote


@dataclass
class _Transfer:
    transfer_id: str
    state: State
    kv_blocks: list[int] | None = None  # source blocks, once any of the KV is computed
    # Before the step that computes the last prompt token (progressive push, one
    # chunk of the prompt per step): leading source blocks complete in every layer,
    # and how many of those are written already.
    blocks_ready: int = 0
    blocks_written: int = 0
    # From that last step on: kv_blocks is the whole list, and its blocks from
    # blocks_written on become ready layer by layer.
    last_step: bool = False
    layers_ready: int = 0  # layers 0..layers_ready-1 are computed
    layers_written: int = 0  # ... and 0..layers_written-1 are written (push)
    writing_upto: int = 0  # the WRITE in flight covers layers up to this one
    writing_blocks: int = 0  # ... or, progressive, leading blocks up to this one
    told_writing: bool = False  # the consumer got Writing (push)
    engine_done: bool = False  # the engine's last report (or its abort) came
    nbytes: int = 0
    kv_ready_wall: float = 0.0
    peer: str | None = None  # the consumer that claimed it
    dst_blocks: list[int] | None = None  # push: registered destinations
    skip_blocks: int = 0  # leading source blocks the consumer holds already
    pull_blocks: int = 0  # pull: blocks the consumer asked for
    reason: str = ""  # cancelling, failing, abandoned: why the transfer ends
    # The producer named it (a sequential orchestrator's leg): unless a consumer
    # announces it, its computed KV is held only orphan_grace_s.
    sequential: bool = False
    announced: bool = False  # a consumer's heartbeat named it before claiming it
    detail: str = ""  # failing: what the consumer is told


# What a record knows of the engine's KV: the same for every claim of one transfer.
_KV_FIELDS = (
    "kv_blocks", "blocks_ready", "last_step", "layers_ready", "engine_done",
    "kv_ready_wall", "sequential", "announced",
)  # fmt: skip


def _key(transfer: _Transfer) -> Key:
    return (transfer.transfer_id, transfer.peer)


class Producer:
    """All transfers of one prefill worker rank."""

    def __init__(
        self,
        config: ProtocolConfig,
        num_layers: int = 1,
        block_tokens: int | None = None,
        null_block: int = -1,
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        # Tokens per block of our KV cache (None: as every peer's, as in models of one).
        self.block_tokens = block_tokens
        self.null_block = null_block  # our layout's (kvpush.layout.moving_pairs)
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[Key, _Transfer] = {}
        self._families: dict[str, _Family] = {}
        self._tombstones: dict[str, str] = {}  # ended transfer id -> why
        self._released: set[str] = set()  # released before the engine's last layer report
        # Transfers whose last-layer report was acted on: the engine may report the
        # last layer twice (the layer's own hook, then the end of the step).
        self._final_seen: OrderedDict[str, None] = OrderedDict()
        self._refused: dict[tuple[str, str], str] = {}  # (peer, id) told Failed -> why
        # Consumers whose heartbeats named a transfer nobody has claimed yet: should
        # every one of them be lost, no claim will come (a retry takes a new id).
        self._announcers: dict[str, set[str]] = {}
        # Transfers whose every announcer was lost (the last ones: a bounded memory).
        self._deserted: OrderedDict[str, None] = OrderedDict()
        self._deadlines = Deadlines()

    # -- sessions --------------------------------------------------------------------

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, now: float) -> list[Action]:
        """A consumer (its KV laid out as `layout`) completed its handshake as `peer`."""
        self._peers[peer] = _Peer(hello, layout)
        self._deadlines.set(("silent", peer), now + self.config.silence_s)
        return []

    def on_peer_lost(self, peer: str, reason: str, now: float) -> list[Action]:
        """The consumer's side channel closed: drop what it claimed, free what it held,
        and hold what only it announced a few heartbeats more, not the whole lease."""
        if self._peers.pop(peer, None) is None:
            return []  # ended already (we dropped it for its silence)
        self._deadlines.cancel(("silent", peer))
        actions: list[Action] = []
        for tid in [t for t, peers in self._announcers.items() if peer in peers]:
            self._announcers[tid].discard(peer)
            if not self._announcers[tid]:
                actions += self._desert(tid, now)
        for transfer in [t for t in list(self._transfers.values()) if t.peer == peer]:
            if transfer.state in _WRITE_IN_FLIGHT:
                # The consumer frees its blocks once this WRITE can no longer land:
                # its completion ends the transfer, and nothing more is written.
                self._fail_after_write(transfer, "peer_lost", reason)
            else:
                actions += self._end(transfer, "peer_lost", now)
        return actions

    def _desert(self, tid: str, now: float) -> list[Action]:
        """Every consumer that announced `tid` is gone: what it waits for will not be
        claimed. Cut an unclaimed record's hold to a few heartbeats."""
        del self._announcers[tid]
        self._deserted[tid] = None
        while len(self._deserted) > _FINAL_MEMORY:
            self._deserted.popitem(last=False)
        self._deadlines.cancel(("claim", tid))
        unclaimed = self._transfers.get((tid, None))
        if unclaimed is not None and unclaimed.state == State.HELD:
            cut = now + self._deserted_hold()
            if cut < (self._deadlines.get(("lease", (tid, None))) or float("inf")):
                self._deadlines.set(("lease", (tid, None)), cut)
        return []

    def _deserted_hold(self) -> float:
        """How long KV whose announcers were all lost is kept: a claim already on its
        way (sent just before the loss) still lands in that."""
        return 2 * self.config.heartbeat_s

    # -- engine events ---------------------------------------------------------------

    def kv_pending(self, transfer_id: str, now: float, sequential: bool = False) -> list[Action]:
        """The engine has the request: registrations for it are worth keeping.
        `sequential`: the producer named the transfer, and the consumer's leg comes
        only once the engine answered (see orphan_grace_s)."""
        records = self._family(transfer_id)
        if not records and transfer_id not in self._tombstones:
            records = [self._new(transfer_id, None, State.COMPUTING)]
            deadline = now + self.config.registration_ttl_s
            self._deadlines.set(("reg", (transfer_id, None)), deadline)
        for transfer in records:
            if transfer.state == State.EARLY:
                TRANSITIONS.move(transfer, State.CLAIMED)
            transfer.sequential = sequential
        arm_heartbeat(self._deadlines, now, self.config.heartbeat_s)
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
            if transfer_id in self._final_seen:
                return [Counted("duplicate_kv_ready")]
            self._final_seen[transfer_id] = None
            while len(self._final_seen) > _FINAL_MEMORY:
                self._final_seen.popitem(last=False)
        if transfer_id in self._released or transfer_id in self._tombstones:
            return self._reported_after_end(transfer_id, final)
        records = self._family(transfer_id) or [self._new(transfer_id, None, State.COMPUTING)]
        if layers <= records[0].layers_ready:
            return [Counted("duplicate_kv_ready")]
        actions: list[Action] = []
        for transfer in records:
            actions += self._kv_ready(transfer, block_ids, now, ready_wall, layers, final)
        return actions

    def _kv_ready(
        self,
        transfer: _Transfer,
        block_ids: list[int],
        now: float,
        ready_wall: float,
        layers: int,
        final: bool,
    ) -> list[Action]:
        if not transfer.last_step:
            transfer.kv_blocks = list(block_ids)  # the whole list now, earlier chunks' too
            transfer.last_step = True
        transfer.layers_ready = layers
        transfer.engine_done = final
        if transfer.state == State.EARLY:
            TRANSITIONS.move(transfer, State.CLAIMED)  # the engine has the request now
        if not final:
            return self._write_more(transfer, now) if transfer.dst_blocks is not None else []
        transfer.kv_ready_wall = ready_wall
        self._deadlines.cancel(("reg", _key(transfer)))
        if transfer.dst_blocks is not None:
            return self._write_more(transfer, now)
        if transfer.peer is not None:
            return self._grant(transfer, now)
        self._hold(transfer, now)
        return []

    def _hold(self, transfer: _Transfer, now: float) -> None:
        """All of the KV is computed and nobody (more) has claimed it: keep it under a
        lease (short for a transfer the producer named, unless a consumer announced it)."""
        transfer_id = transfer.transfer_id
        TRANSITIONS.move(transfer, State.HELD)
        announced = self._deadlines.get(("claim", transfer_id))
        transfer.announced = transfer.announced or announced is not None
        hold = self.config.lease_s
        if transfer.sequential and not transfer.announced:
            hold = min(self.config.orphan_grace_s, hold)
        if transfer_id in self._deserted:
            hold, announced = min(self._deserted_hold(), hold), None
        lease = max(now + hold, announced or 0)
        self._deadlines.cancel(("claim", transfer_id))
        self._deadlines.set(("lease", _key(transfer)), lease)

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
        if transfer_id in self._released or transfer_id in self._tombstones:
            return self._reported_after_end(transfer_id, final=False)
        records = self._family(transfer_id) or [self._new(transfer_id, None, State.COMPUTING)]
        if records[0].last_step:
            return [Counted("duplicate_kv_ready")]
        actions: list[Action] = []
        for transfer in records:
            actions += self._kv_progress(transfer, block_ids, full_blocks, now)
        return actions

    def _kv_progress(
        self, transfer: _Transfer, block_ids: list[int], full_blocks: int, now: float
    ) -> list[Action]:
        transfer.kv_blocks = list(block_ids)  # held now: they go back through us
        if transfer.state == State.EARLY:
            TRANSITIONS.move(transfer, State.CLAIMED)  # the engine has the request now
        full_blocks = min(full_blocks, len(block_ids))
        if full_blocks <= transfer.blocks_ready:
            return []
        transfer.blocks_ready = full_blocks
        if transfer.dst_blocks is None:
            return []
        return self._write_more(transfer, now)

    def _reported_after_end(self, transfer_id: str, final: bool) -> list[Action]:
        """The engine reports KV of a transfer that ended. Its blocks go back once: now,
        if they never came before; the reports after that are ignored until the last
        one (or an abort) ends the story. A tombstone may expire meanwhile: that must not."""
        if transfer_id in self._released:
            if final:
                self._released.discard(transfer_id)
            return []
        if not final:
            self._released.add(transfer_id)
        return [ReleaseBlocks(transfer_id, self._tombstones[transfer_id])]

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine dropped the request (client gone, router cancelled the leg): it
        reports nothing more for it."""
        records = self._family(transfer_id)
        if not records:
            self._released.discard(transfer_id)
            self._tombstone(transfer_id, "aborted", now)
            return []
        actions: list[Action] = []
        for transfer in records:
            transfer.engine_done = True
            if transfer.state in _WRITE_IN_FLIGHT:
                self._fail_after_write(transfer, "aborted", "the prefill request was aborted")
            else:
                actions += self._end(transfer, "aborted", now, notify=True)
        return actions

    def release_unclaimed(self, transfer_id: str, now: float) -> list[Action]:
        """The router says no consumer will come for the transfer: its decode leg
        failed before decode's engine took it. Free the KV now rather than at the end
        of its lease, unless a consumer claimed or announced it (the router may be
        wrong about a leg that reached decode after all: that consumer's word wins)."""
        records = self._family(transfer_id)
        if not records:
            return [ReleaseRefused(transfer_id, "ended" if transfer_id in self._tombstones
                                   else "unknown")]  # fmt: skip
        if any(transfer.peer is not None for transfer in records):
            return [ReleaseRefused(transfer_id, "claimed")]
        (transfer,) = records
        deserted = transfer_id in self._deserted  # its announcers were all lost
        if transfer_id in self._announcers or (transfer.announced and not deserted):
            return [ReleaseRefused(transfer_id, "announced")]
        return self._end(transfer, ROUTER_RELEASED, now)

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
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None or transfer.state not in _WRITE_IN_FLIGHT:
            return [Counted("unexpected_write_completion")]
        ended_as = transfer.state
        TRANSITIONS.move(transfer, State.CLAIMED)  # nothing is in flight any more
        if ended_as == State.CANCELLING:
            outcome = transfer.reason
            message: Message = CancelAck(transfer_id, may_land)
        elif ended_as == State.FAILING:
            outcome = transfer.reason
            message = Failed(transfer_id, outcome, transfer.detail, may_land)
        elif not ok:
            outcome = "write_failed"
            message = Failed(transfer_id, outcome, detail, may_land)
        else:
            transfer.nbytes += nbytes
            if transfer.writing_blocks:
                transfer.blocks_written, transfer.writing_blocks = transfer.writing_blocks, 0
                return [ChunkSent(transfer_id, nbytes), *self._write_more(transfer, now)]
            transfer.layers_written = transfer.writing_upto
            if transfer.layers_written < self.num_layers:
                return self._write_more(transfer, now)
            outcome = "sent"
            notif = encode_notif(transfer_id, transfer.kv_ready_wall)
            message = Complete(transfer_id, notif, transfer.nbytes, transfer.kv_ready_wall)
        peer = transfer.peer
        actions: list[Action] = [Send(peer, message)] if peer in self._peers else []
        return actions + self._end(transfer, outcome, now)

    # -- messages --------------------------------------------------------------------

    def on_message(self, peer: str, message: Message, now: float) -> list[Action]:
        if peer not in self._peers:
            return [Counted("rejected_messages", {"why": "no_session"})]
        self._deadlines.set(("silent", peer), now + self.config.silence_s)
        if isinstance(message, Register):
            return self._on_register(peer, message, now)
        if isinstance(message, PullRequest):
            return self._on_pull_request(peer, message, now)
        if isinstance(message, Release):
            return self._on_release(peer, message, now)
        if isinstance(message, Heartbeat):
            return self._on_heartbeat(peer, message, now)
        if isinstance(message, Cancel):
            return self._on_cancel(peer, message, now)
        return [Counted("rejected_messages", {"why": f"unexpected_{type(message).__name__}"})]

    def _on_register(self, peer: str, message: Register, now: float) -> list[Action]:
        tid = message.transfer_id
        refusal = self._refusal(peer, tid, "push")
        if refusal is None:
            problem = self._check_destinations(peer, message)
            refusal = ("bad_blocks", problem) if problem else None
        transfer = self._transfers.get((tid, peer))
        destinations = message.block_ids[0]
        if refusal is None and transfer is not None:
            if transfer.dst_blocks == destinations:
                return [Counted("duplicate_registrations")]
            refusal = ("conflict", "this consumer claimed the transfer for other blocks")
        refusal = refusal or self._claim_refusal(tid, message.parts)
        if refusal is not None:
            return self._refuse(peer, tid, *refusal, now)
        transfer = self._claim(tid, peer, message.parts)
        transfer.dst_blocks = list(destinations)
        transfer.skip_blocks = message.skip_blocks
        self._deadlines.set(("reg", (tid, peer)), now + self.config.registration_ttl_s)
        # The consumer hears from us while prefill computes.
        arm_heartbeat(self._deadlines, now, self.config.heartbeat_s)
        if transfer.kv_blocks is not None:
            return self._write_more(transfer, now)
        return []

    def _claim_refusal(self, tid: str, parts: int) -> tuple[str, str] | None:
        """Why one more consumer may not claim `tid`, which `parts` consumer ranks in all
        claim from here (checked after the claimant's own earlier claim)."""
        family = self._families.get(tid)
        if family is None or family.claims == 0:
            return None
        if parts != family.expected:
            return "conflict", (
                f"the claims disagree on how many consumer ranks take this KV from this "
                f"rank ({family.expected} before, {parts} now)"
            )
        if family.claims >= family.expected:
            return "conflict", "the transfer id is already claimed"
        return None

    def _claim(self, tid: str, peer: str, parts: int) -> _Transfer:
        """Bind `tid` to the consumer at `peer`, one of `parts` consumer ranks that take
        its KV from here, whether or not the engine has it yet."""
        family = self._families.get(tid)
        unclaimed = self._transfers.get((tid, None))
        if unclaimed is not None:
            transfer = self._rekey(unclaimed, peer)
            TRANSITIONS.move(transfer, State.CLAIMED)
        elif family is not None and family.keys:
            # Another consumer rank claimed it first: this claim starts from the same KV.
            sibling = self._transfers[next(iter(family.keys))]
            transfer = self._new(tid, peer, State.EARLY if sibling.state == State.EARLY
                                 else State.CLAIMED)  # fmt: skip
            for name in _KV_FIELDS:
                setattr(transfer, name, getattr(sibling, name))
            if transfer.kv_blocks is not None:
                transfer.kv_blocks = list(transfer.kv_blocks)
        else:
            transfer = self._new(tid, peer, State.EARLY)
        family = self._families[tid]
        family.claims += 1
        family.expected = parts
        return transfer

    def _new(self, tid: str, peer: str | None, state: State) -> _Transfer:
        """A new record of `tid`, in its family."""
        transfer = self._transfers[(tid, peer)] = _Transfer(tid, state, peer=peer)
        self._families.setdefault(tid, _Family(set())).keys.add((tid, peer))
        return transfer

    def _rekey(self, transfer: _Transfer, peer: str) -> _Transfer:
        """The unclaimed record of a transfer, now the record of `peer`'s claim."""
        old = _key(transfer)
        del self._transfers[old]
        for kind in ("lease", "reg"):
            self._deadlines.cancel((kind, old))
        transfer.peer = peer
        self._transfers[_key(transfer)] = transfer
        keys = self._families[transfer.transfer_id].keys
        keys.discard(old)
        keys.add(_key(transfer))
        return transfer

    def _family(self, transfer_id: str) -> list[_Transfer]:
        """Every live record of `transfer_id`."""
        family = self._families.get(transfer_id)
        return [self._transfers[key] for key in family.keys] if family else []

    def _refusal(self, peer: str, tid: str, mode: str) -> tuple[str, str] | None:
        """Why a claim on `tid` from `peer` must be refused before looking at it."""
        if self.config.mode != mode:
            return "handshake_failed", f"this producer is in {self.config.mode} mode"
        if (peer, tid) in self._refused:
            return self._refused[(peer, tid)], "this claim was refused before"
        if tid in self._tombstones:
            return self._tombstones[tid], "the transfer already ended"
        return None

    def _refuse(self, peer: str, tid: str, reason: str, detail: str, now: float) -> list[Action]:
        """Tell `peer` the transfer failed, and keep that promise: nothing more is
        written for `tid` into its blocks, whatever it sends later."""
        transfer = self._transfers.get((tid, peer))
        if transfer is not None:
            if transfer.state in _WRITE_IN_FLIGHT:
                self._fail_after_write(transfer, reason, detail)
                return []  # Failed goes out when the WRITE in flight is over
            if transfer.state in _READABLE:
                return [Send(peer, Failed(tid, reason, detail))] + self._hold_grant(
                    transfer, reason
                )
            return self._end(transfer, reason, now, notify=True, detail=detail)
        self._refused[(peer, tid)] = reason
        self._deadlines.set(("refused", (peer, tid)), now + self.config.tombstone_s)
        return [Send(peer, Failed(tid, reason, detail))]

    def _check_destinations(self, peer: str, message: Register) -> str | None:
        consumer = self._peers[peer]
        if message.layout_digest != consumer.layout.digest():
            return "the registration names a KV layout other than the one in the handshake"
        if len(message.block_ids) != 1:
            return f"{len(message.block_ids)} KV cache groups; one is supported"
        _, pages = self._factors(peer)
        count = consumer.num_blocks * pages
        bad = [b for b in message.block_ids[0] if b >= count]
        if bad:
            what = "block" if pages == 1 else f"page ({pages} a block)"
            return f"{what} ids {bad[:8]} out of range: the consumer has {count}"
        real = [b for b in message.block_ids[0] if b != consumer.layout.null_block]
        if len(set(real)) != len(real):
            return "a destination block appears twice"
        if message.block_ids[0] and message.block_ids[0][-1] == consumer.layout.null_block:
            return "the last destination is the null block (no window leaves the prompt's end)"
        return None

    def _factors(self, peer: str) -> tuple[int, int]:
        """Pages per block, ours and the consumer's at `peer`: with different block sizes
        a pair counts blocks in pages of the smaller (ids on the wire are page ids)."""
        theirs = self._peers[peer].layout.tokens_per_block
        return page_factors(self.block_tokens or theirs, theirs)

    def _sources(self, transfer: _Transfer) -> list[int]:
        """The KV's pages, after those the consumer holds already."""
        assert transfer.kv_blocks is not None and transfer.peer is not None
        ours, _ = self._factors(transfer.peer)
        return to_pages(transfer.kv_blocks, ours)[transfer.skip_blocks :]

    def _fits(self, transfer: _Transfer, wanted: int, held: int) -> int | None:
        """How many of `wanted` pages the consumer gets from `held`, or None when it
        wants KV we do not have. Its last block may reach past our last page by less
        than a block of its own: tokens the prompt does not have."""
        assert transfer.peer is not None
        _, theirs = self._factors(transfer.peer)
        return min(wanted, held) if wanted - held < theirs else None

    def _write_more(self, transfer: _Transfer, now: float) -> list[Action]:
        """Post the next WRITE, if none is in flight: before the last step, the complete
        blocks not yet written; from it on, every ready layer of the rest."""
        assert transfer.kv_blocks is not None and transfer.dst_blocks is not None
        if transfer.state in _WRITE_IN_FLIGHT:
            return []  # its completion posts what became ready meanwhile
        all_ready = transfer.layers_ready == self.num_layers
        self._deadlines.cancel(("lease", _key(transfer)))
        if all_ready:
            self._deadlines.cancel(("reg", _key(transfer)))
        sources = self._sources(transfer)
        destinations = transfer.dst_blocks
        if not transfer.last_step:
            return self._write_complete_blocks(transfer, sources, destinations)
        fits = self._fits(transfer, len(destinations), len(sources))
        if fits is None:
            detail = (
                f"{len(destinations)} destination blocks for {len(sources)} source blocks "
                f"(after skipping {transfer.skip_blocks})"
            )
            return self._end(transfer, "bad_blocks", now, notify=True, detail=detail)
        destinations = destinations[:fits]
        start = min(transfer.blocks_written, len(destinations))
        if start == len(destinations) or transfer.layers_written == self.num_layers:
            if not all_ready:
                return []
            # Nothing (more) to move: decode holds every block in its prefix cache, or
            # earlier steps' WRITEs moved them all.
            complete = Complete(transfer.transfer_id, b"", transfer.nbytes, transfer.kv_ready_wall)
            return [Send(transfer.peer, complete)] + self._end(transfer, "sent", now)
        if transfer.layers_written == transfer.layers_ready:
            return []
        TRANSITIONS.move(transfer, State.WRITING)
        transfer.writing_upto = transfer.layers_ready
        # Never empty: the last position is inside every window, on both sides.
        src, dst = self._moving(transfer, sources[start : len(destinations)], destinations[start:])
        return self._post(
            transfer,
            PostWrite(
                transfer.transfer_id,
                transfer.peer,
                src,
                dst,
                encode_notif(transfer.transfer_id, transfer.kv_ready_wall) if all_ready else b"",
                (transfer.layers_written, transfer.layers_ready),
            ),
        )

    def _write_complete_blocks(
        self, transfer: _Transfer, sources: list[int], destinations: list[int]
    ) -> list[Action]:
        """Progressive push: WRITE every layer of the blocks earlier steps completed.
        Blocks decode holds already (skip_blocks) are not sources; a block past the
        consumer's last is not either (the last step checks that count). The WRITE
        that fills decode's last block carries the notification: decode has all it
        asked for then, even if prefill has more to compute."""
        ours, _ = self._factors(transfer.peer)
        upto = min(transfer.blocks_ready * ours - transfer.skip_blocks, len(destinations))
        if upto <= transfer.blocks_written:
            return []
        start = transfer.blocks_written
        last = upto == len(destinations)
        src, dst = self._moving(transfer, sources[start:upto], destinations[start:upto])
        if not src:
            transfer.blocks_written = upto  # positions a sliding window left: no bytes
            return []
        TRANSITIONS.move(transfer, State.WRITING)
        transfer.writing_blocks = upto
        return self._post(
            transfer,
            PostWrite(
                transfer.transfer_id,
                transfer.peer,
                src,
                dst,
                encode_notif(transfer.transfer_id, 0.0) if last else b"",
                (0, self.num_layers),
            ),
        )

    def _moving(
        self, transfer: _Transfer, sources: list[int], destinations: list[int]
    ) -> tuple[list[int], list[int]]:
        """The pairs that move bytes (not a null block on either side)."""
        assert transfer.peer is not None
        theirs = self._peers[transfer.peer].layout.null_block
        return moving_pairs(sources, destinations, self.null_block, theirs)

    def _post(self, transfer: _Transfer, write: PostWrite) -> list[Action]:
        """The WRITE; before a transfer's first, Writing to the consumer."""
        if transfer.told_writing:
            return [write]
        transfer.told_writing = True
        return [Send(write.peer, Writing(transfer.transfer_id)), write]

    def _fail_after_write(self, transfer: _Transfer, reason: str, detail: str) -> None:
        """The transfer is over, but its WRITE in flight cannot be recalled: say
        Failed once that WRITE is. A cancel already under way says it first."""
        if transfer.state == State.WRITING:
            TRANSITIONS.move(transfer, State.FAILING)
            transfer.reason, transfer.detail = reason, detail

    def _on_pull_request(self, peer: str, message: PullRequest, now: float) -> list[Action]:
        tid = message.transfer_id
        refusal = self._refusal(peer, tid, "pull")
        transfer = self._transfers.get((tid, peer))
        if refusal is None and transfer is not None:
            asked = (message.num_blocks, message.skip_blocks)
            if (transfer.pull_blocks, transfer.skip_blocks) == asked:
                return [Counted("duplicate_pull_requests")]
            refusal = ("conflict", "this consumer claimed the transfer for other blocks")
        if refusal is None and message.num_blocks <= 0:
            refusal = ("bad_blocks", "a pull must ask for at least a block")
        refusal = refusal or self._claim_refusal(tid, message.parts)
        if refusal is not None:
            return self._refuse(peer, tid, *refusal, now)
        transfer = self._claim(tid, peer, message.parts)
        transfer.pull_blocks = message.num_blocks
        transfer.skip_blocks = message.skip_blocks
        if transfer.layers_ready == self.num_layers:
            return self._grant(transfer, now)
        self._deadlines.set(("reg", (tid, peer)), now + self.config.registration_ttl_s)
        return []

    def _grant(self, transfer: _Transfer, now: float) -> list[Action]:
        sources = self._sources(transfer)
        fits = self._fits(transfer, transfer.pull_blocks, len(sources))
        if fits is None:
            detail = (
                f"{transfer.pull_blocks} blocks asked after skipping {transfer.skip_blocks}, "
                f"{len(sources)} held after it"
            )
            return self._end(transfer, "bad_blocks", now, notify=True, detail=detail)
        TRANSITIONS.move(transfer, State.GRANTED)
        self._deadlines.cancel(("reg", _key(transfer)))
        self._deadlines.set(("lease", _key(transfer)), now + self.config.lease_s)
        # The consumer holds the first blocks already (prefix cache): grant the rest.
        pages = sources[:fits]
        grant = Grant(transfer.transfer_id, [pages], self.config.lease_s)
        ours, _ = self._factors(transfer.peer)
        return [
            ExposeBlocks(transfer.transfer_id, blocks_of(pages, ours), transfer.peer),
            Send(transfer.peer, grant),
        ]

    def _hold_grant(self, transfer: _Transfer, reason: str) -> list[Action]:
        """A granted transfer is abandoned, but a READ may still be copying its blocks:
        keep them until the consumer's Release or the lease's end, renewing nothing."""
        if transfer.state == State.GRANTED:
            TRANSITIONS.move(transfer, State.ABANDONED)
            transfer.reason = reason
        return []

    def _on_release(self, peer: str, message: Release, now: float) -> list[Action]:
        transfer = self._transfers.get((message.transfer_id, peer))
        if transfer is None or transfer.state not in _READABLE:
            return [Counted("rejected_messages", {"why": "unexpected_release"})]
        outcome = transfer.reason if transfer.state == State.ABANDONED else "sent"
        return self._end(transfer, outcome, now)

    def _on_heartbeat(self, peer: str, message: Heartbeat, now: float) -> list[Action]:
        for tid in message.transfer_ids:
            records = self._family(tid)
            if not records:
                if tid not in self._tombstones:
                    # A consumer already waits for KV this engine has not produced yet.
                    self._deadlines.set(("claim", tid), now + self.config.lease_s)
                    self._announced_by(tid, peer)
                continue
            for transfer in records:
                if transfer.peer not in (None, peer) or transfer.state in _ENDING:
                    continue
                transfer.announced = True
                if transfer.peer is None:
                    self._announced_by(tid, peer)
                key = _key(transfer)
                self._deadlines.extend(("lease", key), now + self.config.lease_s)
                self._deadlines.extend(("reg", key), now + self.config.registration_ttl_s)
        return []

    def _announced_by(self, tid: str, peer: str) -> None:
        self._announcers.setdefault(tid, set()).add(peer)
        self._deserted.pop(tid, None)

    def _on_cancel(self, peer: str, message: Cancel, now: float) -> list[Action]:
        tid = message.transfer_id
        transfer = self._transfers.get((tid, peer)) or self._transfers.get((tid, None))
        ack = Send(peer, CancelAck(tid))
        if transfer is None and self._family(tid):
            return [ack]  # someone else's claim: not yours to end
        if transfer is None:
            # The consumer gave up before we heard of it: free the KV as soon as it exists.
            self._tombstone(tid, DECODE_CANCELLED, now)
            return [ack]
        if transfer.state in _READABLE:
            return [ack] + self._hold_grant(transfer, message.reason)
        if transfer.state in _WRITE_IN_FLIGHT:
            # The WRITE cannot be recalled; the ack goes out when it is over.
            TRANSITIONS.move(transfer, State.CANCELLING)
            transfer.reason = message.reason
            return []
        # Unclaimed, it would be held for the whole lease: no claim is coming from here.
        outcome = DECODE_CANCELLED if transfer.peer is None else message.reason
        return [ack] + self._end(transfer, outcome, now)

    # -- time ------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for kind, what in self._deadlines.pop_expired(now):
            if kind == "tomb":
                self._tombstones.pop(what, None)
            elif kind == "refused":
                self._refused.pop(what, None)
            elif kind == "heartbeat":
                actions += self._heartbeats(now)
            elif kind == "claim":  # announced, never produced: forget who announced it
                self._announcers.pop(what, None)
            elif kind == "silent":
                actions += self._on_silence(what, now)
            elif kind in ("lease", "reg") and what in self._transfers:  # a record's key
                actions += self._expire(self._transfers[what], kind, now)
        return actions

    def _on_silence(self, peer: str, now: float) -> list[Action]:
        """Nothing from `peer` for silence_s. Its link may be broken on its side only:
        it then reuses the blocks it registered here once silence_s (and a WRITE's
        landing time) has passed since it last sent anything, so write nothing more
        into them, and close the link, which ends its transfers as a loss."""
        writable = [
            t for t in self._transfers.values()
            if t.peer == peer and t.dst_blocks is not None and t.state not in _ENDING
        ]  # fmt: skip
        if peer not in self._peers or not writable:
            return []  # a consumer with nothing registered owes us no heartbeats
        detail = f"nothing heard for {self.config.silence_s} s while it had blocks registered"
        actions = self.on_peer_lost(peer, f"silent consumer: {detail}", now)
        return [*actions, Counted("silent_consumers"), Disconnect(peer, detail)]

    def _expire(self, transfer: _Transfer, kind: str, now: float) -> list[Action]:
        reason = "lease_expired" if kind == "lease" else "registration_expired"
        if kind == "lease" and transfer.state == State.HELD and not transfer.announced:
            reason = "orphaned" if transfer.sequential else reason
        if transfer.state in _WRITE_IN_FLIGHT:
            self._fail_after_write(transfer, reason, "")
            return []
        if transfer.state == State.COMPUTING:
            # Nobody claimed it yet and the engine still works on it: keep waiting.
            self._deadlines.set(("reg", _key(transfer)), now + self.config.registration_ttl_s)
            return []
        if transfer.state == State.ABANDONED:
            # The consumer was told when it was abandoned; only the blocks are left.
            return self._end(transfer, transfer.reason, now)
        return self._end(transfer, reason, now, notify=True)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    def _heartbeats(self, now: float) -> list[Action]:
        """Tell each consumer which of its claims are still being computed or written."""
        waiting: dict[str, list[str]] = {}
        for transfer in self._transfers.values():
            if transfer.state in _HEARTBEATING and transfer.peer in self._peers:
                waiting.setdefault(transfer.peer, []).append(transfer.transfer_id)
        if any(t.state in _MAY_HEARTBEAT for t in self._transfers.values()):
            self._deadlines.set(HEARTBEAT, now + self.config.heartbeat_s)
        return [Send(peer, Heartbeat(tids)) for peer, tids in waiting.items()]

    # -- endings ---------------------------------------------------------------------

    def _end(
        self, transfer: _Transfer, outcome: str, now: float, notify: bool = False, detail: str = ""
    ) -> list[Action]:
        """Forget the record, telling its consumer if asked; free the KV (once) when it
        was the family's last, and no claim the consumers announced is still to come."""
        TRANSITIONS.move(transfer, State.ENDED)
        tid, key = transfer.transfer_id, _key(transfer)
        self._transfers.pop(key, None)
        for kind in ("lease", "reg"):
            self._deadlines.cancel((kind, key))
        actions: list[Action] = []
        if notify and transfer.peer in self._peers:
            actions.append(Send(transfer.peer, Failed(tid, outcome, detail)))
        family = self._families[tid]
        family.keys.discard(key)
        family.nbytes += transfer.nbytes
        if outcome != "sent" and transfer.peer is not None:
            family.outcome = family.outcome or outcome
        if family.keys:
            return actions  # another consumer rank's claim still uses the KV
        if outcome == "sent" and family.claims < family.expected and not family.outcome:
            # Another consumer rank will claim this KV: keep it for that one.
            rest = self._new(tid, None, State.COMPUTING)
            for name in _KV_FIELDS:
                setattr(rest, name, getattr(transfer, name))
            rest.announced = True  # a consumer of this transfer exists
            self._hold(rest, now)
            return actions
        del self._families[tid]
        self._deadlines.cancel(("claim", tid))
        self._announcers.pop(tid, None)
        self._deserted.pop(tid, None)
        outcome = family.outcome or outcome
        self._tombstone(tid, outcome if outcome != "sent" else "completed", now)
        if transfer.kv_blocks is not None:
            if not transfer.engine_done:
                self._released.add(tid)  # more reports will come: ignore them
            actions.append(ReleaseBlocks(tid, outcome, family.nbytes))
        return actions

    def _tombstone(self, transfer_id: str, why: str, now: float) -> None:
        self._tombstones[transfer_id] = why
        self._deadlines.set(("tomb", transfer_id), now + self.config.tombstone_s)

    # -- inspection (tests, metrics) -------------------------------------------------

    def abandon(
        self, transfer_id: str, peer: str | None, reason: str, detail: str, now: float
    ) -> list[Action]:
        """The I/O layer could not make the KV readable for `peer`'s claim (a staging
        copy failed): fail that claim before anything reads it."""
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None:
            return []
        return self._end(transfer, reason, now, notify=True, detail=detail)

    def tracks(self, transfer_id: str) -> bool:
        """Whether the transfer is live here (its KV may still be read for a WRITE)."""
        return transfer_id in self._families

    def counts(self) -> dict[str, int]:
        """How many transfers are in each state (states with none left out)."""
        return dict(collections.Counter(str(t.state) for t in self._transfers.values()))

    def holding(self) -> list[str]:
        """Transfers whose KV blocks the producer still holds."""
        return sorted({t.transfer_id for t in self._transfers.values() if t.kv_blocks is not None})

    def claimed(self) -> int:
        """How many live claims consumers have made (registered, or asked to read)."""
        return sum(1 for t in self._transfers.values() if t.peer is not None)

    def state_of(self, transfer_id: str, peer: str | None = None) -> State | None:
        """The state of `peer`'s claim on the transfer (None: the unclaimed record; a
        transfer claimed by one consumer alone answers for it too)."""
        transfer = self._transfers.get((transfer_id, peer))
        if transfer is None and peer is None and len(self._family(transfer_id)) == 1:
            (transfer,) = self._family(transfer_id)
        return transfer.state if transfer else None

    def awaiting_reads(self) -> bool:
        """True while a consumer may be reading our blocks (pull)."""
        return any(t.state in _READABLE for t in self._transfers.values())
