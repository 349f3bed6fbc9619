"""Refusals recorded in one session and replayed into another.

A Reject before the session's keys exist (the acceptor refusing the initiator's
hello) cannot be signed with those keys. Signed with the shared secret alone, one
recorded anywhere would refuse any later session, in the words of the recorded one
("transfer mode mismatch", say) and send an operator after the wrong fault. It is
signed for the nonce of the hello it refuses, so it opens that session only.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
from host_nodes import HEADER, SECRET, host_node

from kvpush.errors import AuthError
from kvpush.protocol.auth import Session
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.messages import Hello, Identity, Reject

REASON = "transfer mode mismatch: recorded in another session"


def _hello(session: Session, mode: str = "push") -> Hello:
    return Hello(Identity("decode"), mode, "consumer", "agent", "digest", session.nonce, 60, 60)


def _refused(reason: str = REASON) -> tuple[Session, bytes]:
    """A decode session whose hello a producer refused, and the refusal's frame."""
    decode = Session(SECRET, initiator=True, nonce=os.urandom(16))
    producer = Session(SECRET, initiator=False, nonce=os.urandom(16))
    producer.open(decode.seal(_hello(decode)))
    return decode, producer.seal(Reject(reason))


def test_a_genuine_refusal_opens_in_the_session_it_refuses():
    decode, refusal = _refused()
    assert decode.open(refusal) == Reject(REASON)


def test_a_refusal_replayed_into_a_new_session_is_refused():
    _, refusal = _refused()
    victim = Session(SECRET, initiator=True, nonce=os.urandom(16))
    victim.seal(_hello(victim))
    with pytest.raises(AuthError, match="refusal not signed for this session"):
        victim.open(refusal)


def test_a_refusal_sent_before_any_hello_opens_in_no_session():
    """Without the peer's nonce a refusal is said for whoever reads the wire, and no
    Session believes it: it would serve a replayer as well as its first reader."""
    unbound = Session(SECRET, initiator=False, nonce=os.urandom(16)).seal(Reject("no hello"))
    reader = Session(SECRET, initiator=True, nonce=os.urandom(16))
    reader.seal(_hello(reader))
    with pytest.raises(AuthError, match="refusal not signed for this session"):
        reader.open(unbound)


# -- against live nodes -------------------------------------------------------------


def _framed(frame: bytes) -> bytes:
    return HEADER.pack(len(frame)) + frame


def _frames(data: bytes) -> list[bytes]:
    frames = []
    while len(data) >= HEADER.size:
        (size,) = HEADER.unpack_from(data)
        frames.append(data[HEADER.size : HEADER.size + size])
        data = data[HEADER.size + size :]
    return frames


def _record_refusal() -> bytes:
    """A live producer's refusal of a pull-mode hello: genuine, signed by the node."""
    producer = host_node("producer", "prefill-engine")
    try:
        host, _, port = producer.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            session = Session(SECRET, initiator=True, nonce=os.urandom(16))
            sock.sendall(_framed(session.seal(_hello(session, mode="pull"))))
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        (frame,) = _frames(received)
        assert "transfer mode mismatch" in session.open(frame).reason  # it was genuine
        return frame
    finally:
        producer.close()


def test_a_live_refusal_replayed_to_a_decode_fails_its_transfer_as_forged():
    """The attacker answers a decode's dial (a forged decode leg points it there, say)
    with a refusal recorded from a real producer."""
    refusal = _record_refusal()
    attacker = socket.create_server(("127.0.0.1", 0))

    def replay() -> None:
        conn, _ = attacker.accept()
        with conn:
            conn.settimeout(10)
            conn.recv(65536)  # the decode's hello
            conn.sendall(_framed(refusal))
            conn.recv(65536)  # until the decode hangs up

    threading.Thread(target=replay, daemon=True).start()
    decode = host_node("consumer", "decode-engine")
    try:
        decode.expect("t1", f"127.0.0.1:{attacker.getsockname()[1]}", [1, 2])
        (failed,) = decode.wait_results(20)
        assert (failed.kind, failed.reason) == ("failed", "handshake_failed"), failed
        assert "transfer mode mismatch" not in failed.detail, failed.detail
        assert "refusal not signed for this session" in failed.detail, failed.detail
        assert decode.metrics.counter("rejected_messages", why="auth") == 1
    finally:
        decode.close()
        attacker.close()


def test_a_live_producers_refusal_still_reaches_the_decode_it_refuses():
    producer = host_node("producer", "prefill-engine")
    decode = host_node("consumer", "decode-engine", protocol=ProtocolConfig(mode="pull"))
    try:
        decode.expect("t1", producer.address, [1, 2])
        (failed,) = decode.wait_results(20)
        assert (failed.kind, failed.reason) == ("failed", "handshake_failed"), failed
        assert "the peer refused to pair: transfer mode mismatch" in failed.detail, failed.detail
        assert decode.metrics.counter("rejected_messages", why="auth") == 0
    finally:
        decode.close()
        producer.close()
