"""Authenticated framing of protocol messages over one connection.

Frame: msgpack [version, seq, mac, payload]. Hellos, and a Reject refusing one,
(seq 0) are signed with the shared secret. Once both hellos are in, each direction
signs with its own key derived from the secret and both sides' nonces, and sequence
numbers must rise:
a message replayed within the session, carried over from another session, or sent
back to its author fails. Nothing here does I/O; a Session only holds counters.
The caller brings the secret (kvpush.vllm.config.load_secret reads it from the
settings or the environment) and each session's random nonce.

Rejections raise AuthError or ProtocolError and leave the session unchanged.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvpush.errors import AuthError, ProtocolError
from kvpush.protocol.messages import PROTOCOL_VERSION, Hello, Message, Reject, decode, encode

MAC_BYTES = 32
NONCE_BYTES = 16  # the least a hello's nonce may hold
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, int, bytes, bytes])


def _mac(key: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(key, seq.to_bytes(8, "big") + payload, hashlib.sha256).digest()


class Session:
    """One end of an authenticated connection. `initiator` is the side that connected;
    `nonce` must be fresh random bytes, never reused: the session keys derive from it."""

    def __init__(self, secret: bytes, initiator: bool, nonce: bytes) -> None:
        if len(nonce) < NONCE_BYTES:
            raise ProtocolError(f"a session nonce needs at least {NONCE_BYTES} random bytes")
        self._secret = secret
        self.initiator = initiator
        self.nonce = nonce
        self.peer_hello: Hello | None = None
        self._send_key = self._recv_key = b""
        self._sent_hello = False
        self._seq_out = 0
        self._seq_in = 0

    @property
    def established(self) -> bool:
        return self._sent_hello and self.peer_hello is not None

    def seal(self, message: Message) -> bytes:
        """The framed, signed bytes of `message`."""
        payload = encode(message)
        if isinstance(message, Hello):
            if self._sent_hello:
                raise ProtocolError("a session sends one hello")
            if message.nonce != self.nonce:
                raise ProtocolError("the hello must carry this session's nonce")
            self._sent_hello = True
            self._derive_keys()
            mac = _mac(self._secret, 0, payload)
            return msgspec.msgpack.encode((PROTOCOL_VERSION, 0, mac, payload))
        if not self.established:
            if isinstance(message, Reject):
                # A refusal must be sayable before the session exists.
                return msgspec.msgpack.encode(
                    (PROTOCOL_VERSION, 0, _mac(self._secret, 0, payload), payload)
                )
            raise ProtocolError("no message before both hellos")
        self._seq_out += 1
        mac = _mac(self._send_key, self._seq_out, payload)
        return msgspec.msgpack.encode((PROTOCOL_VERSION, self._seq_out, mac, payload))

    def open(self, frame: bytes) -> Message:
        """The message in `frame`, after checking version, signature and order."""
        try:
            version, seq, mac, payload = _frame_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed frame: {exc}") from None
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks kvpush protocol version {version}; this side speaks "
                f"{PROTOCOL_VERSION}"
            )
        if not 0 <= seq < 1 << 63:
            raise ProtocolError(f"frame sequence number {seq} is out of range")
        if len(mac) != MAC_BYTES:
            raise AuthError("frame signature has the wrong length")
        if seq == 0:
            return self._open_hello(mac, payload)
        if self.peer_hello is None:
            raise AuthError("message before the peer's hello")
        if not self._recv_key:
            raise ProtocolError("message before this side's hello")
        if not hmac.compare_digest(mac, _mac(self._recv_key, seq, payload)):
            raise AuthError("bad signature: forged, corrupted, or from another session")
        if seq <= self._seq_in:
            raise AuthError(f"replayed message (sequence {seq} after {self._seq_in})")
        message = decode(payload)
        if isinstance(message, Hello):
            raise ProtocolError("hello after the session started")
        self._seq_in = seq
        return message

    def _open_hello(self, mac: bytes, payload: bytes) -> Hello | Reject:
        if self.peer_hello is not None:
            raise AuthError("a second hello in one session (replayed?)")
        if not hmac.compare_digest(mac, _mac(self._secret, 0, payload)):
            raise AuthError("bad hello signature: the peer has a different shared secret")
        message = decode(payload)
        if isinstance(message, Reject):
            return message
        if not isinstance(message, Hello):
            raise ProtocolError(f"expected a hello, got {type(message).__name__}")
        if message.nonce == self.nonce:
            raise AuthError("the peer's hello carries our own nonce (reflected)")
        self.peer_hello = message
        self._derive_keys()
        return message

    def _derive_keys(self) -> None:
        if not (self._sent_hello and self.peer_hello is not None):
            return
        ours, theirs = self.nonce, self.peer_hello.nonce
        first, second = (ours, theirs) if self.initiator else (theirs, ours)
        base = hmac.new(self._secret, b"kvpush-session" + first + second, hashlib.sha256).digest()
        to_acceptor = hmac.new(base, b"initiator->acceptor", hashlib.sha256).digest()
        to_initiator = hmac.new(base, b"acceptor->initiator", hashlib.sha256).digest()
        if self.initiator:
            self._send_key, self._recv_key = to_acceptor, to_initiator
        else:
            self._send_key, self._recv_key = to_initiator, to_acceptor
