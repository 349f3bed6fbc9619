"""The scheduler half of KVPushConnector: which requests send or receive, and when.

It runs in vLLM's engine-core process. It never moves bytes: each step it tells the
workers, through KVPushMetadata, which transfers to claim (decode), which KV will
be complete at the end of the step (prefill), and which to abandon. What to tell
them the request ledger decides (kvpush.engine, docs/engine.md); this module reads
vLLM's objects into the ledger's events, and starts this instance's identity
endpoints (kvpush.vllm.identity). Block ids come one list per KV cache group.

kv_transfer_params, the two-leg contract (docs/routing.md):
  prefill leg   {"do_remote_decode": true, "transfer_id": T}
  decode leg    {"do_remote_prefill": true, "transfer_id": T, "transfer_mode": M,
                 "remote_engine_id": E, "remote_epoch": X, "remote_addresses": [...]}
and the prefill response echoes the producer's identity in the decode-leg shape,
with upstream NixlConnector's fields beside it (kvpush.identities.prefill_echo).
A prefill leg with no transfer_id (a sequential orchestrator sending upstream
NixlConnector's shape) gets one named after its API request, so the echo it forwards
moves KV; a decode leg naming its producer only by an endpoint (a Mooncake-mode
router's bootstrap server, or the echo's remote_host and remote_port, which
vllm-router's NIXL push mode keeps) is completed from that endpoint's answer
(kvpush.vllm.bootstrap), taking the transfer its prefill leg's instance named.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpush.engine.ledger import Ledger
from kvpush.errors import ConfigError, ProtocolError
from kvpush.identities import RELEASE_PATH, InstanceIdentity, prefill_echo
from kvpush.legs import announce, decode_leg_problem, learn_producer
from kvpush.protocol.messages import check_transfer_id
from kvpush.vllm import hooks
from kvpush.vllm.bootstrap import BootstrapResolver, LegError
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.groups import NULL_BLOCK
from kvpush.vllm.identity import IdentityService
from kvpush.vllm.landings import Landings
from kvpush.vllm.metadata import KVPushHandshake, KVPushMetadata, KVPushWorkerMeta
from kvpush.vllm.release import Releases
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.spans import Spans
from kvpush.vllm.transfers import EngineTransfers, api_kind, api_request_id
from kvpush.vllm.wake import Doorbell, IdleSteps

log = logging.getLogger(__name__)

# Finished statuses after which a prefill's KV is complete and worth sending.
_SENDABLE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
_COUNTED = ("recomputed", "orphaned", "refused", "prefill_leg_prefix")
_Call = TypeVar("_Call", bound=Callable[..., Any])


def _traced(call: _Call) -> _Call:
    """A vLLM call into the ledger: what it moved goes to the request timelines
    (kvpush.vllm.spans) once it returns."""

    @functools.wraps(call)
    def traced(self: SchedulerSide, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        finally:
            self.spans.read(self.ledger.take_moves())

    return traced  # type: ignore[return-value]


class SchedulerSide:
    """vLLM's scheduler calls, as events for the request ledger (kvpush.engine.ledger).

    It reads vLLM's objects and kv_transfer_params, names transfers, completes decode
    legs that name their producer by an endpoint, and counts and traces what
    happens; what each request's state is and what the workers are told, the ledger
    decides. This instance's identity and its endpoints are IdentityService's, and
    whether an empty step waits, IdleSteps'.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        shape: EngineShape,
        bootstrap: BootstrapResolver | None = None,
        secret: bytes = b"",  # the deployment's: it keys the release tokens
    ) -> None:
        self.config = config
        self.shape = shape
        # By reason, since the last stats(): prompts recomputed here, orphaned legs, ...
        self.counts: dict[str, Counter[str]] = {k: Counter() for k in _COUNTED}
        # One of several DP ranks (vLLM runs each as an engine of its own): its ports
        # are offset by the rank, and DP rank 0 speaks for all in the bootstrap answer.
        if shape.data_parallel and config.bootstrap_port and not config.identity_port:
            raise ConfigError(
                "bootstrap_port with --data-parallel-size > 1 needs identity_port too: DP "
                "rank 0's bootstrap server asks every other rank at identity_port + rank"
            )
        self.me = IdentityService(
            config, shape.engine_id, shape.block_size, shape.world, shape.dp_rank,
            shape.data_parallel, shape.block_pages, shape.kv_groups,
        )  # fmt: skip
        self.me.kv_states, self.me.seeds_rewind = len(shape.states), shape.seeds_rewind
        self.ledger = Ledger(
            shape.block_size, shape.prefix_caching, shape.recompute_on_failure,
            config.progressive, shape.windowed, shape.states, NULL_BLOCK,
        )  # fmt: skip
        self.bootstrap = bootstrap or BootstrapResolver()
        self._said: set[str] = set()  # what was logged once already
        self._ids = EngineTransfers(model=shape.model_name)
        self._rank_states: dict[int, dict[str, int]] = {}  # worker rank -> its state counts
        self._rank_hooks: dict[int, dict[str, str]] = {}  # worker rank -> its vLLM hooks
        # Prefill legs' prefix-cache lookups (prompt tokens, hits) awaiting admission.
        self._leg_lookups: dict[str, tuple[int, int]] = {}
        self._prefix_caching = shape.prefix_caching
        # DP ranks that step in lockstep (vLLM's MoE data parallel) meet in a collective
        # every few steps: one rank sleeping through an empty step would hold up the
        # others' real ones, so such ranks step as vLLM does.
        if shape.lockstep:
            self.idle = IdleSteps(0.0)
            hooks.RECORD.missed("idle_wait", "DP ranks step in lockstep here")
        else:
            self.idle = IdleSteps(hooks.idle_wait_allowed(config.idle_wait_s))
        self.spans = Spans()
        self.landings = Landings(self.ledger, self.spans, self.idle, shape.world)
        self.releases = Releases(self.ledger, shape.world, self.idle.doorbell.port, secret)

    @property
    def epoch(self) -> str:
        return self.me.epoch

    @property
    def doorbell(self) -> Doorbell:
        return self.idle.doorbell

    @property
    def idle_waits(self) -> int:
        return self.idle.waits

    # -- identity -------------------------------------------------------------------

    def set_handshakes(self, handshakes: dict[int, KVPushHandshake]) -> None:
        self.me.serve(
            handshakes,
            {
                "/kvpush/state": lambda q: (
                    self.state_detail() if q.get("detail") == "1" else self.state()
                ),
                "/kvpush/spans": lambda q: self.spans.summary(reset=q.get("reset") == "1"),
                "/kvpush/trace": lambda q: self.spans.trace(int(q.get("last", 100))),
            },
            {RELEASE_PATH: lambda body: self.releases.ask(body, self.epoch)},
        )

    def identity(self) -> InstanceIdentity:
        """This instance as routers see it: GET /query, and the prefill response echo."""
        return self.me.identity()

    def state(self) -> dict[str, Any]:
        """Counts a leak check reads after a run: all zero when nothing is in flight."""
        return self.ledger.counts()

    def state_detail(self) -> dict[str, Any]:
        """state(), and the workers' transfers per machine state (summed over ranks,
        as of their last step): which path holds KV when a leak check fails."""
        by_state: dict[str, int] = {}
        for counts in list(self._rank_states.values()):
            for state, count in counts.items():
                by_state[state] = by_state.get(state, 0) + count
        hooks_by_process = {"scheduler": hooks.RECORD.snapshot()}
        hooks_by_process |= {f"worker{rank}": h for rank, h in sorted(self._rank_hooks.items())}
        detail = {"by_state": dict(sorted(by_state.items())), "hooks": hooks_by_process}
        return {**self.state(), **detail, "landings": self.landings.counts()}

    def close(self) -> None:
        self.me.close()
        self.releases.close()
        self.idle.close()

    # -- vLLM scheduler hooks -------------------------------------------------------------

    @_traced
    def on_new_request(self, request: Any) -> None:
        """vLLM took the request in: name its transfer and tell the peer now, not when
        the request reaches the head of a queue that may be long."""
        self.idle.news()
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._admit_prefill(request, params)
        elif params.get("do_remote_prefill"):
            self._admit_decode(request, params)
        elif self.shape.consumer_only:
            self.counts["orphaned"]["no_kv_transfer_params"] += 1
            self._recomputed(
                "no_kv_transfer_params",
                f"request {request.request_id} came with no kv_transfer_params: its "
                "orchestrator did not forward the prefill answer's; computing the prompt here",
            )

    @_traced
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._admit_prefill(request, params)
            self._leg_looked_up(request, num_computed_tokens)
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        self._admit_decode(request, params)  # if vLLM did not call on_new_request
        prompt_len = len(request.prompt_token_ids or ())
        match = self.ledger.matched(request.request_id, prompt_len, num_computed_tokens)
        if match.local:
            params["do_remote_prefill"] = False
        return match.tokens, match.load_async

    @_traced
    def computes_prompt_here(self, request: Any, why: str, message: str) -> None:
        """vLLM drops a decode leg's match and computes its prompt: the producer may free
        its KV now, not when this request ends."""
        request.kv_transfer_params["do_remote_prefill"] = False  # not matched again
        self.ledger.computes_prompt(request.request_id)
        self._recomputed(why, message)

    @_traced
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        lookup = self._leg_lookups.pop(request.request_id, None)
        if lookup is not None:  # admitted: now vLLM counts its lookup, and so do we
            self.counts["prefill_leg_prefix"].update(queried=lookup[0], hit=lookup[1])
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_prefill") and num_external_tokens > 0):
            return
        # One transfer per request: a retry under "recompute" computes locally.
        params["do_remote_prefill"] = False
        self.ledger.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    @_traced
    def build_connector_meta(self, scheduler_output: Any) -> KVPushMetadata:
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._preempted(request_id)
        self._track_prefill_blocks(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        self.spans.scheduled(scheduled)
        # Only legs still computing: a sent or held one is not looked up every step.
        computed = {
            request_id: self._computed_after(scheduler_output, request_id)
            for request_id in self.ledger.still_computing()
            if request_id in scheduled
        }
        self.ledger.step_scheduled(computed)
        self.releases.plan()  # asked on the identity endpoint since the last step
        meta = KVPushMetadata.of(self.ledger.take_plan())
        meta.doorbell, meta.doorbell_key = self.idle.doorbell.port, self.idle.doorbell.key
        meta.park = self._only_transfers_to_wait_for(scheduler_output, meta)
        # A step telling the workers of finished requests goes out at once (kvpush.vllm.wake).
        waiting = self.ledger.waiting_on_transfers()
        idle_after = waiting and not scheduler_output.total_num_scheduled_tokens
        self.idle.after_step(meta.park and not scheduler_output.finished_req_ids, idle_after)
        return meta

    def _only_transfers_to_wait_for(self, out: Any, meta: KVPushMetadata) -> bool:
        """Whether this step computes nothing, asks the workers to start nothing, and
        only a transfer's end (a landing, a WRITE done) can change that: the workers
        may sleep after it. A step that tells of finished requests counts: on a
        prefill it is often the last before the engine goes idle (its WRITE done
        comes back with it), and a worker not parked then spins vLLM's full second."""
        if out.total_num_scheduled_tokens or meta.carries_work():
            return False
        return self.ledger.waiting_on_transfers()

    @_traced
    def request_finished(
        self, request: Any, groups: Sequence[Sequence[int]], spoiled: bool = False
    ) -> tuple[bool, Any]:
        request_id = request.request_id
        self.idle.news()
        self._ids.forget(request_id)
        self._leg_lookups.pop(request_id, None)
        # spoiled: vLLM freed blocks the KV needs (groups.window_lost): send nothing.
        finish = self.ledger.finished(request_id, _status(request) in _SENDABLE and not spoiled)
        leg = finish.echo
        if leg is None:
            return finish.keep_blocks, None
        base = leg.base_id
        # The id a router matching legs by X-Request-Id knows the request by.
        known_as = base.removeprefix(api_kind(base)) if leg.named_here else base
        token = self.releases.token(self.epoch, base)
        return True, prefill_echo(
            base, self.identity(), groups, known_as, leg.prompt_len, leg.transfer_id, token
        )

    @_traced
    def update_connector_output(self, output: Any) -> None:
        """A step's output, before vLLM reads it."""
        self.landings.drop_reported(output)  # the landings taken before schedule()
        self._heard_from_workers(getattr(output, "kv_connector_worker_meta", None))
        self.ledger.released(output.finished_sending or ())
        failed = getattr(output, "failed_recving", None) or ()
        self._loads_reported(output.finished_recving or (), failed)

    def _heard_from_workers(self, meta: Any) -> None:
        """What the worker ranks noted since the last step: failures, when KV landed or
        was sent, their transfers' states, their hooks, a new boot's identity (after
        vLLM let go of the KV cache's memory), their release verdicts."""
        for request_id, why in (getattr(meta, "failed", None) or {}).items():
            self.spans.fail(request_id, why)
        for milestone in KVPushWorkerMeta.NOTES:
            for request_id, wall in (getattr(meta, milestone, None) or {}).items():
                self.spans.noted(request_id, {milestone: wall})
        self._rank_states.update(getattr(meta, "states", None) or {})
        self._rank_hooks.update(getattr(meta, "hooks", None) or {})
        self.me.learn(getattr(meta, "handshakes", None) or {})
        self.releases.heard(getattr(meta, "releases", None))

    def _loads_reported(self, loaded_ids: Any, failed: Any) -> None:
        """Decode loads the workers report ended: landed, or failed."""
        for request_id in loaded_ids:
            loaded = self.ledger.loaded(request_id, failed=request_id in failed)
            for follower, why in loaded.followers_failed:
                self.spans.fail(follower, f"sibling_failed: {why}")
            if loaded.forget_endpoint:
                self.bootstrap.forget(loaded.forget_endpoint)
            if loaded.recomputed:
                self._recomputed("transfer_failed")

    def stats(self) -> dict[str, dict[str, int]] | None:
        """The counts since the last call, by reason (None: none)."""
        counts = {key: dict(counter) for key, counter in self.counts.items() if counter}
        for counter in self.counts.values():
            counter.clear()
        return counts or None

    # -- internals ----------------------------------------------------------------------

    def _admit_prefill(self, request: Any, params: dict[str, Any]) -> None:
        request_id = request.request_id
        if self.ledger.knows(request_id):
            return
        base = params.get("transfer_id")
        named_here = base is None
        if named_here:
            base = self._name_transfer(request_id)
        try:
            check_transfer_id(base if isinstance(base, str) else "")
        except ProtocolError:
            log.error(
                "kvpush: prefill request %s has an invalid transfer_id %r in "
                "kv_transfer_params; its KV will not be sent",
                request_id,
                base,
            )
            self.ledger.declined(request_id)
            return
        tid, _ = self._ids.assign(request, base)
        prompt_len = len(request.prompt_token_ids or ())
        self.ledger.arrived(request_id, tid, base, prompt_len, named_here)

    def _name_transfer(self, request_id: str) -> str:
        """A transfer id for a prefill leg that brought none, alike for every engine
        request of one API request (a list's prompts, n's choices), as the decode leg
        will get only one echo for them all."""
        self._once(
            "named",
            logging.INFO,
            "prefill legs come without a transfer_id (a sequential orchestrator): "
            "naming their transfers here and echoing them to decode",
        )
        return api_request_id(request_id)

    def _leg_looked_up(self, request: Any, hits: int) -> None:
        """A prefill leg's prefix-cache lookup, kept for its admission: vLLM counts its
        lookups in vllm:prefix_cache_queries/hits only then, not after a preemption, and
        not where the request skips the cache. Those counters less these are the lookups
        of the requests this instance decodes."""
        skips = getattr(request, "skip_reading_prefix_cache", False)
        if self._prefix_caching and not skips and not getattr(request, "num_preemptions", 0):
            self._leg_lookups[request.request_id] = (len(request.prompt_token_ids or ()), hits)

    def _recomputed(self, reason: str, message: str = "") -> None:
        """A decode prompt no transfer serves: in metrics, and once in the log unless logged."""
        if message:
            self._once(reason, logging.WARNING, f"{message} (vllm:kvpush_local_recomputes_total)")
        self.counts["recomputed"][reason] += 1

    def _once(self, key: str, level: int, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, "kvpush: %s", message)

    def _admit_decode(self, request: Any, params: dict[str, Any]) -> None:
        """Name a decode leg's transfer and announce it to the producer, once."""
        request_id = request.request_id
        if self.ledger.knows(request_id):
            return
        learnt_from = ""
        try:
            allowed = self.config.allowed_producers
            learnt = learn_producer(request_id, params, allowed, self.bootstrap)
            if learnt is None:
                return  # its bootstrap server is being asked; vLLM asks again
            learnt_from = learnt
            found = decode_leg_problem(params, self.config.protocol.mode, self.shape.world, allowed)
        except LegError as exc:
            found = exc.reason, str(exc)
        if found is not None:
            reason, problem = found
            tid = str(params.get("transfer_id", ""))
            self.ledger.rejected(request_id, tid, problem, learnt_from)
            self.counts["refused"][reason] += 1
            self.spans.read(self.ledger.take_moves())  # its timeline begins, to say why
            self.spans.fail(request_id, f"{reason}: {problem}")
            log.error("kvpush: request %s cannot load its KV: %s", request_id, problem)
            if self.ledger.recompute_on_failure:
                self._recomputed(reason)
            return
        tid, leader = self._ids.assign(
            request, params["transfer_id"], params.get("remote_transfer_id")
        )
        if leader is not None:
            # The sibling may have finished already (vLLM adds n's choices one by one,
            # and under load far apart): prefill made no copy for this one under n,
            # so it must not wait for one.
            failed = self.ledger.follows(request_id, tid, leader, announce(tid, params))
            if failed:
                self.spans.fail(request_id, f"sibling_failed: {failed}")
            return
        named = announce(tid, params)
        self.ledger.announced(request_id, tid, named, learnt_from, params["transfer_id"])

    def _preempted(self, request_id: str) -> None:
        """vLLM took a producing request's blocks back, to compute it again later."""
        ended = self.ledger.preempted(request_id)
        if ended is not None:
            log.warning(
                "kvpush: prefill request %s was preempted while its KV was being sent; "
                "transfer %s ends without it",
                request_id,
                ended,
            )

    def _track_prefill_blocks(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            self.ledger.blocks_assigned(new.req_id, new.block_ids, resumed=True)
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()  # vLLM 0.34: sent as new
        for i, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                self.ledger.blocks_assigned(request_id, new_blocks, request_id in resumed)

    def _computed_after(self, out: Any, request_id: str) -> int:
        """How many of the request's tokens have KV once this step has run (prefix-cache
        hits included: vLLM counts them as computed)."""
        scheduled = out.num_scheduled_tokens[request_id]
        for new in out.scheduled_new_reqs:
            if new.req_id == request_id:
                return new.num_computed_tokens + scheduled
        cached = out.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.req_ids.index(request_id)] + scheduled


def _status(request: Any) -> str:
    return getattr(request.status, "name", str(request.status))
