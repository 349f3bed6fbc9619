"""The consumer's books: its parts and requests, and the parts that ended lately.

It finishes a request when its last part ended: one outcome, Delivered or
TransferFailed, and none for a request the engine never gave blocks.
"""

from __future__ import annotations

from kvpush.protocol.actions import Action, Delivered, TransferFailed
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer.moves import Event, State
from kvpush.protocol.consumer.records import Key, Part, Request
from kvpush.protocol.consumer.sessions import Sessions
from kvpush.protocol.memory import Memory
from kvpush.protocol.timers import Deadlines, Timer

# Ended parts remembered so their late messages are not counted as strays.
ENDED_MEMORY = 4096


class Books:
    """Parts by key, requests by transfer id, and how a part ends."""

    def __init__(self, config: ProtocolConfig, deadlines: Deadlines, sessions: Sessions) -> None:
        self.config = config
        self.deadlines = deadlines
        self.sessions = sessions
        self.parts: dict[Key, Part] = {}
        self.requests: dict[str, Request] = {}
        self.ended: Memory[Key, None] = Memory(ENDED_MEMORY)

    def add(self, part: Part) -> Part:
        self.parts[part.key] = part
        self.requests.setdefault(part.transfer_id, Request(set())).keys.add(part.key)
        return part

    def of(self, transfer_id: str) -> list[Part]:
        """The live parts of `transfer_id`."""
        request = self.requests.get(transfer_id)
        return [self.parts[key] for key in request.keys] if request else []

    def forget(self, part: Part) -> None:
        part.fire(Event.END)
        key = part.key
        self.parts.pop(key, None)
        request = self.requests[part.transfer_id]
        request.keys.discard(key)
        if not request.keys and not request.blocks:
            del self.requests[part.transfer_id]  # only announced: no outcome owed
        self.ended.remember(key, None)
        for timer in (Timer.WATCHDOG, Timer.LANDING, Timer.SETTLE):
            self.deadlines.cancel((timer, key))

    def give_up(self, transfer: Part, reason: str, now: float) -> list[Action]:
        """End one part for `reason` (the engine aborted, or another part failed),
        as soon as nothing can write into its blocks any more."""
        if transfer.state == State.CANCELLING:
            return []
        if transfer.state == State.READING:
            transfer.cancel_reason = transfer.cancel_reason or reason  # our own READ ends it
            return []
        cancel = self.sessions.cancel(transfer.peer, transfer.transfer_id, reason, now)
        if transfer.state == State.ANNOUNCED:
            self.forget(transfer)
            return cancel
        if transfer.state in (State.CONNECTING, State.LANDING, State.REQUESTED):
            # Nobody else writes into these blocks (not claimed yet, already written,
            # or pull, where only our own READ would).
            return cancel + self.fail(transfer, now, reason)
        return cancel + self.start_cancel(transfer, reason, now)

    def settle_later(self, transfer: Part, reason: str, now: float) -> list[Action]:
        """Fail the transfer once a WRITE posted into its blocks can no longer land."""
        transfer.fire(Event.MAY_LAND)
        transfer.cancel_reason = reason
        self.deadlines.cancel((Timer.WATCHDOG, transfer.key))
        self.deadlines.cancel((Timer.LANDING, transfer.key))
        self.deadlines.set((Timer.SETTLE, transfer.key), now + self.landing_bound())
        return []

    def start_cancel(self, transfer: Part, reason: str, now: float) -> list[Action]:
        """Hold the blocks until the producer acks, or until it provably cannot write.

        The producer posts WRITEs only while its registration is alive, which ends
        `registration_ttl_s` after the last claim we sent; a WRITE posted just before
        then lands within `write_grace_s`.
        """
        transfer.fire(Event.CANCEL)
        transfer.cancel_reason = reason
        self.deadlines.cancel((Timer.WATCHDOG, transfer.key))
        peer = self.sessions.peers.get(transfer.peer)
        hello = peer.hello if peer else None
        ttl = hello.registration_ttl_s if hello else self.config.registration_ttl_s
        settle = transfer.claimed_at + ttl + self.landing_bound()
        self.deadlines.set((Timer.SETTLE, transfer.key), max(settle, now))
        return []

    def landing_bound(self) -> float:
        """How long after the producer's last chance to post a WRITE it may still land:
        its Node aborts a WRITE after write_grace_s; a heartbeat's worth of margin
        covers the two sides' timer granularity."""
        return self.config.write_grace_s + self.config.heartbeat_s

    def deliver(self, transfer: Part) -> list[Action]:
        """One part's KV landed; the transfer is delivered once every part's has."""
        complete = transfer.complete
        wall = complete.kv_ready_wall if complete else transfer.kv_ready_wall
        request = self.requests[transfer.transfer_id]
        request.kv_ready_wall = max(request.kv_ready_wall, wall)
        self.forget(transfer)
        return self.outcome(transfer.transfer_id, request)

    def fail(self, transfer: Part, now: float, reason: str, detail: str = "") -> list[Action]:
        """One part is over without its KV: the transfer fails, once no other part can
        write into its blocks any more (they are given up now)."""
        request = self.requests[transfer.transfer_id]
        if not request.reason:
            request.reason, request.detail = reason, detail
        self.forget(transfer)
        actions: list[Action] = []
        for other in self.of(transfer.transfer_id):
            actions += self.give_up(other, reason, now)
        return actions + self.outcome(transfer.transfer_id, request)

    def outcome(self, transfer_id: str, request: Request) -> list[Action]:
        """The transfer's one outcome, once its last part ended (none without blocks)."""
        if transfer_id not in self.requests or request.keys:
            return []
        del self.requests[transfer_id]
        if not request.blocks:
            return []
        if request.reason:
            return [TransferFailed(transfer_id, request.reason, request.detail)]
        return [Delivered(transfer_id, request.kv_ready_wall)]
