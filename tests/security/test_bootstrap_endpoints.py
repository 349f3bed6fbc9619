"""Bootstrap endpoints as an attacker runs them: a decode leg names the endpoint its
producer is found at, so whoever can send decode a request can make it ask any
server. A server that answers slowly, hugely or in garbage must cost decode a
bounded query (time and bytes), end the leg with a reason, and never block the
engine's scheduler."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from kvpush.identities import MAX_ANSWER, fetch_query
from kvpush.vllm.bootstrap import BootstrapResolver, LegError

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


class Hostile:
    """A one-connection-at-a-time HTTP server that answers as `behave(conn)` does."""

    def __init__(self, behave) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.sent = 0
        self._behave = behave
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)  # the request
                with contextlib.suppress(OSError):  # the client gave up on us: the point
                    self._behave(self, conn)

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def trickle(server: Hostile, conn: socket.socket) -> None:
    server.send(conn, HEAD + b"Content-Length: 1000000\r\n\r\n")
    for _ in range(600):
        server.send(conn, b" ")
        time.sleep(0.1)


def huge(server: Hostile, conn: socket.socket) -> None:
    server.send(conn, HEAD + b"Content-Length: 1073741824\r\n\r\n")
    chunk = b"[" * 65536
    for _ in range(1 << 14):  # a GiB, unless the client stops reading
        server.send(conn, chunk)


def garbage(server: Hostile, conn: socket.socket) -> None:
    body = b"{'engine_id': not json"
    server.send(conn, HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def silent(server: Hostile, conn: socket.socket) -> None:
    time.sleep(30)


@pytest.fixture(params=[trickle, huge, garbage, silent], ids=lambda f: f.__name__)
def hostile(request):
    server = Hostile(request.param)
    yield request.param.__name__, server
    server.close()


def test_a_hostile_endpoint_costs_a_bounded_query_and_names_what_was_wrong(hostile):
    kind, server = hostile
    started = time.monotonic()
    with pytest.raises((OSError, ValueError)) as caught:
        fetch_query(server.address, timeout=1.0)
    took = time.monotonic() - started
    assert took < 10.0, f"{kind}: the query took {took:.1f}s"  # 1 s, one read's overrun
    expected = {
        "trickle": "longer than 1s",
        "huge": f"more than {MAX_ANSWER} bytes",
        "garbage": "Expecting",
        "silent": "timed out",
    }[kind]
    assert expected in str(caught.value), caught.value
    if kind == "huge":
        # Read up to the cap, not what the server offered (sent counts what the
        # kernel's buffers took too).
        assert server.sent < MAX_ANSWER + (64 << 20)


def test_the_engine_is_never_blocked_and_the_leg_fails_with_the_reason(hostile):
    kind, server = hostile
    resolver = BootstrapResolver(fetch=lambda address: fetch_query(address, timeout=1.0))
    assert resolver.producer(server.address, "engine-p") is None  # asked off the engine
    deadline = time.monotonic() + 15
    while True:
        try:
            resolver.producer(server.address, "engine-p")
        except LegError as refused:
            assert refused.reason == "bootstrap_unreachable"
            assert server.address in str(refused)
            return
        assert time.monotonic() < deadline, f"{kind}: the leg never ended"
        time.sleep(0.05)
