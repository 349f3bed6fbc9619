"""What the scheduler half tells the worker halves each step, and what workers report.

Plain records: they are pickled into every worker process every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class Expect:
    """Decode: blocks allocated for `transfer_id`; claim the producer's KV for them."""

    request_id: str
    transfer_id: str
    producers: tuple[str, ...]  # side-channel address of each producer TP rank
    block_ids: tuple[int, ...]
    skip_blocks: int
    engine: str = ""  # the producer's engine id, as the decode leg names it
    epochs: tuple[str, ...] = ()  # each producer rank's boot, as the decode leg names them


@dataclass(frozen=True)
class Announce:
    """Decode: a request for `transfer_id` is queued; keep the producer's KV alive."""

    transfer_id: str
    producers: tuple[str, ...]
    engine: str = ""  # as Expect's
    epochs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pending:
    """Prefill: the engine took the request for `transfer_id`; it will compute its KV.

    `sequential`: its prefill leg brought no transfer id (kvpush named it), so its
    orchestrator sends the decode leg only after this instance answers: a decode
    that has not announced itself within orphan_grace_s of the answer never will.
    """

    transfer_id: str
    sequential: bool = False


@dataclass(frozen=True)
class Produce:
    """Prefill: the KV of `transfer_id` will be complete at the end of this step."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Progress:
    """Prefill, chunked: this step computes part of the prompt, not its last token; at
    its end the first `full_blocks` of `block_ids` are complete in every layer."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    full_blocks: int


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    expects: list[Expect] = field(default_factory=list)
    announces: list[Announce] = field(default_factory=list)
    produces: list[Produce] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)  # prefill requests admitted
    aborts: list[str] = field(default_factory=list)  # transfer ids given up (either role)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    doorbell: int = 0  # the scheduler's doorbell port (kvpush.vllm.wake)
    park: bool = False  # nothing to compute until a transfer ends: workers may sleep

    def carries_work(self) -> bool:
        """Whether the workers must act on this step's metadata."""
        return bool(
            self.expects or self.announces or self.produces or self.progress
            or self.pending or self.aborts or self.rejects
        )  # fmt: skip


@dataclass(frozen=True)
class KVPushHandshake(KVConnectorHandshakeMetadata):
    """One worker rank's kvpush identity, gathered by the engine for the scheduler."""

    rank: int
    world: int
    address: str  # host:port of the rank's side channel, "" for pure consumers
    epoch: str
    agent: str


@dataclass
class KVPushWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler half each step, besides finished ids."""

    # Each: request id -> wall time. Decode: its KV landed, and the producer's last
    # prompt step had ended; prefill: the first WRITE of an earlier chunk's KV ended.
    landed: dict[str, float] = field(default_factory=dict)
    kv_ready: dict[str, float] = field(default_factory=dict)
    chunk_sent: dict[str, float] = field(default_factory=dict)
    # Decode: request id -> why its KV load failed (the first rank's reason to say so).
    failed: dict[str, str] = field(default_factory=dict)
    # Rank -> its transfers per machine state ("producer.held": 2, ...), when changed.
    states: dict[int, dict[str, int]] = field(default_factory=dict)
    # Rank -> which of kvpush's vLLM hooks attached there (kvpush.vllm.hooks), once.
    hooks: dict[int, dict[str, str]] = field(default_factory=dict)

    NOTES = ("landed", "kv_ready", "chunk_sent")  # each a spans milestone of that name

    def is_empty(self) -> bool:
        if self.failed or self.states or self.hooks:
            return False
        return not any(getattr(self, name) for name in self.NOTES)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPushWorkerMeta:
        # A request's KV is whole (or has left) when its last rank's share has.
        merged = KVPushWorkerMeta()
        for name in self.NOTES:
            mine, theirs = getattr(self, name), getattr(other, name, {})
            into = getattr(merged, name)
            for request_id in mine.keys() | theirs.keys():
                into[request_id] = max(mine.get(request_id, 0.0), theirs.get(request_id, 0.0))
        merged.failed = {**getattr(other, "failed", {}), **self.failed}
        merged.states = {**getattr(other, "states", {}), **self.states}
        merged.hooks = {**getattr(other, "hooks", {}), **self.hooks}
        return merged
