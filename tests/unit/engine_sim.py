"""Two engines, each with its request ledger, over the protocol simulation.

protocol_sim.Sim runs the producer and consumer machines by transfer id. Here a
prefill engine and a decode engine sit on top, as vLLM does: requests arrive,
compute chunk by chunk, are allocated, finish or are aborted, each such event goes
to the engine's Ledger, and each plan it answers is applied to the machines the
way WorkerSide applies it to a Node. The workers' outcomes go back through
Outcomes to the ledgers, and the prefill engine frees a request's blocks only when
its ledger or its outcomes say so: a WRITE reading a freed block is an error the
simulation records.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol_sim import PRODUCER, Sim

from kvpush.engine.decode import DecodeState
from kvpush.engine.ledger import Ledger
from kvpush.engine.outcomes import Outcomes
from kvpush.engine.steps import Announce, StepPlan
from kvpush.layout import interleave
from kvpush.protocol.consumer import Source

BLOCK = 16
NULL = 0  # vLLM's null block, with a sliding window


@dataclass
class Request:
    index: int
    prompt_len: int
    local_tokens: int  # decode's prefix-cache hit
    computed: int = 0  # prefill's progress
    prefill: str = "new"  # new, running, finished
    decode: str = "new"  # new, queued, allocated, finished
    follows: int | None = None  # n > 1: the request whose load brings this prompt

    @property
    def tid(self) -> str:
        return f"t{self.index}"

    @property
    def p_id(self) -> str:
        return f"p{self.index}"

    @property
    def d_id(self) -> str:
        return f"d{self.index}"


class Engines:
    def __init__(
        self, mode: str = "push", progressive: bool = True, window: int = 0, margin: int = 1
    ) -> None:
        """`window`: a sliding-window KV cache group beside the full-attention one, of
        that many tokens (0: the full group alone). `margin`: tokens the prefill engine
        keeps below each window (vLLM's extra_retained_tokens, which kvpush raises by
        one: kvpush.vllm.hooks.keep_window_margin)."""
        self.window, self.margin = window, margin
        self.groups = 2 if window else 1
        self.sim = Sim(
            mode=mode, producer_blocks=512, consumer_blocks=512, engine_frees=True,
            groups=self.groups, null=NULL if window else -1,
        )  # fmt: skip
        self.p_groups: dict[str, list[list[int]]] = {}  # tid -> prefill's table, per group
        self.p_requests = Ledger(BLOCK, progressive=progressive)  # the prefill engine's
        self.d_requests = Ledger(BLOCK, windowed=bool(window))  # the decode engine's
        self.p_out, self.d_out = Outcomes(), Outcomes()
        self.requests: dict[int, Request] = {}
        self.loads: dict[str, bool] = {}  # decode request -> its load failed
        self.ended_as: dict[str, str] = {}  # decode request -> its leg's state at its end
        self._released_seen: set[str] = set()
        self._ended_seen: set[str] = set()

    def add(
        self, index: int, prompt_len: int, local_tokens: int, follows: int | None = None
    ) -> Request:
        """A request; one that `follows` another is its sibling under n > 1: no prefill
        leg of its own, and on decode it reads what its sibling loads."""
        request = Request(index, prompt_len, local_tokens, follows=follows)
        if follows is not None:
            request.prefill = "finished"
        self.requests[index] = request
        return request

    # -- the prefill engine -------------------------------------------------------------

    def prefill_arrives(self, r: Request) -> None:
        if r.prefill == "new":
            r.prefill = "running"
            self.p_requests.prefill.arrived(r.p_id, r.tid, r.tid, r.prompt_len, named_here=False)
            self._apply_prefill(self.p_requests.take_plan())

    def prefill_step(self, r: Request, tokens: int) -> None:
        if r.prefill != "running" or r.computed >= r.prompt_len:
            return
        r.computed = min(r.prompt_len, r.computed + tokens)
        table = self.p_groups.setdefault(r.tid, [[] for _ in range(self.groups)])
        more = -(-r.computed // BLOCK) - len(table[0])
        if more > 0:
            new = [self.sim.p_ledger.alloc(r.tid, more) for _ in table]
            for mine, ids in zip(table, new, strict=True):
                mine.extend(ids)
            self.sim.p_blocks[r.tid] = interleave(table)  # the ids the ledger was told
            self.p_requests.prefill.blocks_assigned(r.p_id, new, resumed=False)
        self.p_requests.prefill.step_scheduled({r.p_id: r.computed})
        self._apply_prefill(self.p_requests.take_plan())
        self._slide(r)

    def _slide(self, r: Request) -> None:
        """vLLM frees the sliding group's blocks that the next token's window, less the
        margin, no longer covers, and pads their positions with the null block."""
        if not self.window or r.tid not in self.p_groups or r.tid not in self.sim.p_ledger.live:
            return
        sliding = self.p_groups[r.tid][1]
        left = max(0, r.computed - self.window + 1 - self.margin) // BLOCK
        for position in range(min(left, len(sliding))):
            if sliding[position] != NULL:
                self.sim.p_ledger.free_block(r.tid, sliding[position])
                sliding[position] = NULL

    def prefill_finishes(self, r: Request, sendable: bool = True) -> None:
        if r.prefill != "running":
            return
        r.prefill = "finished"
        self._slide(r)  # before vLLM tells the connector, as vLLM 0.32 does
        finish = self.p_requests.finished(r.p_id, sendable and r.computed >= r.prompt_len)
        self._apply_prefill(self.p_requests.take_plan())
        if finish.keep_blocks:
            self.p_out.engine_finished({r.p_id})
        elif r.tid in self.sim.p_ledger.live:
            self.sim.p_ledger.release(r.tid)

    def _apply_prefill(self, plan: StepPlan) -> None:
        sim = self.sim
        for pending in plan.pending:
            sim.pending(pending.transfer_id, pending.sequential)
        for tid in plan.aborts:
            sim.abort_producer(tid)
        for chunk in plan.progress:
            self.p_out.sending(chunk.request_id, chunk.transfer_id)
            sim.kv_ready.add(chunk.transfer_id)
            actions = sim.producer.kv_progress(
                chunk.transfer_id, list(chunk.block_ids), chunk.full_blocks, sim.now
            )
            sim._run_producer(actions)
        for produce in plan.produces:
            self.p_out.sending(produce.request_id, produce.transfer_id)
            sim.kv_ready.add(produce.transfer_id)
            sim.last_step.add(produce.transfer_id)
            ready = sim.producer.kv_ready(produce.transfer_id, list(produce.block_ids), sim.now)
            sim._run_producer(ready)

    # -- the decode engine --------------------------------------------------------------

    def decode_arrives(self, r: Request) -> None:
        if r.decode != "new":
            return
        r.decode = "queued"
        announce = Announce(r.tid, (PRODUCER,))
        if r.follows is None:
            self.d_requests.decode.announced(r.d_id, r.tid, announce)
        else:
            leader = self.requests[r.follows]
            self.d_requests.decode.follows(r.d_id, r.tid, leader.d_id, announce)
        self._apply_decode(self.d_requests.take_plan())

    def decode_allocates(self, r: Request) -> None:
        if r.decode != "queued":
            return
        match = self.d_requests.decode.matched(r.d_id, r.prompt_len, r.local_tokens)
        if match.tokens is None:
            return
        r.decode = "allocated"
        if match.tokens:
            positions = -(-r.prompt_len // BLOCK)
            table = [self.sim.c.ledger.alloc(r.tid, positions)]
            if self.window:
                # The window of the token decode computes first (after its cached and
                # loaded ones) starts here; vLLM pads what lies before with the null block.
                left = max(0, r.local_tokens + match.tokens - self.window + 1) // BLOCK
                left = min(left, positions)
                table.append([NULL] * left + self.sim.c.ledger.alloc(r.tid, positions - left))
            if not self.d_requests.decode.allocated(r.d_id, table, match.tokens):
                self.sim.c.ledger.release(r.tid)  # fails at once: vLLM frees them on the report
        self._apply_decode(self.d_requests.take_plan())

    def decode_finishes(self, r: Request) -> None:
        """The request ends: after its load (it ran), or aborted at any time."""
        if r.decode in ("new", "finished"):
            return
        r.decode = "finished"
        leg = self.d_requests.decode.legs.get(r.d_id)
        self.ended_as[r.d_id] = str(leg.state) if leg is not None else "unknown"
        self.d_requests.finished(r.d_id)
        self._apply_decode(self.d_requests.take_plan())

    def _apply_decode(self, plan: StepPlan) -> None:
        sim, side = self.sim, self.sim.c
        for announce in plan.announces:
            sim._run_consumer(side, side.machine.announce(announce.transfer_id, PRODUCER, sim.now))
        for expect in plan.expects:
            self.d_out.receiving(expect.request_id, expect.transfer_id)
            side.expected[expect.transfer_id] = list(expect.block_ids)
            side.skipped[expect.transfer_id] = expect.skip_blocks
            claim = side.machine.expect(
                expect.transfer_id, [Source(PRODUCER)], list(expect.block_ids), sim.now,
                expect.skip_blocks,
            )  # fmt: skip
            sim._run_consumer(side, claim)
        for tid in plan.aborts:
            sim._run_consumer(side, side.machine.abort(tid, sim.now))
        for request_id, _ in plan.rejects:
            self.d_out.rejected(request_id)

    # -- the workers' outcomes, back to the ledgers -------------------------------------

    def collect(self) -> None:
        """What the workers report after a step: releases and landings, as vLLM hears."""
        sim, side = self.sim, self.sim.c
        for tid in set(sim.released) - self._released_seen:
            self._released_seen.add(tid)
            self.p_out.let_go(tid)
        ended = {t: True for t in side.delivered} | {t: False for t in side.failed}
        for tid, ok in ended.items():
            if tid not in self._ended_seen:
                self._ended_seen.add(tid)
                self.d_out.received(tid, ok)
        sending, _, _ = self.p_out.take()
        for request_id in self.p_requests.prefill.released(sending):
            self.sim.p_ledger.release(self.prefill_tid(request_id))
        _, recving, failed = self.d_out.take()
        for request_id in recving:
            self.loads[request_id] = request_id in failed
            self.d_requests.decode.loaded(request_id, failed=request_id in failed)

    @staticmethod
    def prefill_tid(request_id: str) -> str:
        return "t" + request_id.removeprefix("p")

    def next_step(self, r: Request) -> None:
        """The next thing a request's life brings, in the usual order."""
        if r.prefill == "new":
            self.prefill_arrives(r)
        elif r.decode == "new":
            self.decode_arrives(r)
        elif r.decode == "queued":
            self.decode_allocates(r)
        elif r.computed < r.prompt_len:
            self.prefill_step(r, 2 * BLOCK)
        elif r.prefill == "running":
            self.prefill_finishes(r)
        elif r.d_id in self.loads or self.landed(r) or r.follows is not None:
            self.decode_finishes(r)

    # -- the end ------------------------------------------------------------------------

    def drain(self) -> None:
        """Every request runs to its end; then everything settles."""
        for r in self.requests.values():
            self.prefill_arrives(r)
            self.prefill_step(r, r.prompt_len)
            self.prefill_finishes(r)
            self.decode_arrives(r)
            self.decode_allocates(r)
        for _ in range(20):
            self.sim.settle()
            self.collect()
            for r in self.requests.values():
                self.decode_allocates(r)  # followers, once their sibling landed
        for r in self.requests.values():
            self.decode_finishes(r)
        self.sim.settle()
        self.collect()

    def check(self) -> None:
        problems = []
        stuck = [r.d_id for r in self.requests.values()
                 if self.d_requests.decode.legs.get(r.d_id, None) is not None]  # fmt: skip
        if stuck:
            problems.append(f"decode ledger still holds {stuck}")
        if self.p_requests.prefill.legs:
            problems.append(f"prefill ledger still holds {sorted(self.p_requests.prefill.legs)}")
        if any(self.d_requests.counts().values()) or any(self.p_requests.counts().values()):
            problems.append(f"counts {self.p_requests.counts()} / {self.d_requests.counts()}")
        assert not problems, "\n".join(problems)
        self.sim.check()

    def landed(self, r: Request) -> bool:
        leg = self.d_requests.decode.legs.get(r.d_id)
        return (leg is not None and leg.state == DecodeState.LANDED) or (
            self.loads.get(r.d_id) is False
        )
