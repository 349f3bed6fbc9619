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
"""

from __future__ import annotations

import contextlib
import select
import socket


class IdleSteps:
    """Whether an empty step waits on the doorbell, and for how long."""

    def __init__(self, wait_s: float) -> None:
        self.doorbell = Doorbell()
        self.wait_s = wait_s
        self.waits = 0  # steps that waited (tests, metrics)
        self._quiet_before = False  # the last step was quiet too

    def after_step(self, quiet: bool) -> None:
        """A step was planned; `quiet`: it computes nothing, tells the workers nothing,
        and only a transfer's end can change that. Two quiet steps in a row, not one,
        wait: with async scheduling an empty step may be taken while the previous
        batch still computes, and its outcome must not wait on us."""
        if quiet and self._quiet_before and self.wait_s:
            self.waits += 1
            self.doorbell.wait(self.wait_s)
        self._quiet_before = quiet

    def close(self) -> None:
        self.doorbell.close()


class Doorbell:
    """The scheduler's end: a loopback UDP socket nobody needs to connect to."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._inbox_ringer: Ringer | None = None

    def wait(self, timeout: float) -> bool:
        """Block until rung (True) or `timeout` seconds passed (False); either way,
        forget the rings so far. A ring that came before the call returns at once."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        self._drain()
        return bool(ready)

    def inbox_ringer(self) -> Ringer:
        """A ringer for the engine's request queue, closed with the doorbell."""
        self._inbox_ringer = Ringer(self.port)
        return self._inbox_ringer

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self._sock.recv(64)

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

    def ring(self) -> None:
        if self.port:
            with contextlib.suppress(OSError):  # full buffer: it is ringing already
                self._sock.sendto(b"!", ("127.0.0.1", self.port))

    def close(self) -> None:
        self._sock.close()
