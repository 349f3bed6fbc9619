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

The Ledger is the one door to both legs: an engine adapter calls its methods only.
Every leg's beginning, move and end is handed out in order (take_moves,
kvpush.engine.moves), for a request's timeline to be read from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvpush.engine.decode import DecodeLegs, Loaded, Match
from kvpush.engine.moves import Moved, MoveLog
from kvpush.engine.prefill import Finish, PrefillLeg, PrefillLegs
from kvpush.engine.steps import Announce, StepPlan


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
        self.decode.moves = self.prefill.moves = self._moves = MoveLog()

    def take_moves(self) -> list[Moved]:
        """What happened to the legs since the last call, in order."""
        return self._moves.take()

    def knows(self, request_id: str) -> bool:
        return request_id in self.decode.legs or request_id in self.prefill.legs

    def produces(self, request_id: str) -> bool:
        """Whether this engine computes the request's prompt for another."""
        return request_id in self.prefill.legs

    @property
    def recompute_on_failure(self) -> bool:
        return self.decode.recompute_on_failure

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

    # -- decode legs (kvpush.engine.decode) --------------------------------------------

    def announced(
        self, request_id: str, transfer_id: str, announce: Announce, learnt_from: str, base_id: str
    ) -> None:
        self.decode.announced(request_id, transfer_id, announce, learnt_from, base_id)

    def rejected(self, request_id: str, transfer_id: str, problem: str, learnt_from: str) -> None:
        self.decode.rejected(request_id, transfer_id, problem, learnt_from)

    def follows(self, request_id: str, transfer_id: str, leader: str, announce: Announce) -> str:
        return self.decode.follows(request_id, transfer_id, leader, announce)

    def matched(self, request_id: str, prompt_len: int, computed: int) -> Match:
        return self.decode.matched(request_id, prompt_len, computed)

    def allocated(
        self, request_id: str, groups: Sequence[Sequence[int]], external_tokens: int
    ) -> bool:
        return self.decode.allocated(request_id, groups, external_tokens)

    def computes_prompt(self, request_id: str) -> None:
        """The engine computes a decode leg's prompt itself after all (it reads no
        transferred KV for it): the leg ends now, and the producer may let go."""
        self.decode.finished(request_id)

    def rank_landed(self, transfer_id: str, rank: int, ranks: int) -> str | None:
        return self.decode.rank_landed(transfer_id, rank, ranks)

    def loaded(self, request_id: str, failed: bool) -> Loaded:
        return self.decode.loaded(request_id, failed)

    # -- prefill legs (kvpush.engine.prefill) ------------------------------------------

    def arrived(
        self, request_id: str, transfer_id: str, base_id: str, prompt_len: int, named_here: bool
    ) -> None:
        self.prefill.arrived(request_id, transfer_id, base_id, prompt_len, named_here)

    def declined(self, request_id: str) -> None:
        self.prefill.declined(request_id)

    def left_last_token(self, request_id: str) -> None:
        self.prefill.left_last_token(request_id)

    def blocks_assigned(
        self, request_id: str, groups: Sequence[Sequence[int]], resumed: bool
    ) -> None:
        self.prefill.blocks_assigned(request_id, groups, resumed)

    def still_computing(self) -> list[str]:
        return self.prefill.still_computing()

    def step_scheduled(self, computed_after: Mapping[str, int]) -> None:
        self.prefill.step_scheduled(computed_after)

    def preempted(self, request_id: str) -> str | None:
        """The engine took a prefill leg's blocks back: the transfer that ends with it,
        if a WRITE may have been reading them (PrefillLegs.preempted), else None."""
        if not self.prefill.preempted(request_id):
            return None
        return self.prefill.legs[request_id].transfer_id

    def released(self, request_ids: Iterable[str]) -> list[str]:
        return self.prefill.released(request_ids)

    def held_under(self, base_id: str) -> list[PrefillLeg]:
        return self.prefill.held_under(base_id)

    def release(self, legs: Iterable[PrefillLeg]) -> None:
        self.prefill.release(legs)
