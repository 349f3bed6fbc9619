"""The consumer's sessions to producers: dialled, ready, and what waits for one.

A Cancel for a producer whose session is still coming waits here and goes out when
it is up; the time of the last thing sent to each producer is kept, since its
silence rule counts from that.
"""

from __future__ import annotations

from kvpush.layout import KVLayout
from kvpush.protocol.actions import Action, Connect, Send
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer.records import Peer
from kvpush.protocol.messages import Cancel, Hello, Message


class Sessions:
    def __init__(self) -> None:
        self.peers: dict[str, Peer] = {}
        # Peer whose session is still coming -> (transfer id, reason) to cancel there.
        self._held_cancels: dict[str, list[tuple[str, str]]] = {}
        self._last_sent: dict[str, float] = {}  # peer -> when we last sent it anything

    def ready(self, peer: str) -> bool:
        record = self.peers.get(peer)
        return record is not None and record.state == "ready"

    def dial(self, peer: str, engine: str, epoch: str) -> list[Action]:
        """Dial `peer` unless a session to it exists or is coming; only a producer
        that is `engine` in `epoch` (as the transfer that dials it names) gets our
        NIXL metadata."""
        if peer in self.peers:
            return []
        self.peers[peer] = Peer("connecting")
        return [Connect(peer, engine, epoch)]

    def opened(self, peer: str, hello: Hello, layout: KVLayout, now: float) -> list[Action]:
        """The session to `peer` is up: the cancels held for it go out."""
        self.peers[peer] = Peer("ready", hello, layout)
        return [
            self.send(peer, Cancel(tid, reason), now)
            for tid, reason in self._held_cancels.pop(peer, ())
        ]

    def send(self, peer: str, message: Message, now: float) -> Send:
        """A message for the producer at `peer`; its silence rule counts from the last."""
        self._last_sent[peer] = now
        return Send(peer, message)

    def cancel(self, peer: str, transfer_id: str, reason: str, now: float) -> list[Action]:
        """Tell the producer we give the transfer up: now, or once the session to it is
        up. The producer may hold KV for it already, computed or on its way, and with
        no claim or announcement from us it would keep it for its whole lease."""
        if self.ready(peer):
            return [self.send(peer, Cancel(transfer_id, reason), now)]
        if peer in self.peers:  # the session is coming: opened() sends it
            self._held_cancels.setdefault(peer, []).append((transfer_id, reason))
        return []

    def drop(self, peer: str) -> Peer | None:
        """Forget the session to `peer`; what it was."""
        self._held_cancels.pop(peer, None)
        self._last_sent.pop(peer, None)
        return self.peers.pop(peer, None)

    def quiet_after_loss(
        self, peer: str, now: float, by_peer: bool, config: ProtocolConfig, landing: float
    ) -> float:
        """When nothing the producer at `peer` posted can land in our blocks any more,
        after we lost the link to it (`landing`: how long a posted WRITE may take).

        If its end closed the link, it stopped posting then: a WRITE posted just
        before lands within the landing bound. If only our end saw the link break,
        it may not know yet, and keeps writing until its silence rule (or, for a
        producer without one, its registration's end) counts from the last thing
        we sent it.
        """
        if by_peer:
            return now + landing
        hello = self.peers[peer].hello if peer in self.peers else None
        last = self._last_sent.get(peer, now)
        hold = config.registration_ttl_s
        if hello is not None:
            hold = hello.silence_s or hello.registration_ttl_s
        return max(now, last + hold) + landing
