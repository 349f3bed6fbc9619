"""Protocol timing and limits, validated with errors that name the bad key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.errors import ConfigError
from kvpush.protocol.messages import MODES


@dataclass(frozen=True)
class ProtocolConfig:
    """Timers, in seconds.

    lease_s: how long a producer holds finished KV nobody has claimed (push), or
        granted KV nobody released (pull). Consumer heartbeats extend it.
    registration_ttl_s: how long a producer keeps a registration whose KV is not ready;
        consumer heartbeats extend it.
    watchdog_s: how long a consumer waits without a sign of life for a transfer;
        producer heartbeats (the request is still queued or computing) extend it.
    heartbeat_s: how often each side says which transfers are still alive.
    write_grace_s: the longest a WRITE already posted may still be landing, after
        its producer said nothing more would be posted.
    landing_s: how long a consumer waits for NIXL's notification after Complete.
    max_wait_s: the most a consumer waits for one transfer, heartbeats or not, so a
        producer whose engine hangs cannot keep decode's blocks forever.
    tombstone_s: how long an ended transfer id is remembered, to answer latecomers.
    silence_s: a producer that has heard nothing from a consumer for this long, while
        it may still WRITE into that consumer's blocks, drops the session and writes
        nothing more. So a consumer whose link broke (perhaps only on its side) may
        reuse those blocks `silence_s` after the last thing it sent, plus the time a
        posted WRITE may take to land. At least three heartbeats.
    link_timeout_s: a side-channel link whose peer has acknowledged nothing for this
        long, not even TCP's own probes, is dropped and handled as any lost link: its
        transfers end and its NIXL peer is let go. A host that vanishes (power lost, a
        cable cut) closes no connection; only this notices. Longer than the network
        cuts a link should survive; at least three heartbeats.
    write_retries: how many times a WRITE that failed (its route went in a short
        network cut) is posted again, a heartbeat apart, while the consumer's claim
        holds the blocks; only then does the transfer fail as write_failed. Rewriting
        the same bytes into the same registered blocks is safe. 0: fail at once.
    orphan_grace_s: how long a producer holds the computed KV of a transfer it named
        itself (its orchestrator sends the decode leg only after prefill answered)
        for a consumer to announce it; one that has not by then never will. It only
        shortens the lease: a lease_s below it wins.
    """

    mode: str = "push"
    lease_s: float = 60.0
    registration_ttl_s: float = 60.0
    watchdog_s: float = 30.0
    heartbeat_s: float = 2.0
    write_grace_s: float = 10.0
    landing_s: float = 5.0
    max_wait_s: float = 600.0
    tombstone_s: float = 300.0
    orphan_grace_s: float = 10.0
    silence_s: float = 10.0
    link_timeout_s: float = 30.0
    write_retries: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        for field in dataclasses.fields(self):
            if field.name in ("mode", "write_retries"):
                continue
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{field.name} must be a positive number, got {value!r}")
        retries = self.write_retries
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"write_retries must be a whole number >= 0, got {retries!r}")
        if self.heartbeat_s * 2 > min(self.lease_s, self.registration_ttl_s, self.watchdog_s):
            raise ConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be at most half of lease_s, "
                "registration_ttl_s and watchdog_s, or a live transfer could expire"
            )
        if self.heartbeat_s * 3 > self.link_timeout_s:
            raise ConfigError(
                f"link_timeout_s ({self.link_timeout_s}) must be at least three heartbeats "
                f"({3 * self.heartbeat_s}), or a moment's congestion drops a live link"
            )
        if self.heartbeat_s * 3 > self.silence_s:
            raise ConfigError(
                f"silence_s ({self.silence_s}) must be at least three heartbeats "
                f"({3 * self.heartbeat_s}), or a consumer that misses one beat is dropped"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ProtocolConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown protocol setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


class Machine:
    """What each of the protocol's machines knows of its own worker's KV cache."""

    def __init__(self, config: ProtocolConfig, block_tokens: int | None, null_block: int) -> None:
        self.config = config
        # Tokens per block of our KV cache (None: as every peer's, as in models of one).
        self.block_tokens = block_tokens
        self.null_block = null_block  # our layout's (kvpush.layout.moving_pairs)
