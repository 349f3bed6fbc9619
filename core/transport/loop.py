"""The loop thread that owns NIXL: every agent call, socket read and timer runs on it.

It never spins. With no poller busy it blocks in the selector (woken by a socket,
a call from another thread, or a timer) and touches NIXL only on a slow idle tick,
so an idle connection costs ~0 CPU. While a poller reports itself busy, NIXL
needs this process to keep calling into it (the progress thread is off, because it
costs tens of milliseconds a notification), so the loop polls at an interval that
starts at `min_poll` and backs off to `max_poll` while nothing happens.

`max_poll` bounds how fast bytes cross a TCP link: over UCX's TCP lane the target of
a WRITE reads the socket only when it calls into NIXL, so between two polls the
sender can put no more than the receive window (a few MiB) on the wire. At 1 ms that
held a WRITE across a veth link to 0.75 of the link's plain TCP; at 0.2 ms it
matched it (docs/benchmarks.md), for about 8 % of a core while a transfer is busy
against 3 % at 1 ms. Idle, nothing changes: the loop sleeps in the selector.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Poller(Protocol):
    def poll(self) -> bool:
        """Do one round of polling; True if anything happened."""

    def busy(self) -> bool:
        """True while work is outstanding and polling must be fast."""


class TimerHandle:
    __slots__ = ("cancelled", "deadline", "fn")

    def __init__(self, deadline: float, fn: Callable[[], Any]) -> None:
        self.deadline = deadline
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """A single thread running callbacks, socket readers, pollers and timers."""

    def __init__(
        self,
        name: str = "kvpush-loop",
        min_poll: float = 50e-6,
        max_poll: float = 2e-4,
        idle_tick: float = 0.1,
    ) -> None:
        self.name = name
        self.min_poll, self.max_poll, self.idle_tick = min_poll, max_poll, idle_tick
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._handlers: dict[int, list[Callable[[], Any] | None]] = {}
        self._watch(self._wake_r, 0, self._drain_wakeups)
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...], Future | None]] = deque()
        self._timers: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._pollers: list[Poller] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- life cycle ------------------------------------------------------------------

    def start(self, init: Callable[[], Any] | None = None) -> Any:
        """Start the thread; run `init` on it first and return its result (or raise)."""
        started: Future = Future()

        def main() -> None:
            try:
                result = init() if init else None
            except BaseException as exc:
                started.set_exception(exc)
                return
            started.set_result(result)
            self._run()

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        return started.result()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to finish queued calls and exit; wait for it."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # -- work from any thread ---------------------------------------------------------

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run fn(*args) on the loop thread; safe from any thread. False when the loop
        has stopped and will run nothing more: the caller keeps what it meant to hand
        over (a socket to close, say)."""
        if self._stopping:
            return False
        self._calls.append((fn, args, None))
        self._wake()
        return True

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = 30.0) -> Any:
        """Run fn(*args) on the loop thread and return its result (or raise its error)."""
        if self.in_loop():
            return fn(*args)
        if not self.running:
            raise RuntimeError(f"loop {self.name!r} is not running")
        future: Future = Future()
        self._calls.append((fn, args, future))
        self._wake()
        return future.result(timeout)

    def _wake(self) -> None:
        # A full pipe already holds wake-ups enough; a closed one belongs to a loop that
        # stopped between the caller's look and now, and will run nothing more.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # -- loop-thread registration ---------------------------------------------------

    def add_reader(self, sock: socket.socket, callback: Callable[[], Any]) -> None:
        self._watch(sock, 0, callback)

    def remove_reader(self, sock: socket.socket) -> None:
        self._watch(sock, 0, None)

    def add_writer(self, sock: socket.socket, callback: Callable[[], Any]) -> None:
        self._watch(sock, 1, callback)

    def remove_writer(self, sock: socket.socket) -> None:
        self._watch(sock, 1, None)

    def _watch(self, sock: socket.socket, slot: int, callback: Callable[[], Any] | None) -> None:
        fd = sock.fileno()
        if fd < 0:
            self._handlers.pop(fd, None)
            return
        handlers = self._handlers.setdefault(fd, [None, None])
        had = handlers[0] is not None or handlers[1] is not None
        handlers[slot] = callback
        mask = (selectors.EVENT_READ if handlers[0] else 0) | (
            selectors.EVENT_WRITE if handlers[1] else 0
        )
        if not mask:
            del self._handlers[fd]
            if had:
                self._selector.unregister(fd)
        elif had:
            self._selector.modify(fd, mask, handlers)
        else:
            self._selector.register(fd, mask, handlers)

    def add_poller(self, poller: Poller) -> None:
        self._pollers.append(poller)

    def remove_poller(self, poller: Poller) -> None:
        if poller in self._pollers:
            self._pollers.remove(poller)

    def call_at(self, deadline: float, fn: Callable[[], Any]) -> TimerHandle:
        """Run fn at time.monotonic() >= deadline (loop thread only)."""
        handle = TimerHandle(deadline, fn)
        heapq.heappush(self._timers, (deadline, next(self._seq), handle))
        return handle

    def call_later(self, delay: float, fn: Callable[[], Any]) -> TimerHandle:
        return self.call_at(time.monotonic() + delay, fn)

    # -- the loop --------------------------------------------------------------------

    def _run(self) -> None:
        interval = 0.0
        next_idle_poll = time.monotonic() + self.idle_tick
        while not self._stopping:
            busy = any(p.busy() for p in self._pollers)
            now = time.monotonic()
            timeout = interval if busy else max(0.0, next_idle_poll - now)
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0][0] - now))
            if self._calls:
                timeout = 0.0
            progressed = self._wait(timeout) > 0
            progressed |= self._run_calls()
            # A message or call may have just made a poller busy: poll in this round.
            busy = busy or any(p.busy() for p in self._pollers)
            if busy or time.monotonic() >= next_idle_poll:
                next_idle_poll = time.monotonic() + self.idle_tick
                progressed |= self._poll()
            progressed |= self._run_timers()
            # While things happen, look again at once; when they stop, back off.
            interval = 0.0 if progressed else min(max(interval * 2, self.min_poll), self.max_poll)
        self._run_calls()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wait(self, timeout: float) -> int:
        """Wait for sockets up to `timeout`; returns how many were ready."""
        # epoll rounds timeouts up to whole milliseconds; below one, sleep instead:
        # being late by a fraction of a millisecond for a socket is fine.
        if 0 < timeout < 1e-3:
            time.sleep(timeout)
            timeout = 0.0
        events = self._selector.select(timeout)
        for key, mask in events:
            reader, writer = key.data
            if mask & selectors.EVENT_READ and reader is not None:
                self._guard(reader)
            if mask & selectors.EVENT_WRITE and writer is not None and key.data[1] is writer:
                self._guard(writer)
        return len(events)

    def _run_calls(self) -> bool:
        ran = False
        while self._calls:
            fn, args, future = self._calls.popleft()
            ran = True
            if future is None:
                self._guard(fn, *args)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
        return ran

    def _poll(self) -> bool:
        progressed = False
        for poller in list(self._pollers):
            progressed |= bool(self._guard(poller.poll))
        return progressed

    def _run_timers(self) -> bool:
        fired = False
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, handle = heapq.heappop(self._timers)
            if not handle.cancelled:
                fired = True
                self._guard(handle.fn)
        return fired

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            # One failing callback must not take down the thread every transfer relies on.
            log.exception("kvpush loop %s: callback %r failed", self.name, fn)
            return None
