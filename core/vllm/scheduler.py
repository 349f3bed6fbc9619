"""The scheduler half of KVPushConnector: which requests send or receive, and when.

It runs in vLLM's engine-core process. It never moves bytes: each step it tells the
workers, through KVPushMetadata, which transfers to claim (decode), which KV will
be complete at the end of the step (prefill), and which to abandon. It also serves
this instance's kvpush identity to routers.

kv_transfer_params, the two-leg contract (docs/routing.md):
  prefill leg   {"do_remote_decode": true, "transfer_id": T}
  decode leg    {"do_remote_prefill": true, "transfer_id": T, "transfer_mode": M,
                 "remote_engine_id": E, "remote_epoch": X, "remote_addresses": [...]}
and the prefill response echoes the producer's identity in the decode-leg shape,
with upstream NixlConnector's fields beside it (kvpush.kv_params.prefill_echo).
A prefill leg with no transfer_id (a sequential orchestrator sending upstream
NixlConnector's shape) gets one named here, after its API request, so the echo it
forwards still moves KV; a decode leg that names its producer only by an endpoint
(a Mooncake-mode router's bootstrap server, or the remote_host and remote_port of
the echo, which vllm-router's NIXL push mode keeps while dropping the rest) is
completed from that endpoint's answer (kvpush.vllm.bootstrap), and takes the
transfer its prefill leg's instance named.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvpush.errors import ConfigError, ProtocolError
from kvpush.identities import dp_siblings, mooncake_query
from kvpush.kv_params import decode_params, prefill_echo
from kvpush.layout import tp_problem
from kvpush.protocol.messages import check_transfer_id
from kvpush.vllm import hooks
from kvpush.vllm.bootstrap import BootstrapResolver, LegError
from kvpush.vllm.config import ConnectorConfig, producer_allowed, rank_port
from kvpush.vllm.identity import IdentityServer
from kvpush.vllm.metadata import (
    Announce,
    Expect,
    KVPushHandshake,
    KVPushMetadata,
    KVPushWorkerMeta,
    Pending,
    Produce,
    Progress,
)
from kvpush.vllm.spans import Spans
from kvpush.vllm.transfers import EngineTransfers, api_kind, api_request_id
from kvpush.vllm.wake import Doorbell

log = logging.getLogger(__name__)

# Finished statuses after which a prefill's KV is complete and worth sending.
_SENDABLE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
# host:port, the host a name or an IPv4 address (or an IPv6 one in brackets).
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]{1,253}):\d{1,5}")
EPOCH_SEPARATOR = "-"  # between the ranks' boots in remote_epoch
FAILED_LOADS_KEPT = 4096


@dataclass
class _Producing:
    transfer_id: str  # this engine request's own (see kvpush.vllm.transfers)
    base_id: str  # the router's, echoed to it
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    named_here: bool = False  # the prefill leg brought no transfer id: we named it
    signalled: bool = False  # a step computing its last prompt token was scheduled
    progressed: bool = False  # a step computing an earlier chunk was (progressive push)
    spoiled: bool = False  # preempted after either: what a WRITE reads is not its KV


class SchedulerSide:
    """Scheduler-process bookkeeping for one vLLM instance."""

    def __init__(
        self,
        config: ConnectorConfig,
        engine_id: str,
        block_size: int,
        world: int,
        prefix_caching: bool = True,
        consumer_only: bool = False,
        recompute_on_failure: bool = False,
        dp_rank: int = 0,
        data_parallel: bool = False,
        lockstep: bool = False,
        bootstrap: BootstrapResolver | None = None,
        model_name: str = "",
        block_pages: bool = True,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        # Whether a peer of another block size may take our blocks as pages of its own.
        self.block_pages = block_pages
        self.world = world
        self.prefix_caching = prefix_caching
        self.consumer_only = consumer_only  # kv_role kv_consumer: every request is a decode leg
        self.recompute_on_failure = recompute_on_failure  # kv_load_failure_policy recompute
        # Since the last stats(), by reason: decode prompts computed here, and legs
        # whose other leg's params never came.
        self.counts: dict[str, Counter[str]] = {
            "recomputed": Counter(), "orphaned": Counter(), "refused": Counter(),
        }  # fmt: skip
        # One of several DP ranks (vLLM runs each as an engine of its own): its ports
        # are offset by the rank, and DP rank 0 speaks for all in the bootstrap answer.
        self.dp_rank, self.data_parallel = dp_rank, data_parallel
        if data_parallel and config.bootstrap_port and not config.identity_port:
            raise ConfigError(
                "bootstrap_port with --data-parallel-size > 1 needs identity_port too: DP "
                "rank 0's bootstrap server asks every other rank at identity_port + rank"
            )
        self.bootstrap = bootstrap or BootstrapResolver()
        self._said: set[str] = set()  # what was logged once already
        self.epoch = os.urandom(4).hex()
        self._ids = EngineTransfers(model=model_name)
        self._producing: dict[str, _Producing] = {}
        self._admitted: set[str] = set()  # requests whose leg was looked at, once
        self._sending: set[str] = set()  # delay-freed prefill requests
        self._announced: dict[str, str] = {}  # decode request id -> transfer id, not allocated
        self._consuming: dict[str, str] = {}  # decode request id -> transfer id, allocated
        self._followers: dict[str, str] = {}  # decode request id -> its sibling 0's
        # Decode requests whose KV load failed, kept past their end (a sibling may
        # arrive after): the last few thousand.
        self._failed_loads: OrderedDict[str, None] = OrderedDict()
        self._rank_states: dict[int, dict[str, int]] = {}  # worker rank -> its state counts
        self._rank_hooks: dict[int, dict[str, str]] = {}  # worker rank -> its vLLM hooks
        self._local_hits: dict[str, int] = {}
        self._learnt_from: dict[str, str] = {}  # decode request id -> bootstrap address
        self._rejected: dict[str, str] = {}
        self._next = KVPushMetadata()
        self._ranks: dict[int, KVPushHandshake] = {}
        self.identity_server: IdentityServer | None = None
        self.bootstrap_server: IdentityServer | None = None
        self.doorbell = Doorbell()
        # DP ranks that step in lockstep (vLLM's MoE data parallel) meet in a collective
        # every few steps: one rank sleeping through an empty step would hold up the
        # others' real ones, so such ranks step as vLLM does.
        if lockstep:
            self.idle_wait_s = 0.0
            hooks.RECORD.missed("idle_wait", "DP ranks step in lockstep here")
        else:
            self.idle_wait_s = hooks.idle_wait_allowed(config.idle_wait_s)
        self.spans = Spans()
        self._quiet_before = False  # the last step was empty and told the workers nothing
        self.idle_waits = 0  # steps that waited on the doorbell (tests, metrics)

    # -- identity -------------------------------------------------------------------

    def set_handshakes(self, handshakes: dict[int, KVPushHandshake]) -> None:
        self._ranks = dict(handshakes)
        if handshakes and all(h.epoch for h in handshakes.values()):
            # This boot, as decode legs will name it: every rank's own, so a decode
            # worker can check the one it pairs with.
            self.epoch = EPOCH_SEPARATOR.join(handshakes[r].epoch for r in sorted(handshakes))
        if self.identity_server is None:
            routes = {
                "/query": lambda _: self.identity(),
                "/kvpush/state": lambda q: (
                    self.state_detail() if q.get("detail") == "1" else self.state()
                ),
                "/kvpush/spans": lambda q: self.spans.summary(reset=q.get("reset") == "1"),
                "/kvpush/trace": lambda q: self.spans.trace(int(q.get("last", 100))),
            }
            port = rank_port(self.config.identity_port, self.dp_rank)
            self.identity_server = IdentityServer(self.config.host, port, routes)
        if self.config.bootstrap_port and self.dp_rank == 0 and self.bootstrap_server is None:
            query = {"/query": lambda _: mooncake_query(self._dp_identities())}
            self.bootstrap_server = IdentityServer(
                self.config.host, self.config.bootstrap_port, query
            )

    def identity(self) -> dict[str, Any]:
        """This instance as routers see it: GET /query, and the prefill response echo."""
        port = self.identity_server.port if self.identity_server is not None else 0
        return {
            "engine_id": self.engine_id,
            "endpoint": f"{self.config.host}:{port}",
            "epoch": self.epoch,
            "transfer_mode": self.config.protocol.mode,
            "tp_size": self.world,
            "block_size": self.block_size,
            "block_pages": self.block_pages,
            "dp_rank": self.dp_rank,
            "data_parallel": self.data_parallel,
            "addresses": [self._ranks[r].address for r in sorted(self._ranks)],
            "ranks": [
                {"rank": r, "address": h.address, "epoch": h.epoch, "agent": h.agent}
                for r, h in sorted(self._ranks.items())
            ],
            "kvpush": True,
        }

    def _dp_identities(self) -> list[dict[str, Any]]:
        """Every DP rank's identity: ours, then DP rank 1, 2, ... from their identity
        endpoints until one does not answer (vLLM tells an engine its own DP rank, not
        how many there are)."""
        mine = self.identity()
        url = f"http://{self.config.host}:{self.config.identity_port}"
        return [mine, *dp_siblings(url, mine)]

    def state(self) -> dict[str, Any]:
        """Counts a leak check reads after a run: all zero when nothing is in flight."""
        return {
            "sending": len(self._sending),
            "producing": len(self._producing),
            "receiving": len(self._consuming),
        }

    def state_detail(self) -> dict[str, Any]:
        """state(), and the workers' transfers per machine state (summed over ranks,
        as of their last step): which path holds KV when a leak check fails."""
        by_state: dict[str, int] = {}
        for counts in list(self._rank_states.values()):
            for state, count in counts.items():
                by_state[state] = by_state.get(state, 0) + count
        hooks_by_process = {"scheduler": hooks.RECORD.snapshot()}
        hooks_by_process |= {f"worker{rank}": h for rank, h in sorted(self._rank_hooks.items())}
        return {
            **self.state(),
            "by_state": dict(sorted(by_state.items())),
            "hooks": hooks_by_process,
        }

    def close(self) -> None:
        for server in (self.identity_server, self.bootstrap_server):
            if server is not None:
                server.close()
        self.doorbell.close()

    # -- vLLM scheduler hooks -------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM took the request in: name its transfer and tell the peer now, not when
        the request reaches the head of a queue that may be long."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._admit_prefill(request, params)
        elif params.get("do_remote_prefill"):
            self._admit_decode(request, params)
        elif self.consumer_only:
            self.counts["orphaned"]["no_kv_transfer_params"] += 1
            self._recomputed(
                "no_kv_transfer_params",
                f"request {request.request_id} came with no kv_transfer_params: its "
                "orchestrator did not forward the prefill answer's; computing the prompt here",
            )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._admit_prefill(request, params)
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        self._admit_decode(request, params)  # if vLLM did not call on_new_request
        request_id = request.request_id
        if request_id not in self._admitted:
            return None, False  # its producer is still being learnt: ask again
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if request_id in self._rejected:
            return max(count, 1), True  # reported failed at once, per kv_load_failure_policy
        leader = self._followers.get(request_id)
        if leader is not None:
            if self.prefix_caching and self._loading(leader):
                return None, False  # ask again once its sibling's KV is in the prefix cache
            del self._followers[request_id]
            params["do_remote_prefill"] = False
            return 0, False
        if count <= 0:
            # Everything is cached here already: let prefill free its copy now.
            self._next.aborts.append(self._announced.pop(request_id))
            params["do_remote_prefill"] = False
            return 0, False
        self._local_hits[request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_prefill") and num_external_tokens > 0):
            return
        # One transfer per request: a retry under "recompute" computes locally.
        params["do_remote_prefill"] = False
        request_id = request.request_id
        if request_id in self._rejected:
            self._next.rejects.append((request_id, self._rejected.pop(request_id)))
            return
        tid = self._announced.pop(request_id)
        local = self._local_hits.pop(request_id, 0)
        first = local // self.block_size
        last = -(-(local + num_external_tokens) // self.block_size)
        block_ids = blocks.get_block_ids()[0][first:last]
        self._consuming[request_id] = tid
        self.spans.mark(request_id, "allocated")
        named = _announce(tid, params)
        self._next.expects.append(
            Expect(request_id, tid, named.producers, tuple(block_ids), first, named.engine,
                   named.epochs)
        )  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> KVPushMetadata:
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._preempted(request_id)
        self._track_prefill_blocks(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        self.spans.scheduled(scheduled)
        for request_id, producing in self._producing.items():
            if producing.signalled or producing.spoiled or request_id not in scheduled:
                continue
            self.spans.mark(request_id, "computing")
            computed = self._computed_after(scheduler_output, request_id)
            blocks = tuple(producing.block_ids)
            if computed >= producing.prompt_len:
                producing.signalled = True
                self.spans.mark(request_id, "last_step")
                self._next.produces.append(Produce(request_id, producing.transfer_id, blocks))
            elif self.config.progressive:
                producing.progressed = True
                full = computed // self.block_size
                self._next.progress.append(
                    Progress(request_id, producing.transfer_id, blocks, full)
                )
        meta, self._next = self._next, KVPushMetadata()
        meta.doorbell = self.doorbell.port
        meta.park = self._only_transfers_to_wait_for(scheduler_output, meta)
        # The workers learn of finished requests only from a step: one that tells of
        # them goes out at once (a prefill's blocks are freed on that news). Two empty
        # schedules in a row, not one: with async scheduling an empty one may be taken
        # while the previous batch still computes, and its outcome must not wait on us.
        quiet = meta.park and not scheduler_output.finished_req_ids
        if quiet and self._quiet_before and self.idle_wait_s:
            self.idle_waits += 1
            self.doorbell.wait(self.idle_wait_s)
        self._quiet_before = quiet
        return meta

    def _only_transfers_to_wait_for(self, out: Any, meta: KVPushMetadata) -> bool:
        """Whether this step computes nothing, asks the workers to start nothing, and
        only a transfer's end (a landing, a WRITE done) can change that: the workers
        may sleep after it. A step that tells of finished requests counts: on a
        prefill it is often the last before the engine goes idle (its WRITE done
        comes back with it), and a worker not parked then spins vLLM's full second."""
        if out.total_num_scheduled_tokens or meta.carries_work():
            return False
        return bool(self._consuming or self._sending or self._followers)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        request_id = request.request_id
        self._ids.forget(request_id)
        self._admitted.discard(request_id)
        producing = self._producing.pop(request_id, None)
        if producing is not None:
            return self._prefill_finished(request, producing, block_ids)
        self.spans.mark(request_id, "finished")
        self.spans.drop(request_id)  # if it ended off the path (failed, aborted)
        self._followers.pop(request_id, None)
        tid = self._consuming.pop(request_id, None)
        if tid is not None:
            # Finished before its KV arrived (aborted): the worker settles the transfer
            # and reports it, and vLLM keeps the blocks until then.
            self._next.aborts.append(tid)
        announced = self._announced.pop(request_id, None)
        if announced is not None:
            # Aborted while queued: stop keeping the producer's KV alive for it.
            self._next.aborts.append(announced)
        self._local_hits.pop(request_id, None)
        self._rejected.pop(request_id, None)
        self._learnt_from.pop(request_id, None)
        return False, None

    def update_connector_output(self, output: Any) -> None:
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        for request_id, why in (getattr(worker_meta, "failed", None) or {}).items():
            self.spans.fail(request_id, why)
        self._rank_states.update(getattr(worker_meta, "states", None) or {})
        self._rank_hooks.update(getattr(worker_meta, "hooks", None) or {})
        for milestone in KVPushWorkerMeta.NOTES:
            for request_id, wall in (getattr(worker_meta, milestone, None) or {}).items():
                self.spans.mark(request_id, milestone, wall)
        for request_id in output.finished_sending or ():
            self._sending.discard(request_id)
            self.spans.mark(request_id, "released")
        failed = getattr(output, "failed_recving", None) or ()
        for request_id in output.finished_recving or ():
            self.spans.mark(request_id, "reported")
            transfer = self._consuming.pop(request_id, None)
            learnt_from = self._learnt_from.pop(request_id, None)
            if request_id not in failed:
                self.spans.mark(request_id, "landed")  # if no worker stamped it
                continue
            self._failed_loads[request_id] = None
            while len(self._failed_loads) > FAILED_LOADS_KEPT:
                self._failed_loads.popitem(last=False)
            for follower in [f for f, leader in self._followers.items() if leader == request_id]:
                self._sibling_failed(follower, request_id)
            if learnt_from is not None:
                self.bootstrap.forget(learnt_from)
            if transfer is not None and self.recompute_on_failure:
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
        if request_id in self._admitted:
            return
        self._admitted.add(request_id)
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
            return
        tid, _ = self._ids.assign(request, base)
        prompt_len = len(request.prompt_token_ids or ())
        self._producing[request_id] = _Producing(tid, base, prompt_len, named_here=named_here)
        self._next.pending.append(Pending(tid, sequential=named_here))
        self.spans.begin(request_id, "prefill", base)

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

    def _recomputed(self, reason: str, message: str = "") -> None:
        """A decode prompt no transfer serves: always in metrics, and once in the log
        when the caller has not logged it itself."""
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
        if request_id in self._admitted:
            return
        try:
            if not self._learn_producer(request_id, params):
                return  # its bootstrap server is being asked; vLLM asks again
            found = _decode_leg_problem(
                params, self.config.protocol.mode, self.world, self.config.allowed_producers
            )
        except LegError as exc:
            found = exc.reason, str(exc)
        self._admitted.add(request_id)
        if found is not None:
            reason, problem = found
            self._rejected[request_id] = problem
            self.counts["refused"][reason] += 1
            self.spans.begin(request_id, "decode", str(params.get("transfer_id", "")))
            self.spans.fail(request_id, f"{reason}: {problem}")
            log.error("kvpush: request %s cannot load its KV: %s", request_id, problem)
            if self.recompute_on_failure:
                self._recomputed(reason)
            return
        tid, leader = self._ids.assign(
            request, params["transfer_id"], params.get("remote_transfer_id")
        )
        if leader is not None:
            # A sibling (n > 1, or the same prompt listed twice) brings this prompt's KV
            # once; this one reads it from the prefix cache. Should prefill have made a
            # copy for it too, let it go at once. The sibling may have finished already
            # (vLLM adds n's choices one by one, and under load far apart): prefill
            # made no copy for this one under n, so it must not wait for one.
            self._followers[request_id] = leader
            self._decline(tid, params)
            if leader in self._failed_loads:
                self._sibling_failed(request_id, leader)
            return
        self._announced[request_id] = tid
        self._next.announces.append(_announce(tid, params))
        self.spans.begin(request_id, "decode", params["transfer_id"])

    def _sibling_failed(self, follower: str, leader: str) -> None:
        """The sibling bringing this prompt's KV failed to load it. Under the fail
        policy this one fails too: computing the prompt here is what the policy
        refuses (and on vLLM's CPU build, a seeded prompt computed in chunks kills the
        engine). Under recompute it computes the prompt here, as its sibling will."""
        if self.recompute_on_failure:
            return
        del self._followers[follower]
        self._rejected[follower] = (
            f"its sibling {leader} (same prompt, n > 1 or a repeated list prompt) failed "
            "to load the prompt's KV, and kv_load_failure_policy is fail"
        )
        self.spans.fail(follower, f"sibling_failed: {self._rejected[follower]}")

    def _learn_producer(self, request_id: str, params: dict[str, Any]) -> bool:
        """Complete a leg that names its producer only by an endpoint: a Mooncake-mode
        router's bootstrap server, or the echo's remote_host and remote_port (all that
        vllm-router's NIXL push mode keeps of it). False while the endpoint is being
        asked. A leg without a transfer id takes the one its prefill leg's instance
        named (both legs carry the router's X-Request-Id)."""
        if "remote_addresses" in params:
            return True
        address = _producer_endpoint(params, self.config.allowed_producers)
        if address is None:
            return True  # nothing to learn from: _decode_leg_problem says why
        engine = str(params.get("remote_engine_id") or "")
        identity = self.bootstrap.producer(address, engine)
        if identity is None:
            return False
        transfer_id = params.get("transfer_id") or _named_by_prefill(request_id, params)
        params.update(decode_params(transfer_id, identity))
        self._learnt_from[request_id] = address
        return True

    def _loading(self, request_id: str) -> bool:
        return request_id in self._announced or request_id in self._consuming

    def _preempted(self, request_id: str) -> None:
        """vLLM took a producing request's blocks back, to compute it again later. Once
        its KV was signalled a WRITE may be reading them while they become another
        request's: end that transfer (decode discards whatever lands and fails the
        load, per its policy), and send nothing for the recomputed request."""
        producing = self._producing.get(request_id)
        sent_any = producing is not None and (producing.signalled or producing.progressed)
        if not sent_any or producing.spoiled:
            return  # not signalled: no WRITE reads its blocks, and resuming re-reads them
        producing.spoiled = True
        self._next.aborts.append(producing.transfer_id)
        log.warning(
            "kvpush: prefill request %s was preempted while its KV was being sent; "
            "transfer %s ends without it",
            request_id,
            producing.transfer_id,
        )

    def _prefill_finished(
        self, request: Any, producing: _Producing, block_ids: list[int]
    ) -> tuple[bool, dict | None]:
        if not (producing.signalled or producing.progressed):
            # No step of it was reported: no WRITE can read these blocks.
            self._next.aborts.append(producing.transfer_id)
            self.spans.drop(request.request_id)
            return False, None
        if producing.spoiled or not producing.signalled:
            # Ended at a preemption, or aborted between chunks: a chunk's WRITE may
            # still read the blocks. Keep them until the producer lets go, and name
            # nothing for decode to claim.
            if not producing.spoiled:
                self._next.aborts.append(producing.transfer_id)
            self._sending.add(request.request_id)
            self.spans.drop(request.request_id)
            return True, None
        self.spans.mark(request.request_id, "computed")
        if _status(request) not in _SENDABLE:
            # A WRITE may be reading the blocks: free them only when the producer says so.
            self._next.aborts.append(producing.transfer_id)
        self._sending.add(request.request_id)
        base = producing.base_id
        # The id a router matching legs by X-Request-Id knows the request by.
        known_as = base.removeprefix(api_kind(base)) if producing.named_here else base
        return True, prefill_echo(
            base, self.identity(), block_ids, known_as, producing.prompt_len, producing.transfer_id
        )

    def _decline(self, tid: str, params: dict[str, Any]) -> None:
        """Tell the producer nobody here claims `tid`: it frees any KV made for it."""
        self._next.announces.append(_announce(tid, params))
        self._next.aborts.append(tid)

    def _track_prefill_blocks(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            if new.req_id in self._producing:
                self._producing[new.req_id].block_ids = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            producing = self._producing.get(request_id)
            new_blocks = cached.new_block_ids[i]
            if producing is None or new_blocks is None:
                continue
            if request_id in cached.resumed_req_ids:
                producing.block_ids = list(new_blocks[0])
            else:
                producing.block_ids.extend(new_blocks[0])

    def _computed_after(self, out: Any, request_id: str) -> int:
        """How many of the request's tokens have KV once this step has run (prefix-cache
        hits included: vLLM counts them as computed)."""
        scheduled = out.num_scheduled_tokens[request_id]
        for new in out.scheduled_new_reqs:
            if new.req_id == request_id:
                return new.num_computed_tokens + scheduled
        cached = out.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.req_ids.index(request_id)] + scheduled


def _announce(transfer_id: str, params: dict[str, Any]) -> Announce:
    """The producer a (completed) decode leg names: each rank's address, the engine,
    and each rank's boot."""
    return Announce(
        transfer_id,
        tuple(params["remote_addresses"]),
        str(params.get("remote_engine_id") or ""),
        tuple(str(params.get("remote_epoch") or "").split(EPOCH_SEPARATOR)),
    )


def _producer_endpoint(params: dict[str, Any], allowed: tuple[str, ...]) -> str | None:
    """The URL of the endpoint a decode leg names its producer by, if any: an
    http(s) URL of a host `allowed` lets this decode reach. LegError if not."""
    bootstrap = params.get("remote_bootstrap_addr")
    host, port = params.get("remote_host"), params.get("remote_port")
    if bootstrap is not None:
        url = urllib.parse.urlsplit(bootstrap if isinstance(bootstrap, str) else "")
        try:
            where = f"{url.hostname}:{url.port or (443 if url.scheme == 'https' else 80)}"
        except ValueError:
            where = ""
        if url.scheme not in ("http", "https") or not url.hostname or not where:
            raise LegError(
                "bad_bootstrap_addr",
                f"remote_bootstrap_addr must be an http(s) URL, got {str(bootstrap)[:200]!r}",
            )
        endpoint = bootstrap
    elif isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
        where = f"{host}:{port}"
        if not _HOST_PORT.fullmatch(where):
            raise LegError("bad_addresses", f"remote_host {host[:100]!r} is not a host name")
        endpoint = f"http://{where}"
    else:
        return None
    if not producer_allowed(where, allowed):
        raise LegError(
            "producer_not_allowed",
            f"the decode leg names its producer by {where}, which allowed_producers does not list",
        )
    return endpoint


def _named_by_prefill(request_id: str, params: dict[str, Any]) -> str:
    """The transfer id a prefill instance named for the API request this decode leg
    belongs to (SchedulerSide._name_transfer): the same derivation from our own
    request id, as a router giving both legs one X-Request-Id makes them alike; or,
    should the ids differ, from the remote_request_id the router says it used."""
    mine = api_request_id(request_id)
    theirs = params.get("remote_request_id")
    if isinstance(theirs, str) and theirs and not mine.endswith(theirs):
        return api_kind(mine) + theirs
    return mine


def _status(request: Any) -> str:
    return getattr(request.status, "name", str(request.status))


def _decode_leg_problem(
    params: dict[str, Any], mode: str, world: int, allowed: tuple[str, ...]
) -> tuple[str, str] | None:
    """Why a decode leg's kv_transfer_params cannot be served by kvpush, as (a short
    reason for metrics, a message for people), or None. `allowed`: the producers
    this decode may dial (allowed_producers)."""
    missing = [k for k in ("transfer_id", "remote_addresses") if k not in params]
    if missing:
        return "not_kvpush_params", (
            f"kv_transfer_params lack {missing} (keys: {sorted(params)}): the prefill "
            "instance is not running KVPushConnector (an upstream NixlConnector, say), and "
            "a KVPushConnector decode instance cannot pair with it"
        )
    try:
        check_transfer_id(params["transfer_id"] if isinstance(params["transfer_id"], str) else "")
    except ProtocolError as exc:
        return "bad_transfer_id", str(exc)
    theirs = params.get("transfer_mode", "push")
    if theirs != mode:
        return "mode_mismatch", (
            f"transfer mode mismatch: the prefill instance is in {theirs} mode, this one in {mode}"
        )
    addresses = params["remote_addresses"]
    if (
        not isinstance(addresses, list)
        or not addresses
        or not all(isinstance(a, str) and _HOST_PORT.fullmatch(a) for a in addresses)
    ):
        return "bad_addresses", (
            f"remote_addresses must list one side-channel host:port per tensor-parallel "
            f"rank of the prefill instance, got {str(addresses)[:200]}"
        )
    problem = tp_problem(len(addresses), world, 0)
    if problem:
        return "tp_mismatch", problem
    refused = [a for a in addresses if not producer_allowed(a, allowed)]
    if refused:
        return "producer_not_allowed", (
            f"the decode leg names producer {refused[0]}, which allowed_producers does not list"
        )
    return None
