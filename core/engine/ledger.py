"""The request ledger: where each engine request stands in its KV hand-off.

A serving engine's scheduler sees a request arrive, get blocks, compute chunk by
chunk, be preempted, finish, and hear back from its workers. The ledger takes those
as plain events (ids, counts, block ids; no engine objects, sockets, threads or
clocks) and answers with what the step tells the workers (a StepPlan, taken once a
step) and what the engine must be told back. One record per engine request with a
leg in a hand-off, each with a state enum per leg and one TransitionTable per leg,
as the protocol machines keep theirs: a move nobody wrote down fails where it
happens, and docs/engine.md renders the tables from here.

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

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpush.engine.steps import Announce, Expect, Pending, Produce, Progress, StepPlan
from kvpush.protocol.states import TransitionTable

# Decode requests whose load failed, kept past their end (n's choices may arrive
# after their sibling finished): the last few thousand.
FAILED_LOADS_KEPT = 4096


class DecodeState(enum.StrEnum):
    ANNOUNCED = "announced"  # arrived; its producer was told to keep the KV alive
    LOADING = "loading"  # blocks allocated and claimed: the KV is on its way
    LANDED = "landed"  # the KV is in its blocks; the engine runs it
    FAILED = "failed"  # the load failed (reported to the engine, per its policy)
    REJECTED = "rejected"  # its leg cannot be served: fails when the engine allocates it
    FOLLOWER = "follower"  # a sibling of the same prompt loads the KV; this one waits
    LOCAL = "local"  # nothing to load: its prompt is cached or computed here


class PrefillState(enum.StrEnum):
    ADMITTED = "admitted"  # taken in; its transfer is pending on the workers
    COMPUTING = "computing"  # a step computes its prompt; no WRITE reads its blocks yet
    PROGRESSING = "progressing"  # an earlier chunk's complete blocks were handed over
    SENDING = "sending"  # the step computing its last prompt token was scheduled
    SPOILED = "spoiled"  # preempted after a WRITE could read its blocks
    HELD = "held"  # finished; its blocks are kept until the producer lets go
    DECLINED = "declined"  # its leg named an invalid transfer id: nothing is sent
    RELEASED = "released"  # the engine may reuse its blocks


D, P = DecodeState, PrefillState
DECODE_TRANSITIONS: TransitionTable[DecodeState] = TransitionTable(
    "decode leg",
    {
        D.ANNOUNCED: {D.LOADING, D.LOCAL},
        D.LOADING: {D.LANDED, D.FAILED},
        D.REJECTED: {D.FAILED},
        D.FOLLOWER: {D.LOCAL, D.REJECTED},
        D.LANDED: set(),
        D.FAILED: set(),
        D.LOCAL: set(),
    },
)
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
class DecodeLeg:
    request_id: str
    transfer_id: str
    state: DecodeState
    announce: Announce | None = None  # whom to claim from (None: rejected, follower)
    local_tokens: int = 0  # prompt tokens the engine had cached when it matched
    leader: str = ""  # a follower's sibling that loads the prompt
    problem: str = ""  # why a rejected leg cannot be served
    learnt_from: str = ""  # the endpoint its producer was learnt from, if any


@dataclass
class PrefillLeg:
    request_id: str
    transfer_id: str  # this engine request's own (kvpush.vllm.transfers)
    base_id: str  # the router's, echoed to it
    prompt_len: int
    state: PrefillState = PrefillState.ADMITTED
    named_here: bool = False  # the leg brought no transfer id: the engine named it
    block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Match:
    """The ledger's answer to "how many prompt tokens come from elsewhere".

    `tokens` None: ask again later. `local`: the request has nothing to load after
    all; the engine should treat it as an ordinary request from now on.
    """

    tokens: int | None
    load_async: bool = False
    local: bool = False


@dataclass(frozen=True)
class Finish:
    """The ledger's answer when the engine finishes a request: whether to keep its
    blocks until the workers release them, and the prefill leg to echo, if any."""

    keep_blocks: bool
    echo: PrefillLeg | None = None


@dataclass(frozen=True)
class Loaded:
    """What a decode leg's load outcome means beyond its own state."""

    recomputed: bool = False  # the engine computes the prompt instead (counted)
    forget_endpoint: str = ""  # an endpoint that named a producer whose KV failed
    followers_failed: tuple[tuple[str, str], ...] = ()  # (request id, why), fail policy


class Ledger:
    """Every engine request with a leg in a hand-off, by request id."""

    def __init__(
        self,
        block_size: int,
        prefix_caching: bool = True,
        recompute_on_failure: bool = False,
        progressive: bool = True,
    ) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.recompute_on_failure = recompute_on_failure
        self.progressive = progressive
        self.decodes: dict[str, DecodeLeg] = {}
        self.prefills: dict[str, PrefillLeg] = {}
        self._failed_loads: OrderedDict[str, None] = OrderedDict()
        self._plan = StepPlan()

    # -- what the ledger holds ----------------------------------------------------------

    def knows(self, request_id: str) -> bool:
        return request_id in self.decodes or request_id in self.prefills

    def take_plan(self) -> StepPlan:
        """This step's plan; the next one starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    def counts(self) -> dict[str, int]:
        """What a leak check reads: all zero when nothing is in flight."""
        held = (P.HELD,)
        return {
            "sending": sum(leg.state in held for leg in self.prefills.values()),
            "producing": sum(
                leg.state not in (*held, P.DECLINED) for leg in self.prefills.values()
            ),
            "receiving": sum(leg.state == D.LOADING for leg in self.decodes.values()),
        }

    def waiting_on_transfers(self) -> bool:
        """Whether some request waits for a transfer to end (a landing, a release)."""
        waits = (D.LOADING, D.FOLLOWER)
        return any(leg.state in waits for leg in self.decodes.values()) or any(
            leg.state == P.HELD for leg in self.prefills.values()
        )

    # -- prefill leg --------------------------------------------------------------------

    def prefill_arrived(
        self, request_id: str, transfer_id: str, base_id: str, prompt_len: int, named_here: bool
    ) -> None:
        self.prefills[request_id] = PrefillLeg(
            request_id, transfer_id, base_id, prompt_len, named_here=named_here
        )
        self._plan.pending.append(Pending(transfer_id, sequential=named_here))

    def prefill_declined(self, request_id: str) -> None:
        self.prefills[request_id] = PrefillLeg(request_id, "", "", 0, P.DECLINED)

    def blocks_assigned(self, request_id: str, block_ids: Sequence[int], resumed: bool) -> None:
        """The engine gave a prefill leg blocks: new ones appended, or, resumed after a
        preemption, its whole list anew."""
        leg = self.prefills.get(request_id)
        if leg is None or leg.state == P.DECLINED:
            return
        if resumed:
            leg.block_ids = list(block_ids)
        else:
            leg.block_ids.extend(block_ids)

    def step_scheduled(self, computed_after: Mapping[str, int]) -> list[tuple[str, str]]:
        """A step was scheduled; `computed_after` holds, for each request it computes,
        how many tokens have KV once it ran. Returns (request id, milestone) pairs
        for tracing: "computing", "last_step"."""
        milestones: list[tuple[str, str]] = []
        for request_id, leg in self.prefills.items():
            if leg.state not in (P.ADMITTED, P.COMPUTING, P.PROGRESSING):
                continue
            computed = computed_after.get(request_id)
            if computed is None:
                continue
            if leg.state == P.ADMITTED:
                PREFILL_TRANSITIONS.move(leg, P.COMPUTING)
            milestones.append((request_id, "computing"))
            blocks = tuple(leg.block_ids)
            if computed >= leg.prompt_len:
                PREFILL_TRANSITIONS.move(leg, P.SENDING)
                milestones.append((request_id, "last_step"))
                self._plan.produces.append(Produce(request_id, leg.transfer_id, blocks))
            elif self.progressive:
                if leg.state == P.COMPUTING:
                    PREFILL_TRANSITIONS.move(leg, P.PROGRESSING)
                full = computed // self.block_size
                self._plan.progress.append(Progress(request_id, leg.transfer_id, blocks, full))
        return milestones

    def preempted(self, request_id: str) -> bool:
        """The engine took a prefill leg's blocks back to compute it again later.
        True if a WRITE may have been reading them: its transfer ends (decode fails
        the load, per its policy) and nothing more is sent for it."""
        leg = self.prefills.get(request_id)
        if leg is None:
            return False
        if leg.state == P.COMPUTING:
            PREFILL_TRANSITIONS.move(leg, P.ADMITTED)  # resuming re-reads them
            return False
        if leg.state not in (P.PROGRESSING, P.SENDING):
            return False
        PREFILL_TRANSITIONS.move(leg, P.SPOILED)
        self._plan.aborts.append(leg.transfer_id)
        return True

    def _prefill_finished(self, leg: PrefillLeg, sendable: bool) -> Finish:
        if leg.state == P.DECLINED:
            del self.prefills[leg.request_id]
            return Finish(False)
        if leg.state in (P.ADMITTED, P.COMPUTING):
            # No step of it was handed over: no WRITE can read these blocks.
            self._plan.aborts.append(leg.transfer_id)
            PREFILL_TRANSITIONS.move(leg, P.RELEASED)
            del self.prefills[leg.request_id]
            return Finish(False)
        if leg.state in (P.SPOILED, P.PROGRESSING):
            # Ended at a preemption (its transfer already ended), or aborted between
            # chunks: a chunk's WRITE may still read the blocks. Keep them until the
            # producer lets go, and name nothing for decode to claim.
            if leg.state == P.PROGRESSING:
                self._plan.aborts.append(leg.transfer_id)
            PREFILL_TRANSITIONS.move(leg, P.HELD)
            return Finish(True)
        if not sendable:
            # A WRITE may be reading the blocks: free them only when the producer says so.
            self._plan.aborts.append(leg.transfer_id)
        PREFILL_TRANSITIONS.move(leg, P.HELD)
        return Finish(True, echo=leg)

    def released(self, request_ids: Iterable[str]) -> list[str]:
        """The workers let these prefill legs' blocks go; those it held, in order."""
        done = []
        for request_id in request_ids:
            leg = self.prefills.get(request_id)
            if leg is not None and leg.state == P.HELD:
                PREFILL_TRANSITIONS.move(leg, P.RELEASED)
                del self.prefills[request_id]
                done.append(request_id)
        return done

    # -- decode leg ---------------------------------------------------------------------

    def decode_announced(
        self, request_id: str, transfer_id: str, announce: Announce, learnt_from: str = ""
    ) -> None:
        """A decode leg arrived naming its producer: keep that KV alive from now on, not
        from when the request reaches the head of a queue that may be long."""
        self.decodes[request_id] = DecodeLeg(
            request_id, transfer_id, D.ANNOUNCED, announce, learnt_from=learnt_from
        )
        self._plan.announces.append(announce)

    def decode_rejected(
        self, request_id: str, transfer_id: str, problem: str, learnt_from: str = ""
    ) -> None:
        """A decode leg kvpush cannot serve: its load fails once the engine allocates it."""
        self.decodes[request_id] = DecodeLeg(
            request_id, transfer_id, D.REJECTED, problem=problem, learnt_from=learnt_from
        )

    def decode_follows(
        self, request_id: str, transfer_id: str, leader: str, announce: Announce
    ) -> str:
        """A sibling (n > 1, or the same prompt listed twice) brings this prompt's KV
        once; this one reads it from the prefix cache. Should the producer have made a
        copy for this one too, it lets it go at once. Returns the problem if it fails
        at once (its sibling's load failed already, under the fail policy), else ""."""
        leg = DecodeLeg(request_id, transfer_id, D.FOLLOWER, leader=leader)
        self.decodes[request_id] = leg
        self._plan.announces.append(announce)
        self._plan.aborts.append(transfer_id)
        if leader in self._failed_loads:
            return self._sibling_failed(leg)
        return ""

    def matched(self, request_id: str, prompt_len: int, computed: int) -> Match:
        """How many of a decode leg's prompt tokens its KV load brings, with `computed`
        of them cached here already."""
        leg = self.decodes.get(request_id)
        if leg is None:
            return Match(None)
        count = prompt_len - computed
        if leg.state == D.REJECTED:
            return Match(max(count, 1), load_async=True)  # fails at once, per the policy
        if leg.state == D.FOLLOWER:
            leader = self.decodes.get(leg.leader)
            if self.prefix_caching and leader is not None and leader.state in (
                D.ANNOUNCED, D.LOADING
            ):  # fmt: skip
                return Match(None)  # again once its sibling's KV is in the prefix cache
            DECODE_TRANSITIONS.move(leg, D.LOCAL)
            return Match(0, local=True)
        if leg.state != D.ANNOUNCED:
            return Match(0)
        if count <= 0:
            # Everything is cached here already: let the producer free its copy now.
            self._plan.aborts.append(leg.transfer_id)
            DECODE_TRANSITIONS.move(leg, D.LOCAL)
            return Match(0, local=True)
        leg.local_tokens = computed
        return Match(count, load_async=True)

    def allocated(self, request_id: str, block_ids: Sequence[int], external_tokens: int) -> bool:
        """The engine allocated a decode leg's blocks (`block_ids`, the whole request's)
        for `external_tokens` to load after its cached ones. True if they are claimed
        from the producer (False: nothing to load, or the leg fails at once)."""
        leg = self.decodes.get(request_id)
        if leg is None or external_tokens <= 0:
            return False
        if leg.state == D.REJECTED:
            self._plan.rejects.append((request_id, leg.problem))
            return False
        if leg.state != D.ANNOUNCED or leg.announce is None:
            return False
        first = leg.local_tokens // self.block_size
        last = -(-(leg.local_tokens + external_tokens) // self.block_size)
        DECODE_TRANSITIONS.move(leg, D.LOADING)
        named = leg.announce
        self._plan.expects.append(
            Expect(request_id, leg.transfer_id, named.producers, tuple(block_ids[first:last]),
                   first, named.engine, named.epochs)
        )  # fmt: skip
        return True

    def loaded(self, request_id: str, failed: bool) -> Loaded:
        """The workers report a decode leg's load done: landed, or failed. A failed
        load is remembered past the request's end, for siblings still to come."""
        leg = self.decodes.get(request_id)
        if not failed:
            if leg is not None and leg.state == D.LOADING:
                DECODE_TRANSITIONS.move(leg, D.LANDED)
            return Loaded()
        recomputed, endpoint = False, ""
        if leg is not None and leg.state in (D.LOADING, D.REJECTED):
            recomputed = leg.state == D.LOADING and self.recompute_on_failure
            endpoint = leg.learnt_from
            DECODE_TRANSITIONS.move(leg, D.FAILED)
        self._failed_loads[request_id] = None
        while len(self._failed_loads) > FAILED_LOADS_KEPT:
            self._failed_loads.popitem(last=False)
        followers = [
            f for f in self.decodes.values() if f.state == D.FOLLOWER and f.leader == request_id
        ]
        failed_too = [(f.request_id, self._sibling_failed(f)) for f in followers]
        return Loaded(recomputed, endpoint, tuple((r, why) for r, why in failed_too if why))

    def problem(self, request_id: str) -> str:
        leg = self.decodes.get(request_id)
        return leg.problem if leg is not None else ""

    def _sibling_failed(self, follower: DecodeLeg) -> str:
        """The sibling bringing this prompt's KV failed to load it. Under the fail
        policy this one fails too: computing the prompt here is what the policy
        refuses (and on vLLM's CPU build, a seeded prompt computed in chunks kills the
        engine). Under recompute it computes the prompt here, as its sibling will."""
        if self.recompute_on_failure:
            return ""
        DECODE_TRANSITIONS.move(follower, D.REJECTED)
        follower.problem = (
            f"its sibling {follower.leader} (same prompt, n > 1 or a repeated list prompt) "
            "failed to load the prompt's KV, and kv_load_failure_policy is fail"
        )
        return follower.problem

    # -- either leg ---------------------------------------------------------------------

    def finished(self, request_id: str, sendable: bool = False) -> Finish:
        """The engine finished a request (`sendable`: it stopped or hit its length, so a
        prefill's KV is complete)."""
        prefill = self.prefills.get(request_id)
        if prefill is not None:
            return self._prefill_finished(prefill, sendable)
        leg = self.decodes.pop(request_id, None)
        if leg is not None and leg.state in (D.ANNOUNCED, D.LOADING):
            # Aborted while queued, or before its KV arrived: the workers settle the
            # transfer, and a producer stops keeping the KV alive for it.
            self._plan.aborts.append(leg.transfer_id)
        return Finish(False)
