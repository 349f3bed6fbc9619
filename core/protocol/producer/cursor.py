"""How far a push claim's WRITEs have come, and which WRITE comes next.

A claim's destinations are positions 0..n-1 (pages after those the consumer holds
already). What is written is a frontier of two numbers: the leading `blocks`
positions hold every layer, and the positions after them hold layers
0..`layers`-1. What is computed is the same shape, from the source: before the
prompt's last step, leading positions complete in every layer; from it on, layers
0..k-1 of every position. The next WRITE is the computed part past the written
one, and its landing moves the frontier; one rule covers chunked prefill, layer by
layer push and the two together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """One WRITE: positions [start, stop), layers [layers[0], layers[1])."""

    start: int
    stop: int
    layers: tuple[int, int]
    chunk: bool  # computed before the prompt's last step: reported as a ChunkSent
    last: bool  # after it, the consumer has every layer of every position it asked for


class WriteCursor:
    """The written frontier of one push claim, and its WRITE in flight.

    It finishes when a run lands after which every position holds every layer.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.blocks = 0  # leading positions written in every layer
        self.layers = 0  # layers written of the positions after those
        self.flight: Run | None = None
        self.failures = 0  # of the run in flight, since it was first posted

    def fail(self, retries: int) -> bool:
        """The WRITE in flight failed, nothing of it landed: whether it may be posted
        again (it stays the run in flight) within `retries` further tries."""
        self.failures += 1
        return self.failures <= retries

    def covers(self, count: int) -> bool:
        """Whether the first `count` positions are written in every layer."""
        return self.blocks >= count or self.layers == self.num_layers

    def next(self, ready_blocks: int, ready_layers: int, count: int) -> Run | None:
        """The run past the frontier that is computed: layers of every position once
        the last step computes them, else the positions complete in every layer."""
        if self.covers(count):
            return None
        if ready_layers > self.layers:
            return self._run(self.blocks, count, (self.layers, ready_layers), count, False)
        upto = min(ready_blocks, count)
        if self.layers == 0 and upto > self.blocks:
            return self._run(self.blocks, upto, (0, self.num_layers), count, True)
        return None

    def _run(self, start: int, stop: int, layers: tuple[int, int], count: int, chunk: bool) -> Run:
        whole = layers[1] == self.num_layers
        return Run(start, stop, layers, chunk, whole and (stop == count or not chunk))

    def post(self, run: Run) -> None:
        self.flight = run

    def advance(self, run: Run) -> None:
        """`run`'s bytes are where they belong (landed, or none needed moving)."""
        if run.layers == (0, self.num_layers):
            self.blocks = run.stop
        else:
            self.layers = run.layers[1]

    def land(self) -> Run:
        """The WRITE in flight landed: its run is written."""
        assert self.flight is not None
        run, self.flight = self.flight, None
        self.failures = 0
        self.advance(run)
        return run
