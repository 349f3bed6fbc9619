"""Links: the side-channel connections to peers, from dialing to a paired NIXL peer.

A link is dialled (consumers dial producers) or accepted (producers listen), then
authenticated and handshaken; once the peer has proved it holds the deployment's
secret, the two exchange their KV layouts and NIXL metadata and the data path pairs
them. Only then do protocol messages flow. What happens to a link is reported to the
Node through LinkEvents; the Node feeds it to the protocol machines.

Before a peer's hello has checked out against the secret, what it may send is
bounded: frames of PRE_AUTH_FRAME bytes, HANDSHAKE_S from connect to paired, and at
most MAX_UNPAIRED such links at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpush.errors import KVPushError, ProtocolError
from kvpush.layout import KVLayout
from kvpush.node.datapath import DataPath
from kvpush.node.interpreter import MetricsSink
from kvpush.protocol.auth import Session
from kvpush.protocol.handshake import layout_problem, pairing_problem, unexpected_producer
from kvpush.protocol.messages import AgentMetadata, Hello, Message, Reject, Verify
from kvpush.transport.channel import MAX_FRAME, Connection, connect
from kvpush.transport.loop import Loop, TimerHandle

log = logging.getLogger(__name__)

PRE_AUTH_FRAME = 4096  # bytes: a hello (no layout in it) and a refusal fit
HANDSHAKE_S = 10.0  # connect to paired, or the link is dropped
MAX_UNPAIRED = 64  # links mid-handshake at once; further ones are turned away


class LinkEvents(Protocol):
    """What a link reports. `outgoing`: we dialled it (we are the consumer side)."""

    def on_ready(self, peer: str, hello: Hello, layout: KVLayout, outgoing: bool) -> None: ...

    def on_message(self, peer: str, message: Message, outgoing: bool) -> None: ...

    def on_lost(
        self, peer: str, reason: str, outgoing: bool, was_ready: bool, by_peer: bool = False
    ) -> None: ...


@dataclass
class _Link:
    """One side-channel connection and how far its handshake got."""

    peer: str  # the machines' name for it: "host:port" outgoing, "c<n>" incoming
    conn: Connection
    session: Session
    outgoing: bool
    # Outgoing: the producer engine and boot the transfer that made us dial names
    # ("" for either: any); only such a producer gets our NIXL metadata.
    expected: tuple[str, str] = ("", "")
    ready: bool = False
    hello: Hello | None = None
    # Handshake: "hello" (waiting for the peer's), then the initiator waits for
    # "verify" and both for "metadata"; ready once NIXL is paired.
    stage: str = "hello"
    deadline: TimerHandle | None = None


class Links:
    """Every side-channel connection of one Node; runs on its loop thread."""

    def __init__(
        self,
        loop: Loop,
        data: DataPath,
        events: LinkEvents,
        my_hello: Callable[[Session], Hello],
        secret: bytes,
        metrics: MetricsSink,
        connect_timeout_s: float,
        handshake_s: float = HANDSHAKE_S,
        link_timeout_s: float | None = None,
    ) -> None:
        self.loop = loop
        self.data = data
        self.events = events
        self._my_hello = my_hello  # ours, under that session's nonce
        self.secret = secret
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self.handshake_s = handshake_s
        self.link_timeout_s = link_timeout_s  # a peer silent this long is gone
        self._links: dict[str, _Link] = {}
        self._dialling: dict[str, tuple[str, str]] = {}
        self._next_conn = 0
        self.closed = False

    def ready_peers(self) -> list[str]:
        return sorted(peer for peer, link in self._links.items() if link.ready)

    def send(self, peer: str, message: Message) -> None:
        """Send a protocol message; dropped if the link is gone or not yet paired."""
        link = self._links.get(peer)
        if link is not None and link.ready:
            self._send(link, message)

    def connect(self, peer: str, engine: str = "", epoch: str = "") -> None:
        """Dial a producer off the loop thread, so an unreachable host never stalls it.
        Our memory opens to it only if it is engine `engine` in boot `epoch` (when
        given)."""
        host, _, port = peer.rpartition(":")
        self._dialling[peer] = (engine, epoch)

        def dial() -> None:
            try:
                sock = connect(host, int(port), self.connect_timeout_s)
            except (KVPushError, ValueError) as exc:
                self.loop.call_soon(self._unreachable, peer, f"connect failed: {exc}")
                return
            if not self.loop.call_soon(self._attach, peer, sock, True):
                sock.close()  # the node closed while we dialled

        threading.Thread(target=dial, name=f"kvpush-dial-{peer}", daemon=True).start()

    def disconnect(self, peer: str, reason: str) -> None:
        """Close the link to `peer`; its loss is reported as any closed link's."""
        link = self._links.get(peer)
        if link is not None:
            log.warning("kvpush: closing the link to %s: %s", peer, reason)
            self.loop.call_soon(link.conn.close, reason)

    def accept(self, sock: Any) -> None:
        """The listener's callback for a producer's incoming connection."""
        self._next_conn += 1
        self._attach(f"c{self._next_conn}", sock, False)

    def close(self) -> None:
        self.closed = True
        for link in list(self._links.values()):
            link.conn.close("shutting down")

    def _attach(self, peer: str, sock: Any, outgoing: bool) -> None:
        expected = self._dialling.pop(peer, ("", ""))
        if self.closed:
            sock.close()
            return
        unpaired = sum(not link.ready for link in self._links.values())
        if unpaired >= MAX_UNPAIRED:
            # Counted before the close, so whoever sees the close sees the count.
            self.metrics.inc("rejected_links", why="too_many_unpaired")
            sock.close()
            if outgoing:
                self._unreachable(peer, f"{unpaired} links are mid-handshake already")
            return
        session = Session(self.secret, initiator=outgoing, nonce=os.urandom(16))
        conn = Connection(
            self.loop,
            sock,
            self._on_frame,
            self._on_close,
            label=peer,
            max_frame=PRE_AUTH_FRAME,
            dead_after_s=self.link_timeout_s,
        )
        link = self._links[peer] = _Link(peer, conn, session, outgoing, expected)
        link.deadline = self.loop.call_later(self.handshake_s, lambda: self._too_slow(link))
        if outgoing:
            self._send(link, self._my_hello(session))

    def _too_slow(self, link: _Link) -> None:
        if not link.ready and self._links.get(link.peer) is link:
            self.metrics.inc("rejected_links", why="handshake_deadline")
            self._refuse(link, f"no completed handshake within {self.handshake_s:g}s")

    def _on_frame(self, conn: Connection, frame: bytes) -> None:
        link = self._links.get(conn.label)
        if link is None or link.conn is not conn:
            return
        try:
            message = link.session.open(frame)
        except ProtocolError as exc:
            why = "auth" if type(exc).__name__ == "AuthError" else "malformed"
            self.metrics.inc("rejected_messages", why=why)
            log.warning("kvpush: rejected a message from %s: %s", link.peer, exc)
            if not link.ready:
                self._refuse(link, f"handshake message refused: {exc}")
            return
        if link.ready:
            self.events.on_message(link.peer, message, link.outgoing)
        else:
            self._handshake(link, message)

    def _handshake(self, link: _Link, message: Message) -> None:
        """Hellos first; layouts and NIXL metadata (which open our memory to the
        peer) only once the peer has proved, under this session's keys, that it holds
        the secret:

            initiator -> acceptor   Hello
            acceptor  -> initiator  Hello, Verify
            initiator -> acceptor   AgentMetadata (its layout and NIXL metadata)
            acceptor  -> initiator  AgentMetadata
        """
        if isinstance(message, Reject):
            self._refuse(link, f"the peer refused to pair: {message.reason}", tell=False)
            return
        expected = {"hello": Hello, "verify": Verify, "metadata": AgentMetadata}[link.stage]
        if not isinstance(message, expected):
            got = type(message).__name__
            self._refuse(link, f"expected {expected.__name__} in the handshake, got {got}")
            return
        if isinstance(message, Hello):
            self._on_hello(link, message)
        elif isinstance(message, Verify):
            link.stage = "metadata"
            self._send(link, self._my_metadata())
        else:
            self._on_metadata(link, message)

    def _on_hello(self, link: _Link, hello: Hello) -> None:
        mine = self._my_hello(link.session)
        problem = pairing_problem(mine, hello)
        if problem is None and link.outgoing:
            problem = unexpected_producer(hello, *link.expected)
        if problem is not None:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, problem)
            return
        # Its hello checked out against the secret: metadata-sized frames may follow.
        link.conn.max_frame = MAX_FRAME
        link.hello = hello
        if link.outgoing:
            link.stage = "verify"
            return
        self._send(link, mine)
        self._send(link, Verify())
        link.stage = "metadata"

    def _on_metadata(self, link: _Link, message: AgentMetadata) -> None:
        hello = link.hello
        assert hello is not None
        problem = layout_problem(
            self.data.kv.layout, message.layout, hello.layout_digest, not link.outgoing
        )
        if problem is not None:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, problem)
            return
        try:
            self.data.pair(
                link.peer,
                hello.agent_name,
                message.layout,
                message.metadata,
                link.outgoing,
                hello.machine,
            )
        except KVPushError as exc:
            self.metrics.inc("handshakes", result="refused")
            self._refuse(link, f"NIXL pairing failed: {exc}")
            return
        if not link.outgoing:
            self._send(link, self._my_metadata())
        link.ready = True
        if link.deadline is not None:
            link.deadline.cancel()
        self.metrics.inc("handshakes", result="ok")
        if not self.secret:
            log.warning(
                "kvpush: INSECURE: paired with %s (%s) with no shared secret: its messages "
                "are not authenticated", link.peer, hello.identity.label(),
            )  # fmt: skip
        self.events.on_ready(link.peer, hello, message.layout, link.outgoing)

    def _my_metadata(self) -> AgentMetadata:
        return AgentMetadata(self.data.agent_metadata, self.data.kv.layout)

    def _refuse(self, link: _Link, reason: str, tell: bool = True) -> None:
        log.warning("kvpush: handshake with %s failed: %s", link.peer, reason)
        if tell:
            with contextlib.suppress(KVPushError):
                self._send(link, Reject(reason[:1000]))
        link.conn.close(reason)

    def _send(self, link: _Link, message: Message) -> None:
        link.conn.send(link.session.seal(message))

    def _on_close(self, conn: Connection, reason: str) -> None:
        link = self._links.get(conn.label)
        if link is None or link.conn is not conn:
            return
        del self._links[link.peer]
        if conn.refused:
            self.metrics.inc("rejected_links", why=conn.refused)
        if link.deadline is not None:
            link.deadline.cancel()
        self.data.unpair(link.peer)
        self.events.on_lost(link.peer, reason, link.outgoing, link.ready, conn.closed_by_peer)

    def _unreachable(self, peer: str, reason: str) -> None:
        self._dialling.pop(peer, None)
        self.metrics.inc("handshakes", result="unreachable")
        self.events.on_lost(peer, reason, outgoing=True, was_ready=False)
