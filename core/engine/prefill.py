"""A prefill leg's part of the request ledger (kvpush.engine.ledger): this engine
computes a prompt's KV for another, and hands it over chunk by chunk or at its last
step; its blocks stay out of the engine's pool while a WRITE may read them."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpush.engine.moves import Moved, MoveLog
from kvpush.engine.steps import Pending, Produce, Progress, StepPlan, state_positions
from kvpush.layout import interleave
from kvpush.protocol.states import TransitionTable


class PrefillState(enum.StrEnum):
    ADMITTED = "admitted"  # taken in; its transfer is pending on the workers
    COMPUTING = "computing"  # a step computes its prompt; no WRITE reads its blocks yet
    PROGRESSING = "progressing"  # an earlier chunk's complete blocks were handed over
    SENDING = "sending"  # the step computing its last prompt token was scheduled
    SPOILED = "spoiled"  # preempted after a WRITE could read its blocks
    HELD = "held"  # finished; its blocks are kept until the producer lets go
    DECLINED = "declined"  # its leg named an invalid transfer id: nothing is sent
    RELEASED = "released"  # the engine may reuse its blocks


P = PrefillState
_COMPUTING = (P.ADMITTED, P.COMPUTING, P.PROGRESSING)
PREFILL_TRANSITIONS: TransitionTable[PrefillState] = TransitionTable(
    "prefill leg",
    {
        P.ADMITTED: {P.COMPUTING, P.RELEASED},
        P.COMPUTING: {P.PROGRESSING, P.SENDING, P.ADMITTED, P.RELEASED},
        P.PROGRESSING: {P.SENDING, P.SPOILED, P.HELD},
        P.SENDING: {P.SPOILED, P.HELD},
        P.SPOILED: {P.HELD},
        P.HELD: {P.RELEASED},
        P.DECLINED: set(),
        P.RELEASED: set(),
    },
)


@dataclass
class PrefillLeg:
    request_id: str
    transfer_id: str  # this engine request's own (kvpush.vllm.transfers)
    base_id: str  # the router's, echoed to it
    prompt_len: int
    state: PrefillState = PrefillState.ADMITTED
    named_here: bool = False  # the leg brought no transfer id: the engine named it
    groups: list[list[int]] = field(default_factory=list)  # block ids, per KV cache group


@dataclass(frozen=True)
class Finish:
    """The ledger's answer when the engine finishes a request: whether to keep its
    blocks until the workers release them, and the prefill leg to echo, if any."""

    keep_blocks: bool
    echo: PrefillLeg | None = None


class PrefillLegs:
    """The prefill legs this engine computes, by request id."""

    def __init__(
        self, block_size: int, progressive: bool = True, states: Sequence[int] = (), null: int = 0
    ) -> None:
        self.block_size = block_size
        self.progressive = progressive
        # Recurrent-state groups (steps.state_positions) and the null block id padding them.
        self.states, self.null = tuple(states), null
        self.legs: dict[str, PrefillLeg] = {}
        self.plan = StepPlan()  # the Ledger's, for this step
        self.moves = MoveLog()  # the Ledger's

    def _move(self, leg: PrefillLeg, to: PrefillState) -> None:
        before = leg.state
        PREFILL_TRANSITIONS.move(leg, to)
        self.moves.add(Moved(leg.request_id, "prefill", before, to, leg.base_id))

    def arrived(
        self, request_id: str, transfer_id: str, base_id: str, prompt_len: int, named_here: bool
    ) -> None:
        leg = PrefillLeg(request_id, transfer_id, base_id, prompt_len, named_here=named_here)
        self.legs[request_id] = leg
        self.moves.add(Moved(request_id, "prefill", None, leg.state, base_id))
        self.plan.pending.append(Pending(transfer_id, sequential=named_here))

    def left_last_token(self, request_id: str) -> None:
        """The engine computes all but the last token of this leg's prompt (a
        recurrent-state model's: the decode leg computes that one)."""
        leg = self.legs.get(request_id)
        if leg is not None and leg.state != P.DECLINED:
            leg.prompt_len -= 1

    def declined(self, request_id: str) -> None:
        self.legs[request_id] = PrefillLeg(request_id, "", "", 0, P.DECLINED)

    def blocks_assigned(
        self, request_id: str, groups: Sequence[Sequence[int]], resumed: bool
    ) -> None:
        """The engine gave a prefill leg blocks (one list per KV cache group): new ones
        appended, or, resumed after a preemption, its whole lists anew."""
        leg = self.legs.get(request_id)
        if leg is None or leg.state == P.DECLINED:
            return
        if resumed or not leg.groups:
            leg.groups = [list(group) for group in groups]
        else:
            for mine, new in zip(leg.groups, groups, strict=True):
                mine.extend(new)

    def still_computing(self) -> list[str]:
        """The legs whose prompt a step may still compute: the ones step_scheduled reads."""
        return [r for r, leg in self.legs.items() if leg.state in _COMPUTING]

    def step_scheduled(self, computed_after: Mapping[str, int]) -> list[tuple[str, str]]:
        """A step was scheduled; `computed_after` holds, for each request it computes,
        how many tokens have KV once it ran. Returns (request id, milestone) pairs
        for tracing: "computing", "last_step"."""
        milestones: list[tuple[str, str]] = []
        for request_id, leg in self.legs.items():
            if leg.state not in _COMPUTING:
                continue
            computed = computed_after.get(request_id)
            if computed is None:
                continue
            if leg.state == P.ADMITTED:
                self._move(leg, P.COMPUTING)
            milestones.append((request_id, "computing"))
            blocks = self._blocks(leg)
            if computed >= leg.prompt_len:
                self._move(leg, P.SENDING)
                milestones.append((request_id, "last_step"))
                self.plan.produces.append(Produce(request_id, leg.transfer_id, blocks))
            elif self.progressive:
                if leg.state == P.COMPUTING:
                    self._move(leg, P.PROGRESSING)
                full = computed // self.block_size * len(leg.groups)
                self.plan.progress.append(Progress(request_id, leg.transfer_id, blocks, full))
        return milestones

    def _blocks(self, leg: PrefillLeg) -> tuple[int, ...]:
        groups = leg.groups
        if self.states:
            length = max((len(g) for i, g in enumerate(groups) if i not in self.states), default=0)
            groups = state_positions(groups, self.states, self.null, length)
        return tuple(interleave(groups))

    def preempted(self, request_id: str) -> bool:
        """The engine took a prefill leg's blocks back to compute it again later.
        True if a WRITE may have been reading them: its transfer ends (decode fails
        the load, per its policy) and nothing more is sent for it."""
        leg = self.legs.get(request_id)
        if leg is None:
            return False
        if leg.state == P.COMPUTING:
            self._move(leg, P.ADMITTED)  # resuming re-reads them
            return False
        if leg.state not in (P.PROGRESSING, P.SENDING):
            return False
        self._move(leg, P.SPOILED)
        self.plan.aborts.append(leg.transfer_id)
        return True

    def finished(self, leg: PrefillLeg, sendable: bool) -> Finish:
        """The engine finished the request (`sendable`: it stopped or hit its length,
        so its KV is complete)."""
        if leg.state == P.DECLINED:
            del self.legs[leg.request_id]
            return Finish(False)
        if leg.state in (P.ADMITTED, P.COMPUTING):
            # No step of it was handed over: no WRITE can read these blocks.
            self.plan.aborts.append(leg.transfer_id)
            self._move(leg, P.RELEASED)
            del self.legs[leg.request_id]
            return Finish(False)
        if leg.state in (P.SPOILED, P.PROGRESSING):
            # Ended at a preemption (its transfer already ended), or aborted between
            # chunks: a chunk's WRITE may still read the blocks. Keep them until the
            # producer lets go, and name nothing for decode to claim.
            if leg.state == P.PROGRESSING:
                self.plan.aborts.append(leg.transfer_id)
            self._move(leg, P.HELD)
            return Finish(True)
        if not sendable:
            # A WRITE may be reading the blocks: free them only when the producer says so.
            self.plan.aborts.append(leg.transfer_id)
        self._move(leg, P.HELD)
        return Finish(True, echo=leg)

    def released(self, request_ids: Iterable[str]) -> list[str]:
        """The workers let these prefill legs' blocks go; those it held, in order."""
        done = []
        for request_id in request_ids:
            leg = self.legs.get(request_id)
            if leg is not None and leg.state == P.HELD:
                self._move(leg, P.RELEASED)
                del self.legs[request_id]
                done.append(request_id)
        return done

    def held_under(self, base_id: str) -> list[PrefillLeg]:
        """The legs of one dispatch (the router's transfer id) whose finished KV is held
        for decode: what a release by the router may let go."""
        # A copy taken at once: the identity endpoint's threads ask too, while the
        # engine's thread may be adding legs.
        legs = list(self.legs.values())
        return [leg for leg in legs if leg.base_id == base_id and leg.state == P.HELD]

    def release(self, legs: Iterable[PrefillLeg]) -> None:
        """The router says no decode will claim these legs' KV: the workers let it go
        unless a consumer claimed or announced it, and report as for any release."""
        self.plan.releases.extend(leg.transfer_id for leg in legs)

    def counts(self) -> tuple[int, int]:
        """(held, producing): legs whose blocks wait for the producer, and the rest."""
        held = sum(leg.state == P.HELD for leg in self.legs.values())
        declined = sum(leg.state == P.DECLINED for leg in self.legs.values())
        return held, len(self.legs) - held - declined
