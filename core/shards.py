"""Which of a model's KV heads each tensor-parallel rank holds, and which producer
rank fills each consumer rank's heads when the two sides' TP sizes differ
(kvpush.layout maps the heads' bytes)."""

from __future__ import annotations

from typing import NamedTuple

import msgspec


class Shard(msgspec.Struct, frozen=True):
    """Which of the model's `heads` KV heads TP rank `rank` of `world` holds, as vLLM
    shards them: an equal share each, or, with fewer heads than ranks, one head,
    replicated over world / heads ranks. MLA's latent is one head, replicated."""

    rank: int = 0
    world: int = 1
    heads: int = 1

    @property
    def first(self) -> int:
        if self.heads >= self.world:
            return self.rank * (self.heads // self.world)
        return self.rank * self.heads // self.world

    @property
    def count(self) -> int:
        return max(1, self.heads // self.world)

    def holds(self, head: int) -> bool:
        return self.first <= head < self.first + self.count


class Piece(NamedTuple):
    """Heads [first, first + count) of the model go from producer rank `src` to
    consumer rank `dst`."""

    src: int
    dst: int
    first: int
    count: int


def assignment(src_world: int, dst_world: int, heads: int) -> list[Piece]:
    """Which producer rank fills which heads of each consumer rank: every head a
    consumer rank holds comes from exactly one producer rank holding it (replicas
    taken in turn by consumer rank), consecutive heads from one rank in one piece."""
    pieces: list[Piece] = []
    for dst in range(dst_world):
        mine = Shard(dst, dst_world, heads)
        for head in range(mine.first, mine.first + mine.count):
            holders = [s for s in range(src_world) if Shard(s, src_world, heads).holds(head)]
            src = holders[dst % len(holders)]
            last = pieces[-1] if pieces else None
            if last and (last.src, last.dst) == (src, dst) and last.first + last.count == head:
                pieces[-1] = last._replace(count=last.count + 1)
            else:
                pieces.append(Piece(src, dst, head, 1))
    return pieces


def tp_problem(src_world: int, dst_world: int, heads: int) -> str | None:
    """Why producer and consumer TP sizes cannot pair for a model of `heads` KV
    heads, or None. Pairable: one size divides the other."""
    if src_world % dst_world and dst_world % src_world:
        return (
            f"tensor-parallel sizes {src_world} (prefill) and {dst_world} (decode) do not "
            "divide one another: a decode rank's KV heads would straddle prefill ranks"
        )
    return None


def sources(dst: Shard, src_world: int) -> list[tuple[int, int]]:
    """The producer ranks consumer rank `dst` takes KV heads from, each with the number
    of consumer ranks that producer rank fills (a claim's `parts`)."""
    pieces = assignment(src_world, dst.world, dst.heads)
    mine = sorted({p.src for p in pieces if p.dst == dst.rank})
    return [(src, len({p.dst for p in pieces if p.src == src})) for src in mine]
