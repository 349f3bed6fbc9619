"""A decode leg's part of the request ledger (kvpush.engine.ledger): this engine
loads a prompt's KV that another computes, claiming the blocks it allocated."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.engine.moves import Moved, MoveLog
from kvpush.engine.steps import Announce, Expect, StepPlan, state_positions
from kvpush.layout import interleave
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


D = DecodeState
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
    base_id: str = ""  # the transfer as the router named it ("": transfer_id)


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
class Loaded:
    """What a decode leg's load outcome means beyond its own state."""

    recomputed: bool = False  # the engine computes the prompt instead (counted)
    forget_endpoint: str = ""  # an endpoint that named a producer whose KV failed
    followers_failed: tuple[tuple[str, str], ...] = ()  # (request id, why), fail policy


class DecodeLegs:
    """The decode legs this engine loads, by request id."""

    def __init__(
        self,
        block_size: int,
        prefix_caching: bool = True,
        recompute_on_failure: bool = False,
        windowed: bool = False,
        states: Sequence[int] = (),
        null: int = 0,
    ) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.recompute_on_failure = recompute_on_failure
        # Load all but the prompt's last token, which decode computes, in a
        # sliding-window model (told the whole prompt is loaded, vLLM sizes the window
        # for the token after it and drops the block holding the first token that the
        # last one, recomputed, still reads) and in one with recurrent state (whose
        # prefill leg stops before that token: the state after it would be applied twice).
        self.recomputes_last = windowed or bool(states)
        # Recurrent-state groups (steps.state_positions) and the null block id padding them.
        self.states, self.null = tuple(states), null
        self.legs: dict[str, DecodeLeg] = {}
        self._loading: dict[str, str] = {}  # transfer id -> the LOADING leg's request id
        self._ranks_landed: dict[str, set[int]] = {}  # transfer id -> ranks heard of
        self._failed_loads: OrderedDict[str, None] = OrderedDict()
        self.plan = StepPlan()  # the Ledger's, for this step
        self.moves = MoveLog()  # the Ledger's

    def _begin(self, leg: DecodeLeg) -> None:
        self.legs[leg.request_id] = leg
        self.moves.add(Moved(leg.request_id, "decode", None, leg.state, leg.base_id))

    def _move(self, leg: DecodeLeg, to: DecodeState) -> None:
        before = leg.state
        DECODE_TRANSITIONS.move(leg, to)
        self.moves.add(Moved(leg.request_id, "decode", before, to, leg.base_id))

    def announced(
        self,
        request_id: str,
        transfer_id: str,
        announce: Announce,
        learnt_from: str = "",
        base_id: str = "",
    ) -> None:
        """A decode leg arrived naming its producer: keep that KV alive from now on, not
        from when the request reaches the head of a queue that may be long."""
        self._begin(
            DecodeLeg(request_id, transfer_id, D.ANNOUNCED, announce, learnt_from=learnt_from,
                      base_id=base_id or transfer_id)
        )  # fmt: skip
        self.plan.announces.append(announce)

    def rejected(
        self, request_id: str, transfer_id: str, problem: str, learnt_from: str = ""
    ) -> None:
        """A decode leg kvpush cannot serve: its load fails once the engine allocates it."""
        self._begin(
            DecodeLeg(request_id, transfer_id, D.REJECTED, problem=problem,
                      learnt_from=learnt_from, base_id=transfer_id)
        )  # fmt: skip

    def follows(self, request_id: str, transfer_id: str, leader: str, announce: Announce) -> str:
        """A sibling (n > 1, or the same prompt listed twice) brings this prompt's KV
        once; this one reads it from the prefix cache. Should the producer have made a
        copy for this one too, it lets it go at once. Returns the problem if it fails
        at once (its sibling's load failed already, under the fail policy), else ""."""
        leg = DecodeLeg(request_id, transfer_id, D.FOLLOWER, leader=leader)
        self._begin(leg)
        self.plan.announces.append(announce)
        self.plan.aborts.append(transfer_id)
        if leader in self._failed_loads:
            return self._sibling_failed(leg)
        return ""

    def matched(self, request_id: str, prompt_len: int, computed: int) -> Match:
        """How many of a decode leg's prompt tokens its KV load brings, with `computed`
        of them cached here already."""
        leg = self.legs.get(request_id)
        if leg is None:
            return Match(None)
        count = prompt_len - computed - (1 if self.recomputes_last else 0)
        if leg.state == D.REJECTED:
            return Match(max(count, 1), load_async=True)  # fails at once, per the policy
        if leg.state == D.FOLLOWER:
            leader = self.legs.get(leg.leader)
            if self.prefix_caching and leader is not None and leader.state in (
                D.ANNOUNCED, D.LOADING
            ):  # fmt: skip
                return Match(None)  # again once its sibling's KV is in the prefix cache
            self._move(leg, D.LOCAL)
            return Match(0, local=True)
        if leg.state != D.ANNOUNCED:
            return Match(0)
        if count <= 0:
            # Everything is cached here already: let the producer free its copy now.
            self.plan.aborts.append(leg.transfer_id)
            self._move(leg, D.LOCAL)
            return Match(0, local=True)
        leg.local_tokens = computed
        return Match(count, load_async=True)

    def allocated(
        self, request_id: str, groups: Sequence[Sequence[int]], external_tokens: int
    ) -> bool:
        """The engine allocated a decode leg's blocks (the whole request's, one list per
        KV cache group) for `external_tokens` to load after its cached ones. True if
        they are claimed from the producer (False: nothing to load, or the leg fails
        at once)."""
        leg = self.legs.get(request_id)
        if leg is None or external_tokens <= 0:
            return False
        if leg.state == D.REJECTED:
            self.plan.rejects.append((request_id, leg.problem))
            return False
        if leg.state != D.ANNOUNCED or leg.announce is None:
            return False
        first = leg.local_tokens // self.block_size
        last = -(-(leg.local_tokens + external_tokens) // self.block_size)
        self._move(leg, D.LOADING)
        self._loading[leg.transfer_id] = request_id
        named = leg.announce
        if self.states:
            groups = state_positions(groups, self.states, self.null, last)
        blocks = tuple(interleave([group[first:last] for group in groups]))
        self.plan.expects.append(
            Expect(request_id, leg.transfer_id, named.producers, blocks, first * len(groups),
                   named.engine, named.epochs, named.network)
        )  # fmt: skip
        return True

    def rank_landed(self, transfer_id: str, rank: int, ranks: int) -> str | None:
        """One of the engine's `ranks` worker ranks says, outside a step, that its share
        of a transfer landed. Once every rank has, the loading leg's request id: the
        engine may run it now, before any step reports the landing. Else None."""
        request_id = self._loading.get(transfer_id)
        if request_id is None:
            return None
        heard = self._ranks_landed.setdefault(transfer_id, set())
        heard.add(rank)
        if len(heard) < ranks:
            return None
        return request_id

    def loaded(self, request_id: str, failed: bool) -> Loaded:
        """The workers report a decode leg's load done: landed, or failed. A failed
        load is remembered past the request's end, for siblings still to come."""
        leg = self.legs.get(request_id)
        if leg is not None:
            self._settled(leg.transfer_id)
        if not failed:
            if leg is not None and leg.state == D.LOADING:
                self._move(leg, D.LANDED)
            return Loaded()
        recomputed, endpoint = False, ""
        if leg is not None and leg.state in (D.LOADING, D.REJECTED):
            recomputed = leg.state == D.LOADING and self.recompute_on_failure
            endpoint = leg.learnt_from
            self._move(leg, D.FAILED)
        self._failed_loads[request_id] = None
        while len(self._failed_loads) > FAILED_LOADS_KEPT:
            self._failed_loads.popitem(last=False)
        followers = [
            f for f in self.legs.values() if f.state == D.FOLLOWER and f.leader == request_id
        ]
        failed_too = [(f.request_id, self._sibling_failed(f)) for f in followers]
        return Loaded(recomputed, endpoint, tuple((r, why) for r, why in failed_too if why))

    def problem(self, request_id: str) -> str:
        leg = self.legs.get(request_id)
        return leg.problem if leg is not None else ""

    def _sibling_failed(self, follower: DecodeLeg) -> str:
        """The sibling bringing this prompt's KV failed to load it. Under the fail
        policy this one fails too: computing the prompt here is what the policy
        refuses (and on vLLM's CPU build, a seeded prompt computed in chunks kills the
        engine). Under recompute it computes the prompt here, as its sibling will."""
        if self.recompute_on_failure:
            return ""
        self._move(follower, D.REJECTED)
        follower.problem = (
            f"its sibling {follower.leader} (same prompt, n > 1 or a repeated list prompt) "
            "failed to load the prompt's KV, and kv_load_failure_policy is fail"
        )
        return follower.problem

    def finished(self, request_id: str) -> None:
        """The engine finished the request."""
        leg = self.legs.pop(request_id, None)
        if leg is not None:
            self._settled(leg.transfer_id)
            self.moves.add(Moved(request_id, "decode", leg.state, None, leg.base_id))
        if leg is not None and leg.state in (D.ANNOUNCED, D.LOADING):
            # Aborted while queued, or before its KV arrived: the workers settle the
            # transfer, and a producer stops keeping the KV alive for it.
            self.plan.aborts.append(leg.transfer_id)

    def _settled(self, transfer_id: str) -> None:
        self._loading.pop(transfer_id, None)
        self._ranks_landed.pop(transfer_id, None)

    def receiving(self) -> int:
        return sum(leg.state == D.LOADING for leg in self.legs.values())

    def waiting(self) -> bool:
        """Whether a leg waits for a transfer: its own load, or its sibling's."""
        return any(leg.state in (D.LOADING, D.FOLLOWER) for leg in self.legs.values())
