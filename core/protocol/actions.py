"""What the state machines ask the I/O layer to do. Plain records, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.protocol.messages import Message


@dataclass(frozen=True)
class Send:
    """Send `message` to `peer` over the side channel."""

    peer: str
    message: Message


@dataclass(frozen=True)
class Connect:
    """Open a session to the producer at `peer` ("host:port"), which must be engine
    `engine` in boot `epoch` ("" for either: any) to get our NIXL metadata."""

    peer: str
    engine: str = ""
    epoch: str = ""


@dataclass(frozen=True)
class Disconnect:
    """Close the side channel to `peer` (a silent consumer); its loss follows as for
    any closed link."""

    peer: str
    reason: str


@dataclass(frozen=True)
class PostWrite:
    """Producer: fence the KV, then WRITE layers [start, stop) of src_blocks into the
    peer's dst_blocks; `notif` (empty for all but the last WRITE) marks the end."""

    transfer_id: str
    peer: str
    src_blocks: list[int]
    dst_blocks: list[int]
    notif: bytes
    layers: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class ExposeBlocks:
    """Producer (pull): make these blocks' KV readable by NIXL (fence, stage) now,
    before the consumer `peer` is told it may READ them."""

    transfer_id: str
    block_ids: list[int]
    peer: str


@dataclass(frozen=True)
class PostRead:
    """Consumer (pull): READ the peer's remote_blocks into local_blocks."""

    transfer_id: str
    peer: str
    local_blocks: list[int]
    remote_blocks: list[int]


@dataclass(frozen=True)
class Delivered:
    """Consumer: the KV is in the transfer's blocks; the request may proceed."""

    transfer_id: str
    kv_ready_wall: float = 0.0


@dataclass(frozen=True)
class TransferFailed:
    """Consumer: the transfer is over without the KV. Nothing will write into its
    blocks any more, so the engine may free them or recompute into them."""

    transfer_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class ReleaseBlocks:
    """Producer: the engine may free the transfer's source blocks."""

    transfer_id: str
    outcome: str  # "sent" or a failure reason
    nbytes: int = 0  # what WRITEs delivered to the consumer (push)


@dataclass(frozen=True)
class ReleaseRefused:
    """Producer: the router asked to release KV no decode would claim, and it is kept:
    `why` is "claimed" or "announced" (a consumer wants it), or "ended" or "unknown"
    (nothing of it is held here)."""

    transfer_id: str
    why: str


@dataclass(frozen=True)
class ChunkSent:
    """Producer: a WRITE of blocks that earlier chunks of the prompt completed is in the
    consumer's memory, before the prompt's last step (progressive push)."""

    transfer_id: str
    nbytes: int


@dataclass(frozen=True)
class Counted:
    """Something worth a metric that is not an I/O action (a rejected message)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)


Action = (
    Send
    | Connect
    | PostWrite
    | ExposeBlocks
    | PostRead
    | Delivered
    | TransferFailed
    | ReleaseBlocks
    | ReleaseRefused
    | ChunkSent
    | Counted
)
