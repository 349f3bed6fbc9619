"""Authenticated framing: forged, replayed, truncated and garbage frames are refused."""

from __future__ import annotations

import os

import msgspec
import pytest
from protocol_sim import hello as make_hello

from kvpush.errors import AuthError, ProtocolError
from kvpush.protocol import messages as m
from kvpush.protocol.auth import (
    Session,
    release_key,
    release_token,
    release_token_ok,
)
from kvpush.protocol.config import ProtocolConfig

SECRET = b"s3cret"


def new_session(secret: bytes, initiator: bool) -> Session:
    """A Session with a fresh nonce, as the Node makes one per connection."""
    return Session(secret, initiator, nonce=os.urandom(16))


def _hello(session: Session, role: str, name: str) -> m.Hello:
    h = make_hello(role, "push", 8, name, 0x100000, ProtocolConfig())
    return m.Hello(**{**{f: getattr(h, f) for f in h.__struct_fields__}, "nonce": session.nonce})


def established_pair(secret: bytes = SECRET) -> tuple[Session, Session]:
    client, server = new_session(secret, initiator=True), new_session(secret, initiator=False)
    server.open(client.seal(_hello(client, "consumer", "decode")))
    client.open(server.seal(_hello(server, "producer", "prefill")))
    assert client.established and server.established
    return client, server


def test_messages_round_trip_both_ways():
    client, server = established_pair()
    register = m.Register("t1", [[1, 2, 3]], "digest", 1)
    assert server.open(client.seal(register)) == register
    complete = m.Complete("t1", b"kvpush:t1", 42, 1.5)
    assert client.open(server.seal(complete)) == complete


def test_forged_message_without_the_secret_is_rejected():
    _client, server = established_pair()
    forger = new_session(b"guess", initiator=True)
    forger._send_key = b"k" * 32
    forger._sent_hello = True
    forger.peer_hello = server.peer_hello
    with pytest.raises(AuthError, match="bad signature"):
        server.open(forger.seal(m.Cancel("t1", "aborted")))


def test_hello_with_another_secret_is_rejected():
    client = new_session(b"other", initiator=True)
    server = new_session(SECRET, initiator=False)
    with pytest.raises(AuthError, match="different shared secret"):
        server.open(client.seal(_hello(client, "consumer", "decode")))
    assert server.peer_hello is None


def test_replayed_message_is_rejected():
    client, server = established_pair()
    frame = client.seal(m.Heartbeat(["t1"]))
    server.open(frame)
    with pytest.raises(AuthError, match="replayed"):
        server.open(frame)


def test_message_from_another_session_is_rejected():
    _client, server = established_pair()
    other_client, _ = established_pair()
    with pytest.raises(AuthError, match="another session"):
        server.open(other_client.seal(m.Heartbeat(["t1"])))


def test_reflected_message_is_rejected():
    client, _server = established_pair()
    frame = client.seal(m.Heartbeat(["t1"]))
    with pytest.raises(AuthError):
        client.open(frame)  # sent back to its author


def test_second_hello_is_rejected():
    _client, server = established_pair()
    replay = new_session(SECRET, initiator=True)
    with pytest.raises(AuthError, match="second hello"):
        server.open(replay.seal(_hello(replay, "consumer", "decode")))


@pytest.mark.parametrize("cut", [0, 1, 5, 20, -1])
def test_truncated_frames_are_malformed(cut):
    client, server = established_pair()
    frame = client.seal(m.Register("t1", [[1]], "d"))
    with pytest.raises(ProtocolError):
        server.open(frame[:cut])


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"hello world", b"\x94\x01\x01\xc4\x00\xc4\x00"])
def test_garbage_is_malformed(garbage):
    _, server = established_pair()
    with pytest.raises(ProtocolError):
        server.open(garbage)


def test_other_protocol_version_is_named():
    import msgspec

    _, server = established_pair()
    frame = msgspec.msgpack.encode((99, 1, b"x" * 32, b""))
    with pytest.raises(ProtocolError, match="version 99"):
        server.open(frame)


def test_decode_rejects_semantic_nonsense():
    for bad in (
        m.Register("", [[1]], "d"),
        m.Register("t", [], "d"),
        m.Register("t", [[-1]], "d"),
        m.Failed("t", "because"),
        m.Register("t\n", [[1]], "d"),
    ):
        with pytest.raises(ProtocolError):
            m.decode(m.encode(bad))


def test_a_session_refuses_a_nonce_too_short_to_be_fresh():
    with pytest.raises(ProtocolError, match="nonce"):
        Session(SECRET, initiator=True, nonce=b"0" * 15)


def test_a_batched_notification_splits_back_and_a_malformed_one_is_refused():
    one, two = m.encode_notif("t1", 1.0), m.encode_notif("t2", 2.0)
    assert m.join_notifs([]) == b"" and m.join_notifs([one]) == one
    batch = m.join_notifs([one, two])
    assert [m.decode_notif(n) for n in m.split_notifs(batch)] == [("t1", 1.0), ("t2", 2.0)]
    assert m.split_notifs(one) == [one]
    empty = m.BATCH_NOTIF_PREFIX + msgspec.msgpack.encode([])
    too_many = m.BATCH_NOTIF_PREFIX + msgspec.msgpack.encode([one] * (m.MAX_NOTIFS_PER_BATCH + 1))
    for malformed in (batch[:-3], m.BATCH_NOTIF_PREFIX + b"\xc1", empty, too_many):
        # Handed back whole, for decode_notif to refuse (and the Node to count).
        assert m.split_notifs(malformed) == [malformed]
        assert m.decode_notif(malformed) is None
    with pytest.raises(ProtocolError, match="notifications in one batch"):
        m.join_notifs([one] * (m.MAX_NOTIFS_PER_BATCH + 1))


# -- release tokens: prefill's answer lets the router, and only its holder, release it --


def test_a_release_token_is_good_for_its_own_transfer_and_boot_only():
    key = release_key(SECRET)
    token = release_token(key, "boot0-boot1", "xfer-1")
    assert release_token_ok(key, "boot0-boot1", "xfer-1", token)
    assert not release_token_ok(key, "boot0-boot1", "xfer-2", token)  # another transfer's
    assert not release_token_ok(key, "boot9-boot1", "xfer-1", token)  # from before a restart
    # The boot and the transfer id cannot trade characters to sign the same bytes.
    assert release_token(key, "ab", "c") != release_token(key, "a", "bc")


@pytest.mark.parametrize(
    "forged",
    [
        "",
        "0" * 64,
        "é" * 64,  # not even ASCII: refused, not raised
        "flip",  # the real token with its last digit changed (below)
        "raw",  # made with the secret itself, not the key derived from it
        "other",  # another deployment's secret
    ],
)
def test_a_forged_release_token_is_refused(forged):
    key = release_key(SECRET)
    real = release_token(key, "boot0", "xfer-1")
    token = {
        "flip": real[:-1] + ("0" if real[-1] != "0" else "1"),
        "raw": release_token(SECRET, "boot0", "xfer-1"),
        "other": release_token(release_key(b"another secret"), "boot0", "xfer-1"),
    }.get(forged, forged)
    assert not release_token_ok(key, "boot0", "xfer-1", token)


def test_the_release_key_is_derived_and_no_session_key():
    key = release_key(SECRET)
    assert key != SECRET and len(key) == 32
    client, server = established_pair()
    assert key not in (client._send_key, client._recv_key, server._refusal_key(client.nonce))


def test_without_a_secret_no_release_token_is_good():
    """An insecure instance hands out no tokens: an empty key proves nothing."""
    for token in ("", release_token(b"", "boot0", "xfer-1")):
        assert not release_token_ok(b"", "boot0", "xfer-1", token)
