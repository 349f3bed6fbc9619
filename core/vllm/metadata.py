"""What the scheduler half tells the worker halves each step, and what workers report,
as vLLM's connector contract types them. The step's records are kvpush.engine.steps'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpush.engine.steps import StepPlan


@dataclass
class KVPushMetadata(StepPlan, KVConnectorMetadata):
    """A step's plan (kvpush.engine.steps), and how the workers may wait after it."""

    doorbell: int = 0  # the scheduler's doorbell port (kvpush.vllm.wake)
    doorbell_key: str = ""  # what a landing's ring carries to be believed
    park: bool = False  # nothing to compute until a transfer ends: workers may sleep

    @classmethod
    def of(cls, plan: StepPlan) -> KVPushMetadata:
        return cls(**vars(plan))


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
    # Prefill: transfer id -> rank -> what the router's release did there ("released",
    # or why the KV is kept: kvpush.protocol.actions.ReleaseRefused).
    releases: dict[str, dict[int, str]] = field(default_factory=dict)
    # Rank -> its identity, when its node started afresh (restore_kv_caches: a new boot).
    handshakes: dict[int, KVPushHandshake] = field(default_factory=dict)

    NOTES = ("landed", "kv_ready", "chunk_sent")  # each a spans milestone of that name

    def is_empty(self) -> bool:
        if self.failed or self.states or self.hooks or self.releases or self.handshakes:
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
        merged.handshakes = {**getattr(other, "handshakes", {}), **self.handshakes}
        theirs = getattr(other, "releases", {})
        merged.releases = {
            tid: {**theirs.get(tid, {}), **self.releases.get(tid, {})}
            for tid in theirs.keys() | self.releases.keys()
        }
        return merged
