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

A landing's ring says which transfer landed on which rank (a LandingNote), keyed
with a token the scheduler hands its workers in the step metadata, so no other
process on the host can claim a landing. Where vLLM's schedule() is hooked
(kvpush.vllm.landings), the wait happens at the start of the next schedule() and
the landings heard are taken into vLLM's scheduler there: the request is scheduled
by that very call, not after a step carries the worker's report.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
from dataclasses import dataclass

_LANDED = b"L"


@dataclass(frozen=True)
class LandingNote:
    """One worker rank's share of a transfer landed, told outside a step."""

    rank: int
    transfer_id: str
    wall: float  # when it landed (time.time, the worker's)
    ready_wall: float  # when the producer's last prompt step ended (0: unknown)

    def encode(self, key: str) -> bytes:
        times = f"{self.wall:.6f} {self.ready_wall:.6f}"
        return _LANDED + f" {key} {self.rank} {self.transfer_id} {times}".encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> LandingNote | None:
        """The note in a ring, or None: a plain ring, or one without our key."""
        parts = data.split(b" ")
        if len(parts) != 6 or parts[0] != _LANDED or parts[1].decode(errors="replace") != key:
            return None
        try:
            return cls(int(parts[2]), parts[3].decode(), float(parts[4]), float(parts[5]))
        except ValueError:
            return None


class IdleSteps:
    """Whether an empty step waits on the doorbell, and for how long."""

    def __init__(self, wait_s: float) -> None:
        self.doorbell = Doorbell()
        self.wait_s = wait_s
        self.waits = 0  # steps that waited (tests, metrics)
        self._quiet_before = False  # the last step was quiet too
        # Where schedule() is hooked, the wait is held over to the next schedule(),
        # whose plan can then take in what the ring brought.
        self.wait_before_schedule = False
        self.synchronous = False  # vLLM schedules a step only after the last one's output
        self._due = False

    def after_step(self, quiet: bool, idle_after: bool = False) -> None:
        """A step was planned. `quiet`: it computes nothing, tells the workers nothing,
        and only a transfer's end can change that. Two quiet steps in a row, not one,
        wait: with async scheduling an empty step may be taken while the previous
        batch still computes, and its outcome must not wait on us. `idle_after`: it
        computes nothing, and after it only a transfer's end can give the engine work.
        Where the wait is held over to the next schedule() of a synchronous engine,
        that is enough: the step's claims and news are out by then, and every empty
        step before the wait is a round trip to the workers a landing can fall into."""
        twice = bool(quiet and self._quiet_before and self.wait_s)
        self._quiet_before = quiet
        if not self.wait_before_schedule:
            if twice:
                self._wait()
        elif self.synchronous:
            self._due = bool(idle_after and self.wait_s)
        else:
            self._due = twice

    def before_schedule(self) -> None:
        """schedule() begins: wait now if the last step said so, and nothing since
        has given vLLM something to do (news())."""
        if self._due:
            self._due = False
            self._wait()

    def news(self) -> None:
        """A request arrived or ended, or a step reported a transfer's end: the next
        schedule() has work, and must not wait."""
        self._due = False

    def _wait(self) -> None:
        self.waits += 1
        self.doorbell.wait(self.wait_s)

    def close(self) -> None:
        self.doorbell.close()


class Doorbell:
    """The scheduler's end: a loopback UDP socket nobody needs to connect to."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self.key = secrets.token_hex(8)  # a landing note's proof it is our workers'
        self._inbox_ringer: Ringer | None = None
        self._heard: list[LandingNote] = []
        self._rung_unwaited = False

    def wait(self, timeout: float) -> bool:
        """Block until rung (True) or `timeout` seconds passed (False); either way,
        forget the rings so far, keeping their landing notes. A ring that came before
        the call returns at once."""
        if self._rung_unwaited:  # heard() took a ring no wait has answered yet
            ready = [self._sock]
        else:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        self._drain()
        self._rung_unwaited = False
        return bool(ready)

    def heard(self) -> list[LandingNote]:
        """The landing notes rung since the last call (without waiting). A plain ring
        taken here still ends the next wait at once: what it rang for (a request in
        the engine's queue) may not have reached the scheduler yet."""
        self._rung_unwaited |= self._drain()
        heard, self._heard = self._heard, []
        return heard

    def inbox_ringer(self) -> Ringer:
        """A ringer for the engine's request queue, closed with the doorbell."""
        self._inbox_ringer = Ringer(self.port)
        return self._inbox_ringer

    def _drain(self) -> bool:
        """Take every ring so far, keeping the landing notes; True if any was plain."""
        plain = False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                note = LandingNote.decode(self._sock.recv(2048), self.key)
                if note is None:
                    plain = True
                else:
                    self._heard.append(note)
        return plain

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

    def ring(self, message: bytes = b"!") -> None:
        if self.port:
            with contextlib.suppress(OSError):  # full buffer: it is ringing already
                self._sock.sendto(message, ("127.0.0.1", self.port))

    def close(self) -> None:
        self._sock.close()
