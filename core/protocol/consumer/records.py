"""What the consumer keeps: sessions to producers, and transfers in two levels.

A transfer as the engine sees it is a Request; with tensor parallelism of
different sizes on the two sides it takes its KV heads from several producer
ranks, a Part from each (keyed (transfer id, producer peer)). The request is
delivered once every part is; a part that fails gives up the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.layout import KVLayout, page_factors, to_pages
from kvpush.protocol.consumer.moves import EVENTS, Event, State
from kvpush.protocol.messages import Complete, Hello

# A part's key: (transfer id, the producer peer it takes its KV from).
Key = tuple[str, str]


@dataclass
class Peer:
    """A session to a producer: coming, or ready with its handshake and layout."""

    state: str  # connecting | ready
    hello: Hello | None = None
    layout: KVLayout | None = None

    def factors(self, block_tokens: int | None) -> tuple[int, int]:
        """Pages per block, ours (`block_tokens` a block; None: as theirs) and the
        producer's: with different block sizes a pair counts blocks in pages of the
        smaller (ids on the wire are page ids)."""
        assert self.layout is not None
        theirs = self.layout.tokens_per_block
        return page_factors(block_tokens or theirs, theirs)

    def grant_problem(self, asked: int, ours: int, theirs: int, remote: list[int]) -> str:
        """What is wrong with the producer's pages `remote`, granted for `asked` of
        ours (`ours` a block), if anything."""
        assert self.layout is not None
        # Our last block may reach past the prompt's last page by less than a block.
        if not asked - ours < len(remote) <= asked:
            return f"granted {len(remote)} blocks for {asked} asked"
        count = self.layout.num_blocks * theirs
        bad = [b for b in remote if b >= count]
        if bad:
            return f"granted block ids {bad[:8]} outside the producer's {count}"
        if remote and remote[-1] == self.layout.null_block:
            return "the last granted block is the null block"
        return ""


@dataclass(frozen=True)
class Source:
    """A producer rank a transfer takes KV from: its side channel `peer`, its boot
    `epoch` as the decode leg names it ("": any), and how many consumer ranks claim
    the transfer from it (`parts`; more than one when it holds KV heads several
    consumer ranks hold)."""

    peer: str
    epoch: str = ""
    parts: int = 1


@dataclass
class Request:
    """A transfer as the engine sees it: its parts, and how they ended so far."""

    keys: set[Key]
    blocks: bool = False  # the engine allocated blocks (an outcome is owed)
    reason: str = ""  # the first part's failure
    detail: str = ""
    kv_ready_wall: float = 0.0


@dataclass
class Part:
    """What one producer rank sends of a transfer."""

    transfer_id: str
    peer: str
    blocks: list[int] | None = None
    skip_blocks: int = 0
    engine: str = ""  # the producer engine the decode leg names ("": any)
    epoch: str = ""  # and that engine's boot ("": any)
    state: State = State.ANNOUNCED
    claimed_at: float = 0.0  # last Register/Heartbeat that extended the producer's hold
    give_up_at: float = 0.0  # max_wait_s after the blocks were allocated
    read_deadline: float = 0.0
    notified: bool = False
    writing: bool = False  # push: the producer said Writing
    kv_ready_wall: float = 0.0
    complete: Complete | None = None
    cancel_reason: str | None = None
    parts: int = 1  # consumer ranks claiming the transfer from this producer

    @property
    def key(self) -> Key:
        return (self.transfer_id, self.peer)

    def fire(self, event: Event) -> None:
        EVENTS.fire(self, event)

    def pages(self, ours: int) -> list[int]:
        assert self.blocks is not None
        return to_pages(self.blocks, ours)
