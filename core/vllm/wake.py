"""A doorbell from the workers to the scheduler: "a transfer ended, step now".

While every request an engine holds waits for a transfer (decode: KV still to
land; prefill: blocks a WRITE still reads), vLLM's engine loop has nothing to
compute but keeps stepping, about a thousand empty steps a second, each a round
trip to every worker. On a machine whose cores the engines share that steals a
core from the engine that does compute. The scheduler half instead waits on this
doorbell in such a step, for at most `idle_wait_s`: a worker rings it the moment
its Node has an outcome, so a landing is picked up at once. New requests and
aborts ring it too: vLLM queues them in the engine's request queue until the step
returns, so that queue rings an inbox_ringer() (the engine_inbox hook in
kvpush.vllm.hooks). Where it cannot (an engine without that queue), the bound keeps
them prompt.

A loopback datagram per outcome: workers on the scheduler's host reach it; a
worker on another host (multi-node TP) cannot, and the bound alone applies there.
A landing's datagram says which transfer landed on which rank, so that the
scheduler can resume the request before its next schedule rather than after a step
of the workers reports it (the early_landing hook in kvpush.vllm.hooks).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
from dataclasses import dataclass

_RING = b"!"
_LANDED = b"L"
_MOST = 4096  # bytes a datagram may carry: a landing's fit many times over


@dataclass(frozen=True)
class Landing:
    """One rank's share of a transfer landed (decode), as its worker rang it."""

    transfer_id: str
    rank: int
    wall: float  # when it landed (time.time, the worker's)
    ready_wall: float  # when prefill's last prompt step ended (0: not known)

    def encode(self) -> bytes:
        fields = [self.transfer_id, self.rank, self.wall, self.ready_wall]
        return _LANDED + json.dumps(fields).encode()

    @classmethod
    def decode(cls, datagram: bytes) -> Landing | None:
        """The landing a datagram tells of; None for a plain ring, or a datagram that
        is not a landing (anything on loopback may send to the port)."""
        if not datagram.startswith(_LANDED):
            return None
        try:
            tid, rank, wall, ready = json.loads(datagram[len(_LANDED) :])
            return cls(str(tid), int(rank), float(wall), float(ready))
        except (ValueError, TypeError):
            return None


class Doorbell:
    """The scheduler's end: a loopback UDP socket nobody needs to connect to."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._inbox_ringer: Ringer | None = None

    def wait(self, timeout: float) -> list[Landing]:
        """Block until rung or `timeout` seconds passed; either way, take the rings so
        far, and return the landings they told of. A ring that came before the call
        returns at once."""
        select.select([self._sock], [], [], timeout)
        return self.take()

    def take(self) -> list[Landing]:
        """The rings so far, without waiting: the landings they told of."""
        landings = []
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                landing = Landing.decode(self._sock.recv(_MOST))
                if landing is not None:
                    landings.append(landing)
        return landings

    def inbox_ringer(self) -> Ringer:
        """A ringer for the engine's request queue, closed with the doorbell."""
        self._inbox_ringer = Ringer(self.port)
        return self._inbox_ringer

    def close(self) -> None:
        self._sock.close()
        if self._inbox_ringer is not None:
            self._inbox_ringer.close()  # the queue outlives us: its rings now go nowhere


class Ringer:
    """A ringing end: a worker's, or the engine request queue's. Ringing never blocks
    and never fails the caller."""

    def __init__(self, port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.port = port  # 0 until known: a worker learns it from the step metadata

    def ring(self, landing: Landing | None = None) -> None:
        if self.port:
            datagram = landing.encode() if landing is not None else _RING
            with contextlib.suppress(OSError):  # full buffer: it is ringing already
                self._sock.sendto(datagram, ("127.0.0.1", self.port))

    def close(self) -> None:
        self._sock.close()
