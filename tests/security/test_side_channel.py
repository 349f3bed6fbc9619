"""The side channel as an attacker without the secret sees it.

A real kvpush Node (host KV, real NIXL) listens; the attacker is a raw TCP client.
Whatever it sends, it must get nothing that opens or describes the KV memory (no
NIXL metadata, no layout), hold nothing for long, and be counted.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest
from host_nodes import HEADER, SECRET, host_node

from kvpush.errors import KVPushError
from kvpush.node import Node, NodeConfig, links
from kvpush.protocol.auth import Session
from kvpush.protocol.messages import Hello, Identity, Reject, decode

pytestmark = pytest.mark.nixl


@pytest.fixture
def producer():
    node = host_node("producer", "prefill-engine", handshake_s=0.5)
    yield node
    node.close()


def _dial(node: Node) -> socket.socket:
    host, _, port = node.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _everything_until_closed(sock: socket.socket, seconds: float = 5.0) -> bytes:
    sock.settimeout(seconds)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            # Closed with our bytes still unread in its buffer (the rest of an oversized
            # frame, say): the kernel says so with a reset instead of an end of stream.
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the connection is still open after {seconds}s")


def _counted(node: Node, name: str, expected: int, **labels: str) -> None:
    """The node counts a refusal just after closing the link: allow it that moment."""
    deadline = time.monotonic() + 5
    while node.metrics.counter(name, **labels) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.metrics.counter(name, **labels) == expected, (name, labels)


def _frames(data: bytes) -> list:
    """The messages in what a peer sent, read without its secret (payloads are not
    encrypted, only signed)."""
    messages = []
    while data:
        (size,) = HEADER.unpack_from(data)
        _, _, _, payload = msgspec.msgpack.decode(data[4 : 4 + size])
        messages.append(decode(payload))
        data = data[4 + size :]
    return messages


def _hello(session: Session, engine: str = "attacker") -> bytes:
    hello = Hello(Identity(engine), "push", "consumer", "agent", "digest", session.nonce, 60, 60)
    frame = session.seal(hello)
    return HEADER.pack(len(frame)) + frame


def test_a_client_that_connects_and_says_nothing_is_dropped_at_the_deadline(producer):
    sock = _dial(producer)
    started = time.monotonic()
    (refusal,) = _frames(_everything_until_closed(sock))
    assert isinstance(refusal, Reject) and "no completed handshake" in refusal.reason
    assert time.monotonic() - started < 3.0  # the 0.5 s deadline, with slack for a busy box
    assert producer.metrics.counter("rejected_links", why="handshake_deadline") == 1


def test_an_oversized_frame_before_the_hello_is_refused_unread(producer):
    sock = _dial(producer)
    sock.sendall(HEADER.pack(links.PRE_AUTH_FRAME + 1))  # announces 4 KiB + 1, sends none
    assert _everything_until_closed(sock) == b""  # closed at once, nothing buffered
    _counted(producer, "rejected_links", 1, why="oversized_frame")


def test_a_hello_under_another_secret_gets_a_refusal_and_nothing_of_our_memory(producer):
    sock = _dial(producer)
    sock.sendall(_hello(Session(b"not-the-secret-at-all-0123456789", True, os.urandom(16))))
    received = _frames(_everything_until_closed(sock))
    assert [type(m) for m in received] == [Reject]
    assert "different shared secret" in received[0].reason
    assert producer.metrics.counter("rejected_messages", why="auth") == 1
    assert producer.stats()["links"] == []


def test_a_replayed_hello_with_the_secret_never_gets_the_metadata(producer):
    """A hello signed with the secret (captured on the wire, say) opens a session, but
    the layout and NIXL metadata come only under keys the replayer cannot derive."""
    sock = _dial(producer)
    sock.sendall(_hello(Session(SECRET, True, os.urandom(16))))  # as if replayed
    received = _frames(_everything_until_closed(sock))
    kinds = [type(m).__name__ for m in received]
    assert kinds == ["Hello", "Verify", "Reject"], kinds  # the deadline ends it
    assert all(not hasattr(m, "layout") and not hasattr(m, "metadata") for m in received)


def test_too_many_links_mid_handshake_are_turned_away(monkeypatch):
    monkeypatch.setattr(links, "MAX_UNPAIRED", 2)
    producer = host_node("producer", "prefill-engine")  # 10 s to complete a handshake
    held = [_dial(producer) for _ in range(2)]
    deadline = time.monotonic() + 10
    while producer.loop.call(lambda: len(producer.links._links)) < 2:  # both accepted
        assert time.monotonic() < deadline, "the node did not accept two connections"
        time.sleep(0.01)
    extra = _dial(producer)
    assert _everything_until_closed(extra, 5.0) == b""
    assert producer.metrics.counter("rejected_links", why="too_many_unpaired") == 1
    for sock in held:
        sock.close()
    producer.close()


def test_a_decode_opens_its_memory_only_to_the_producer_its_leg_names(producer):
    """A decode leg naming another engine (or boot) than the one listening there:
    the decode refuses at the producer's hello, before its own metadata goes out."""
    decode = host_node("consumer", "decode-engine")
    try:
        decode.expect("t1", producer.address, [1, 2], engine="some-other-engine")
        (failed,) = decode.wait_results(10)
        assert (failed.kind, failed.reason) == ("failed", "handshake_failed")
        assert "the decode leg names 'some-other-engine'" in failed.detail
        assert producer.stats()["links"] == [] and decode.stats()["links"] == []
        assert producer.metrics.counter("handshakes", result="ok") == 0
    finally:
        decode.close()


def test_a_node_without_a_secret_refuses_to_start_unless_told_it_is_insecure():
    with pytest.raises(KVPushError, match="needs a shared secret"):
        NodeConfig("engine", "producer")
    assert NodeConfig("engine", "producer", insecure=True).secret == b""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_flood_of_hostile_connections_leaves_memory_and_links_bounded(producer):
    """Three hundred connections, each one of the attacks above: memory stays within a
    few MiB, no link survives, and each refusal is counted under its name."""
    forged = Session(b"not-the-secret-at-all-0123456789", True, os.urandom(16))
    attacks = {
        "oversized": HEADER.pack(64 << 20) + b"\0" * 4096,  # a 64 MiB frame announced
        "wrong_secret": _hello(forged),
        "garbage": HEADER.pack(16) + os.urandom(16),
    }
    for _ in range(20):  # warm the allocator before the baseline
        sock = _dial(producer)
        sock.sendall(attacks["garbage"])
        _everything_until_closed(sock)
    before = _rss_bytes()
    for i in range(300):
        sock = _dial(producer)
        sock.sendall(list(attacks.values())[i % 3])
        _everything_until_closed(sock)
    growth = _rss_bytes() - before
    assert growth < 8 << 20, f"memory grew {growth / 2**20:.1f} MiB over 300 hostile connections"
    assert producer.stats()["links"] == []
    _counted(producer, "rejected_messages", 100, why="auth")
    _counted(producer, "rejected_links", 100, why="oversized_frame")
    assert producer.metrics.counter("rejected_messages", why="malformed") >= 100
    assert producer.metrics.counter("handshakes", result="ok") == 0
