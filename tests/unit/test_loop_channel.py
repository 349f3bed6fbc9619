"""The loop thread and the side channel: no spinning, no lost frames, clear closes."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpush.transport.channel import MAX_FRAME, Connection, Listener, connect, drop_when_silent
from kvpush.transport.loop import Loop


@pytest.fixture
def loop():
    lp = Loop("test-loop", idle_tick=0.05)
    lp.start()
    yield lp
    lp.stop()


class CountingPoller:
    def __init__(self, pending_rounds: int = 0) -> None:
        self.polls = 0
        self.pending_rounds = pending_rounds
        self.target = 0  # reached is set once polls gets here
        self.reached = threading.Event()

    def busy(self) -> bool:
        return self.polls < self.pending_rounds

    def poll(self) -> bool:
        self.polls += 1
        if self.polls >= self.target:
            self.reached.set()
        return False


def test_call_runs_on_the_loop_thread_and_returns(loop):
    assert loop.call(threading.current_thread) is loop._thread
    with pytest.raises(ZeroDivisionError):
        loop.call(lambda: 1 / 0)


def test_idle_loop_polls_only_on_its_slow_tick(loop):
    poller = CountingPoller()
    poller.target = 4
    start = time.monotonic()
    loop.call(loop.add_poller, poller)
    assert poller.reached.wait(5)
    # idle_tick is 50 ms: four polls take at least three ticks. A spinning loop takes
    # microseconds.
    assert time.monotonic() - start >= 0.12


def test_pending_poller_is_polled_fast_until_done(loop):
    poller = CountingPoller(pending_rounds=200)
    poller.target = 200
    start = time.monotonic()
    loop.call(loop.add_poller, poller)
    assert poller.reached.wait(5)
    # Backing off to 0.2 ms caps 200 polls at well under a second; the idle tick would take 10 s.
    assert time.monotonic() - start < 2.0


class TimedPoller:
    """Busy, never progressing: a WRITE whose bytes are still crossing a TCP link."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.times: list[float] = []
        self.done = threading.Event()

    def busy(self) -> bool:
        return len(self.times) < self.rounds

    def poll(self) -> bool:
        self.times.append(time.perf_counter())
        if len(self.times) >= self.rounds:
            self.done.set()
        return False


def test_busy_poller_without_progress_is_polled_well_under_a_millisecond_apart(loop):
    # Over UCX's TCP lane a WRITE's target reads its socket only when polled: polls
    # 1 ms apart held a WRITE to 0.75 of the link's TCP rate.
    poller = TimedPoller(rounds=400)
    loop.call(loop.add_poller, poller)
    assert poller.done.wait(10)
    gaps = sorted(b - a for a, b in zip(poller.times[100:], poller.times[101:], strict=False))
    assert gaps[len(gaps) // 2] < 0.6e-3


def test_timers_fire_in_order_and_cancel(loop):
    fired = []
    done = threading.Event()

    def schedule():
        loop.call_later(0.03, lambda: fired.append("b"))
        loop.call_later(0.01, lambda: fired.append("a"))
        loop.call_later(0.02, lambda: fired.append("never")).cancel()
        loop.call_later(0.05, done.set)

    loop.call(schedule)
    assert done.wait(2)
    assert fired == ["a", "b"]


def test_failing_callback_does_not_stop_the_loop(loop):
    loop.call_soon(lambda: 1 / 0)
    assert loop.call(lambda: 42) == 42


class Endpoint:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.closed: list[str] = []
        self.conn: Connection | None = None

    def on_frame(self, conn, frame):
        self.frames.append(frame)

    def on_close(self, conn, reason):
        self.closed.append(reason)


def _pair(loop):
    server, client = Endpoint(), Endpoint()

    def accept(sock):
        server.conn = Connection(loop, sock, server.on_frame, server.on_close)

    listener = loop.call(lambda: Listener(loop, "127.0.0.1", 0, accept))
    sock = connect("127.0.0.1", listener.port, timeout=5)
    client.conn = loop.call(lambda: Connection(loop, sock, client.on_frame, client.on_close))
    _wait(lambda: server.conn is not None)
    return server, client, listener


def _wait(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def test_frames_arrive_whole_and_in_order(loop):
    server, client, listener = _pair(loop)
    frames = [b"a", b"", b"x" * (3 << 20), b"last"]
    for frame in frames:
        loop.call(client.conn.send, frame)
    _wait(lambda: len(server.frames) == len(frames))
    assert server.frames == frames
    loop.call(listener.close)


def test_peer_close_is_reported_at_once(loop):
    server, client, listener = _pair(loop)
    loop.call(client.conn.close)
    _wait(lambda: server.closed)
    assert server.closed == ["the peer closed the connection"]
    loop.call(listener.close)


def test_oversized_frame_closes_with_a_reason(loop):
    server, client, listener = _pair(loop)
    loop.call(client.conn.sock.sendall, (MAX_FRAME + 1).to_bytes(4, "big"))
    _wait(lambda: server.closed)
    assert "frame" in server.closed[0] and str(MAX_FRAME) in server.closed[0]
    loop.call(listener.close)


def test_connect_to_nothing_names_the_address():
    from kvpush.errors import ProtocolError

    with pytest.raises(ProtocolError, match=r"127\.0\.0\.1:1"):
        connect("127.0.0.1", 1, timeout=2)


def test_a_call_handed_to_a_stopped_loop_is_refused_not_raised():
    # A dial thread finishing after its node closed hands its socket to a loop whose
    # wake-up pipe is gone: it must learn so (and close the socket), not die of EBADF.
    lp = Loop("stopped-loop", idle_tick=0.05)
    lp.start()
    lp.stop()
    assert lp.call_soon(lambda: None) is False
    lp._stopping = False  # the race: the look saw a live loop, its pipe closed after
    assert lp.call_soon(lambda: None) is True  # no OSError from the closed pipe


def test_a_link_that_may_outlive_its_peers_host_asks_the_kernel_to_drop_it():
    """A vanished host sends no FIN: only the kernel's keepalive probes and its bound on
    unacknowledged data notice. (That the link then goes: tests/integration/
    test_two_hosts.py, across a link taken down.)"""
    sock = socket.socket()
    try:
        drop_when_silent(sock, 16.0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 16000
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        every = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        assert 0 < idle < 16 and 0 < every < 16, (idle, every)  # probes within the bound
    finally:
        sock.close()
