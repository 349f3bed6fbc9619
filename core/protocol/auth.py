"""Authenticated framing of protocol messages over one connection.

Frame: msgpack [version, seq, mac, payload]. Hellos (seq 0) are signed with the
shared secret. Once both hellos are in, each direction signs with its own key
derived from the secret and both sides' nonces, and sequence numbers must rise:
a message replayed within the session, carried over from another session, or sent
back to its author fails. A Reject sent before that (seq 0, refusing the peer's
hello) is signed with a key derived from the secret and the peer's nonce, so it
opens only the session it refuses; one that cannot name the peer's nonce (no hello
of the peer's checked out) is sent for people reading the wire, and every Session
refuses it. Nothing here does I/O; a Session only holds counters.
The caller brings the secret (kvpush.vllm.config.load_secret reads it from the
settings or the environment) and each session's random nonce.

A prefill answer's release token is an HMAC too, outside any session: of the
instance's boot and the transfer id, under a key of its own derived from the
secret (`release_key`). The router hands it back to have prefill let go of KV no
decode will claim; it proves the asker read that answer, and opens nothing else.

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
# What release keys are derived under: no key of a session or a refusal starts so.
RELEASE_LABEL = b"kvpush-release-token"
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, int, bytes, bytes])


def _mac(key: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(key, seq.to_bytes(8, "big") + payload, hashlib.sha256).digest()


def _unsigned(payload: bytes) -> str:
    """Why a first frame signed neither as a hello nor for this session is refused."""
    try:
        refusal = isinstance(decode(payload), Reject)
    except ProtocolError:
        refusal = False
    if refusal:
        return (
            "a refusal not signed for this session: the peer has a different shared "
            "secret, or it was replayed from another session"
        )
    return "bad hello signature: the peer has a different shared secret"


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
                return self._seal_refusal(payload)
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

    def _seal_refusal(self, payload: bytes) -> bytes:
        """A Reject before the session's keys exist: a refusal must be sayable then.
        Bound to the peer's nonce where its hello checked out; otherwise signed as a
        hello is: readable on the wire, but no Session believes it, as nothing tells
        it from a replay."""
        if self.peer_hello is not None:
            key = self._refusal_key(self.peer_hello.nonce)
        else:
            key = self._secret
        return msgspec.msgpack.encode((PROTOCOL_VERSION, 0, _mac(key, 0, payload), payload))

    def _refusal_key(self, nonce: bytes) -> bytes:
        """The key of a Reject refusing the hello that carried `nonce`."""
        return hmac.new(self._secret, b"kvpush-refusal" + nonce, hashlib.sha256).digest()

    def _open_hello(self, mac: bytes, payload: bytes) -> Hello | Reject:
        if self.peer_hello is not None:
            raise AuthError("a second hello in one session (replayed?)")
        if hmac.compare_digest(mac, _mac(self._refusal_key(self.nonce), 0, payload)):
            return self._open_refusal(payload)
        if not hmac.compare_digest(mac, _mac(self._secret, 0, payload)):
            raise AuthError(_unsigned(payload))
        message = decode(payload)
        if isinstance(message, Reject):
            raise AuthError(
                "a refusal not signed for this session: replayed from another, or sent "
                "before the peer had our hello"
            )
        if not isinstance(message, Hello):
            raise ProtocolError(f"expected a hello, got {type(message).__name__}")
        if message.nonce == self.nonce:
            raise AuthError("the peer's hello carries our own nonce (reflected)")
        self.peer_hello = message
        self._derive_keys()
        return message

    @staticmethod
    def _open_refusal(payload: bytes) -> Reject:
        message = decode(payload)
        if not isinstance(message, Reject):
            raise ProtocolError(f"expected a refusal, got {type(message).__name__}")
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


def release_key(secret: bytes) -> bytes:
    """The key of an instance's release tokens: derived, never the secret itself, so
    that a token shows nothing a side-channel signature is made with."""
    return hmac.new(secret, RELEASE_LABEL, hashlib.sha256).digest()


def release_token(key: bytes, epoch: str, transfer_id: str) -> str:
    """The token that lets its holder release `transfer_id`'s unclaimed KV on the
    instance in boot `epoch` (hex)."""
    boot = epoch.encode()
    # Length-prefixed: no other (epoch, transfer id) pair signs the same bytes.
    message = len(boot).to_bytes(4, "big") + boot + transfer_id.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def release_token_ok(key: bytes, epoch: str, transfer_id: str, token: str) -> bool:
    """Whether `token` is this boot's for `transfer_id`, compared in constant time.
    Without a key (an insecure instance) no token is good."""
    if not key:
        return False
    expected = release_token(key, epoch, transfer_id).encode()
    return hmac.compare_digest(expected, token.encode(errors="replace"))
