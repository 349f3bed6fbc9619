"""Every message between a producer (prefill) and a consumer (decode), and their codec.

Messages are msgspec structs tagged by kind, packed with msgpack. They travel inside
an authenticated envelope (see `kvpush.protocol.auth`); this module only turns
bytes into typed messages and back, refusing anything malformed with a
ProtocolError that says what was wrong.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvpush.errors import ProtocolError
from kvpush.layout import KVLayout

# 2: PullRequest names the blocks the consumer holds already (skip_blocks); NIXL
#    metadata moves out of Hello into AgentMetadata, after Verify.
# 3: Writing, so a consumer calls into NIXL often only while bytes may be moving.
# 4: the "orphaned" failure reason; layouts move out of Hello into AgentMetadata,
#    so nothing about our memory is sent before the peer proved itself.
# 5: a Reject before the session's keys is signed for the peer's nonce, so a
#    recorded one refuses no other session.
PROTOCOL_VERSION = 5
MODES = ("push", "pull")
MAX_BLOCKS = 1 << 20
MAX_PARTS = 1024  # consumer ranks one producer rank may serve a transfer to
MAX_TRANSFER_ID = 256

# Failure reasons carried by Failed and Cancel, and reported to the engine.
REASONS = (
    "write_failed",  # the producer could not post or complete the WRITE
    "read_failed",  # the consumer's READ failed (pull)
    "handshake_failed",  # the peers could not pair: version, mode, layout, auth, metadata
    "aborted",  # either side's engine aborted the request
    "lease_expired",  # the producer freed the KV before the consumer claimed it
    "orphaned",  # nobody announced KV the producer named itself within orphan_grace_s
    "watchdog_expired",  # the consumer heard nothing in time
    "registration_expired",  # the producer never got the KV for a registration in time
    "bad_blocks",  # block ids out of range, wrong count, or a stale layout
    "conflict",  # the transfer id is already bound to another consumer or other blocks
    "unknown_transfer",  # the producer has no such transfer (pull) or forgot it
    "peer_lost",  # the side channel to the peer closed
    "shutdown",  # a side is shutting down
)


class Identity(msgspec.Struct, frozen=True):
    """Who a worker is: engine, rank within its TP group, and this boot's epoch."""

    engine_id: str
    rank: int = 0
    world: int = 1
    epoch: str = ""

    def label(self) -> str:
        return f"{self.engine_id}/rank{self.rank}@{self.epoch}"


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First message each way: who I am, how I transfer, and the digest of my KV
    layout.

    Not the layout itself nor the NIXL metadata that opens my memory to the peer: a
    hello signed with the shared secret may be a replay, so those come in
    AgentMetadata, once the peer has proved it holds the secret in this very session
    (see docs/protocol.md). A hello is small, so a peer that has not proved anything
    yet may send only a few KiB.
    """

    identity: Identity
    mode: str
    role: str  # "producer" | "consumer" | "both"
    agent_name: str
    layout_digest: str
    nonce: bytes
    lease_s: float
    registration_ttl_s: float
    # A producer's silence_s (see ProtocolConfig); 0: it keeps no such rule, so its
    # registrations are the only bound on its WRITEs.
    silence_s: float = 0.0
    heartbeat_s: float = 0.0  # how often this side heartbeats its live transfers
    # Which machine it runs on (kvpush.addresses.machine_id; "": not said): whether
    # its KV crosses a network decides how WRITEs to it are ordered.
    machine: str = ""


class Verify(msgspec.Struct, tag="verify", frozen=True):
    """The acceptor's first message under the session's keys: proof that it holds
    the secret and is answering this session, not replaying an old hello."""


class AgentMetadata(msgspec.Struct, tag="agent_metadata", frozen=True):
    """The sender's KV layout (the one its hello's digest names) and NIXL agent
    metadata: what lets the peer reach its memory. Sent only under the session's
    keys, after the peer proved itself."""

    metadata: bytes
    layout: KVLayout


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """The handshake failed; `reason` says why in words. Before the session's keys
    exist it is signed for the peer's nonce (kvpush.protocol.auth)."""

    reason: str


class Register(msgspec.Struct, tag="register", frozen=True):
    """Push: the consumer's destination blocks for a transfer.

    `skip_blocks` leading blocks of the producer's KV are already on the consumer
    (prefix cache) and are not written; `block_ids[0]` are the destinations, in
    order (a hybrid model's KV cache groups interleaved: kvpush.layout.interleave;
    the outer list is kept one long). `parts`: how many consumer ranks claim this
    transfer from this producer rank (1 unless the two sides' tensor-parallel sizes
    differ).
    """

    transfer_id: str
    block_ids: list[list[int]]
    layout_digest: str
    skip_blocks: int = 0
    parts: int = 1


class PullRequest(msgspec.Struct, tag="pull_request", frozen=True):
    """Pull: the consumer asks for a transfer's source blocks and a read lease.

    It wants `num_blocks` blocks after the first `skip_blocks`, which it holds
    already (prefix cache).
    """

    transfer_id: str
    num_blocks: int
    skip_blocks: int = 0
    parts: int = 1  # as Register's


class Grant(msgspec.Struct, tag="grant", frozen=True):
    """Pull: the producer's source blocks, readable for `lease_s` from when it was asked."""

    transfer_id: str
    block_ids: list[list[int]]
    lease_s: float


class Complete(msgspec.Struct, tag="complete", frozen=True):
    """Push: the WRITE finished; its NIXL notification carries `notif` too."""

    transfer_id: str
    notif: bytes
    nbytes: int
    kv_ready_wall: float


class Release(msgspec.Struct, tag="release", frozen=True):
    """Pull: the consumer is done reading; the producer may free the blocks."""

    transfer_id: str


class Writing(msgspec.Struct, tag="writing", frozen=True):
    """Push: the producer is about to post the transfer's first WRITE. Some transports
    (UCX over TCP) move a WRITE's bytes only while the target, too, calls into NIXL:
    the consumer does so often from now on, and only now."""

    transfer_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """These transfers are still wanted (consumer) or still coming (producer)."""

    transfer_ids: list[str]


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """The sender abandons a transfer; the producer answers CancelAck once nothing
    more will be written for it."""

    transfer_id: str
    reason: str


class CancelAck(msgspec.Struct, tag="cancel_ack", frozen=True):
    """The producer writes nothing more for the transfer. `may_land`: a WRITE it
    gave up on (timed out) may still land; hold the blocks a landing's length."""

    transfer_id: str
    may_land: bool = False


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """The transfer is over and failed; the sender writes nothing more for it.
    `may_land` as for CancelAck."""

    transfer_id: str
    reason: str
    detail: str = ""
    may_land: bool = False


Message = Union[  # noqa: UP007 - msgspec needs the Union spelling for tagged unions
    Hello,
    Verify,
    AgentMetadata,
    Reject,
    Register,
    PullRequest,
    Grant,
    Complete,
    Release,
    Heartbeat,
    Writing,
    Cancel,
    CancelAck,
    Failed,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


NOTIF_PREFIX = b"kvpush:"


def encode_notif(transfer_id: str, kv_ready_wall: float) -> bytes:
    """The NIXL notification riding on a transfer's last WRITE."""
    return NOTIF_PREFIX + msgspec.msgpack.encode((transfer_id, kv_ready_wall))


def decode_notif(notif: bytes) -> tuple[str, float] | None:
    """(transfer id, producer's KV-ready wall clock), or None if it is not ours."""
    if not notif.startswith(NOTIF_PREFIX):
        return None
    try:
        transfer_id, wall = msgspec.msgpack.decode(
            notif[len(NOTIF_PREFIX) :], type=tuple[str, float]
        )
        check_transfer_id(transfer_id)
    except (msgspec.DecodeError, msgspec.ValidationError, ProtocolError):
        return None
    return transfer_id, wall


# One NIXL WRITE may carry the last layers of several transfers to the same consumer
# (a batch that one forward pass computed); its notification then bundles theirs.
BATCH_NOTIF_PREFIX = b"kvpush+:"
MAX_NOTIFS_PER_BATCH = 1024


def join_notifs(notifs: list[bytes]) -> bytes:
    """One notification standing for all of `notifs` (b"" for none, itself for one)."""
    if len(notifs) <= 1:
        return notifs[0] if notifs else b""
    if len(notifs) > MAX_NOTIFS_PER_BATCH:
        raise ProtocolError(
            f"{len(notifs)} notifications in one batch (at most {MAX_NOTIFS_PER_BATCH})"
        )
    return BATCH_NOTIF_PREFIX + msgspec.msgpack.encode(notifs)


def split_notifs(notif: bytes) -> list[bytes]:
    """The notifications a (possibly batched) one stands for.

    A malformed batch comes back whole, for decode_notif to refuse and count.
    """
    if not notif.startswith(BATCH_NOTIF_PREFIX):
        return [notif]
    try:
        parts = msgspec.msgpack.decode(notif[len(BATCH_NOTIF_PREFIX) :], type=list[bytes])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return [notif]
    if not parts or len(parts) > MAX_NOTIFS_PER_BATCH:
        return [notif]
    return parts


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """A typed message, or ProtocolError saying why the bytes are not one."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    except Exception as exc:  # a layout that fails its own checks, for one
        raise ProtocolError(f"malformed message: {exc}") from None
    check(message)
    return message


def check(message: Message) -> None:
    """Semantic checks msgspec's types cannot express."""
    transfer_id = getattr(message, "transfer_id", None)
    if transfer_id is not None:
        check_transfer_id(transfer_id)
    reason = getattr(message, "reason", None)
    if isinstance(message, Cancel | Failed) and reason not in REASONS:
        raise ProtocolError(f"unknown failure reason {reason!r}")
    if isinstance(message, Hello):
        if message.mode not in MODES:
            raise ProtocolError(f"unknown transfer mode {message.mode!r}")
        if len(message.nonce) < 16:
            raise ProtocolError("hello nonce is too short")
    if isinstance(message, AgentMetadata) and not message.metadata:
        raise ProtocolError("empty NIXL agent metadata")
    if isinstance(message, Register | Grant):
        check_block_lists(message.block_ids)
    if isinstance(message, (Register, PullRequest)):
        if message.skip_blocks < 0:
            raise ProtocolError(f"skip_blocks must be >= 0, got {message.skip_blocks}")
        if not 1 <= message.parts <= MAX_PARTS:
            raise ProtocolError(f"parts must be in 1..{MAX_PARTS}, got {message.parts}")
    if isinstance(message, Heartbeat):
        for tid in message.transfer_ids:
            check_transfer_id(tid)


def check_transfer_id(transfer_id: str) -> None:
    if not transfer_id or len(transfer_id) > MAX_TRANSFER_ID or not transfer_id.isprintable():
        raise ProtocolError(f"invalid transfer id {transfer_id[:40]!r}")


def check_block_lists(block_ids: list[list[int]]) -> None:
    if not block_ids:
        raise ProtocolError("block id list has no cache group")
    if sum(len(group) for group in block_ids) > MAX_BLOCKS:
        raise ProtocolError("block id list is too long")
    for group in block_ids:
        if any(b < 0 for b in group):
            raise ProtocolError("block ids must be >= 0")
