"""A transfer id's source: the engine's KV as prefill computes it, and the claims on it.

With tensor parallelism of different sizes on the two sides, several consumer
ranks may claim one transfer's KV from this rank (each takes the heads it holds;
how many is in their claims). The source holds what they share, the engine's
blocks and how far they are computed, and one claim per consumer. It finishes
when its last claim ends and no claim the consumers announced is still to come,
or unclaimed, when its lease runs out: then its blocks go back, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.layout import KVLayout, page_factors
from kvpush.protocol.messages import Hello, Register
from kvpush.protocol.producer.moves import SOURCE, Event, State

if TYPE_CHECKING:
    from kvpush.protocol.producer.claims import Claim


@dataclass
class Source:
    transfer_id: str
    num_layers: int
    state: State = State.COMPUTING  # its own: claimed once its claims hold it
    known: bool = False  # the engine reported the request (claims need not wait)
    kv_blocks: list[int] | None = None  # the engine's blocks, once any KV is computed
    whole: bool = False  # kv_blocks is the request's whole list: its last step began
    blocks_ready: int = 0  # before that: leading blocks complete in every layer
    layers_ready: int = 0  # from it on: layers 0..layers_ready-1 of every block
    engine_done: bool = False  # the engine's last report (or its abort) came
    kv_ready_wall: float = 0.0
    # The producer named it (a sequential orchestrator's leg): unless a consumer
    # announces it, its computed KV is held only orphan_grace_s.
    sequential: bool = False
    announced: bool = False  # a consumer's heartbeat named it
    claims: dict[str, Claim] = field(default_factory=dict)  # by consumer peer
    accepted: int = 0  # claims accepted (one per consumer rank)
    expected: int = 1  # claims the consumer ranks said would come (Register.parts)
    outcome: str = ""  # the first failed claim's reason ("" while every claim was sent)
    nbytes: int = 0  # what the ended claims wrote

    peer = None  # a source is no consumer's: its deadlines are keyed (id, None)

    @property
    def key(self) -> tuple[str, None]:
        return (self.transfer_id, None)

    @property
    def source(self) -> Source:
        return self

    def fire(self, event: Event) -> None:
        SOURCE.fire(self, event)

    def give_up(self, reason: str, detail: str) -> bool:
        """Nothing of an unclaimed source is in flight: it ends at once."""
        return False

    @property
    def all_computed(self) -> bool:
        return self.layers_ready == self.num_layers

    def span(self, wanted: int, held: int, their_pages: int) -> int | None:
        """How many of `wanted` positions a claim's KV covers when `held` pages of it
        are ours to send, or None when the consumer wants KV we will never have. Its
        last block may reach past our last page by less than a block of its own:
        tokens the prompt does not have. Until the list is whole, more may come."""
        if not self.whole:
            return wanted
        return min(wanted, held) if wanted - held < their_pages else None

    def reported(self) -> None:
        """The engine reported the request: claims made before it need not wait."""
        self.known = True
        for claim in self.claims.values():
            if claim.state == State.EARLY:
                claim.fire(Event.ENGINE)

    def refusal(self, parts: int) -> tuple[str, str] | None:
        """Why one more consumer may not claim the KV, which `parts` consumer ranks in
        all claim from here (checked after the claimant's own earlier claim)."""
        if self.accepted == 0:
            return None
        if parts != self.expected:
            return "conflict", (
                f"the claims disagree on how many consumer ranks take this KV from this "
                f"rank ({self.expected} before, {parts} now)"
            )
        if self.accepted >= self.expected:
            return "conflict", "the transfer id is already claimed"
        return None

    def more_expected(self) -> bool:
        """Another consumer rank will claim this KV: every claim so far was sent."""
        return self.accepted < self.expected and not self.outcome


@dataclass
class Peer:
    """A consumer's session: its handshake and how its KV is laid out."""

    hello: Hello
    layout: KVLayout

    def factors(self, block_tokens: int | None) -> tuple[int, int]:
        """Pages per block, ours (`block_tokens` a block; None: as theirs) and theirs:
        with different block sizes a pair counts blocks in pages of the smaller (ids
        on the wire are page ids)."""
        theirs = self.layout.tokens_per_block
        return page_factors(block_tokens or theirs, theirs)

    def destination_problem(self, message: Register, block_tokens: int | None) -> str | None:
        """What is wrong with the blocks a registration names, if anything."""
        if message.layout_digest != self.layout.digest():
            return "the registration names a KV layout other than the one in the handshake"
        if len(message.block_ids) != 1:
            return f"{len(message.block_ids)} KV cache groups; one is supported"
        _, pages = self.factors(block_tokens)
        count = self.layout.num_blocks * pages
        blocks = message.block_ids[0]
        bad = [b for b in blocks if b >= count]
        if bad:
            what = "block" if pages == 1 else f"page ({pages} a block)"
            return f"{what} ids {bad[:8]} out of range: the consumer has {count}"
        real = [b for b in blocks if b != self.layout.null_block]
        if len(set(real)) != len(real):
            return "a destination block appears twice"
        if blocks and blocks[-1] == self.layout.null_block:
            return "the last destination is the null block (no window leaves the prompt's end)"
        return None
