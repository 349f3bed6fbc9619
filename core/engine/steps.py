"""What the scheduler tells its workers each step: plain records, pickled into every
worker process every step.

A record's `block_ids` is one list for all KV cache groups: position i's block of
each group in turn (kvpush.layout.interleave), so counts of blocks (`skip_blocks`,
`full_blocks`) count entries of that list."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
    network: str = ""  # where the producer's loopback leads, as the decode leg names it


@dataclass(frozen=True)
class Announce:
    """Decode: a request for `transfer_id` is queued; keep the producer's KV alive."""

    transfer_id: str
    producers: tuple[str, ...]
    engine: str = ""  # as Expect's
    epochs: tuple[str, ...] = ()
    network: str = ""


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
class StepPlan:
    """Everything one step tells the workers about transfers."""

    expects: list[Expect] = field(default_factory=list)
    announces: list[Announce] = field(default_factory=list)
    produces: list[Produce] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)  # prefill requests admitted
    aborts: list[str] = field(default_factory=list)  # transfer ids given up (either role)
    # Prefill: transfer ids whose decode leg never reached decode, by the router's word.
    releases: list[str] = field(default_factory=list)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)

    def carries_work(self) -> bool:
        """Whether the workers must act on this step's plan."""
        return bool(
            self.expects or self.announces or self.produces or self.progress
            or self.pending or self.aborts or self.releases or self.rejects
        )  # fmt: skip


def state_positions(
    groups: Sequence[Sequence[int]], states: Sequence[int], null: int, length: int
) -> list[list[int]]:
    """The first `length` positions of each KV cache group's block list, with the
    recurrent-state groups (`states`: their indices) holding only their running
    state, at the last position: of a Mamba-style group's blocks only that one is
    the request's state after its last computed token (the others are empty, or
    states after earlier tokens that decode does not read), and vLLM lays it out
    at the last position in one cache mode and alone in another."""
    out = []
    for index, blocks in enumerate(groups):
        if index not in states:
            out.append(list(blocks[:length]))
            continue
        live = [block for block in blocks if block != null]
        out.append([null] * (length - 1) + live[-1:] if live and length else [null] * length)
    return out
