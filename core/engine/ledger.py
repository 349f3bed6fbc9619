"""The request ledger: where each engine request stands in its KV hand-off.

A serving engine's scheduler sees a request arrive, get blocks, compute chunk by
chunk, be preempted, finish, and hear back from its workers. The ledger takes those
as plain events (ids, counts, block ids; no engine objects, sockets, threads or
clocks) and answers with what the step tells the workers (a StepPlan, taken once a
step) and what the engine must be told back. One record per engine request with a
leg in a hand-off; each leg (kvpush.engine.decode, kvpush.engine.prefill) has its
state enum and its TransitionTable, as the protocol machines keep theirs: a move
nobody wrote down fails where it happens, and docs/engine.md renders the tables.

Decode leg (this engine loads the prompt's KV):

    announced --allocated--> loading --landed--> landed
        |                      '------failed---> failed
        '--all cached here--> local
    rejected (refused on arrival) --allocated--> failed, reported at once
    follower (a sibling loads the prompt) --sibling done--> local

Prefill leg (this engine computes the prompt's KV for another):

    admitted -> computing -> progressing -> sending -> held -> released
    and spoiled (preempted once a WRITE may read the blocks) -> held

A record lives until the engine finishes the request and, for a prefill whose
blocks a WRITE may read, until the workers say the producer let them go.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.engine.decode import DecodeLegs
from kvpush.engine.prefill import Finish, PrefillLegs
from kvpush.engine.steps import StepPlan


class Ledger:
    """Every engine request with a leg in a hand-off: its decode legs and its prefill
    legs (an instance in kv_both has both), and the step's plan they fill."""

    def __init__(
        self,
        block_size: int,
        prefix_caching: bool = True,
        recompute_on_failure: bool = False,
        progressive: bool = True,
        windowed: bool = False,  # a sliding-window model (DecodeLegs)
        states: Sequence[int] = (),  # recurrent-state groups (steps.state_positions)
        null: int = 0,  # the block id that pads them
    ) -> None:
        self.decode = DecodeLegs(
            block_size, prefix_caching, recompute_on_failure, windowed, states, null
        )
        self.prefill = PrefillLegs(block_size, progressive, states, null)
        self.take_plan()  # one plan, both legs filling it

    def knows(self, request_id: str) -> bool:
        return request_id in self.decode.legs or request_id in self.prefill.legs

    def take_plan(self) -> StepPlan:
        """This step's plan; the next one starts empty."""
        plan = self.decode.plan
        self.decode.plan = self.prefill.plan = StepPlan()
        return plan

    def counts(self) -> dict[str, int]:
        """What a leak check reads: all zero when nothing is in flight."""
        sending, producing = self.prefill.counts()
        return {"sending": sending, "producing": producing, "receiving": self.decode.receiving()}

    def waiting_on_transfers(self) -> bool:
        """Whether some request waits for a transfer to end (a landing, a release)."""
        return self.decode.waiting() or self.prefill.counts()[0] > 0

    def finished(self, request_id: str, sendable: bool = False) -> Finish:
        """The engine finished a request (`sendable`: it stopped or hit its length, so a
        prefill's KV is complete)."""
        leg = self.prefill.legs.get(request_id)
        if leg is not None:
            return self.prefill.finished(leg, sendable)
        self.decode.finished(request_id)
        return Finish(False)
