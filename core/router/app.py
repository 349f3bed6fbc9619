"""The router's HTTP application (aiohttp).

Per request: pick a prefill and a decode instance, mint a transfer id, and send both
legs at once (push) or prefill first (pull). The decode leg's answer, streamed or
not, is the client's answer, through the relay chosen for the request (relay.py;
first_token_relay.py where a streaming client's first token comes from the prefill
leg). A failed leg cancels the other and gives the client an OpenAI-style error; a
client that goes away cancels both, which makes vLLM abort them, which makes kvpush
free their blocks. A decode leg that ends before decode took it has prefill let go
of the KV it computed for it (release.py).

The parts that stand alone live beside it: instances.py (pools, pairing), health.py
(the /health probes), startup.py (what it says as it starts), legs.py (what each leg
is sent, and the OpenAI-style errors), request.py (a request's trace and its legs'
failures), sse.py (server-sent events).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.identities import TIMEOUT_S as IDENTITY_TIMEOUT_S
from kvpush.identities import (
    IdentityError,
    InstanceIdentity,
    dp_siblings,
    identity_from_decode_params,
    parse_identity,
)
from kvpush.limits import raise_open_files
from kvpush.metrics import Metrics
from kvpush.router import event_loop, first_token
from kvpush.router.first_token_relay import FirstTokenRelay
from kvpush.router.health import HealthWatch
from kvpush.router.instances import Instance, Pool, check_listing, pairing_problem
from kvpush.router.legs import (
    decode_leg,
    new_transfer_id,
    openai_error,
)
from kvpush.router.membership import Membership
from kvpush.router.policy import RoutingPolicy
from kvpush.router.prefix import PrefixIndex
from kvpush.router.reach import identity_unreachable, not_an_identity
from kvpush.router.relay import DecodeLeg, Relay
from kvpush.router.release import PrefillReleases
from kvpush.router.reports import Reports
from kvpush.router.request import (
    ANSWERED,
    TRACE,
    LegFailed,
    Trace,
    cause,
    describe,
    upstream_message,
)
from kvpush.router.route import Computing, Planner
from kvpush.router.startup import introduction, listening

log = logging.getLogger(__name__)

# vLLM's API server places a request on this data-parallel rank (its engine client).
DP_RANK_HEADER = "X-data-parallel-rank"
# Connections the kernel queues before the router accepts them: a burst of clients
# beyond aiohttp's default of 128 would otherwise wait out SYN retries (uvicorn,
# vLLM's server, queues 2048).
BACKLOG = 2048
IDENTITY_TIMEOUT = aiohttp.ClientTimeout(total=IDENTITY_TIMEOUT_S)


# Client headers both legs carry: credentials for `--api-key` servers, and the id
# that ties the client's request to both servers' logs.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")


@dataclass
class RouterConfig:
    prefill: list[Instance]
    decode: list[Instance]
    mode: str = "push"
    timeout_s: float = 300.0  # a leg that sends nothing for this long has failed
    cooldown_s: float = 10.0  # a failed instance is not picked for this long
    health_interval_s: float = 5.0  # 0: no periodic health checks
    # An idle pooled connection is dropped after this. It must be shorter than the
    # servers' own keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a connection
    # reused just as the server closes it fails the request ("Server disconnected"),
    # and the health checks, every 5 s, kept the pool's connections idle that long.
    keepalive_s: float = 2.0
    # A streaming client's first token comes from the prefill leg (first_token.py).
    first_token: bool = True
    # Whether each request is disaggregated, and where it runs (route.py).
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    instances_file: str | None = None  # read again each health interval (membership.py)

    def __post_init__(self) -> None:
        check_listing(self.prefill, self.decode, self.policy.aggregate_on)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefill = Pool(config.prefill)
        self.decode = Pool(config.decode)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Future | None = None
        self._file_task: asyncio.Future | None = None
        self._draining: set[asyncio.Future] = set()  # decode legs nobody reads
        # The relays, one chosen per request (_relay_for): decode's answer as it comes,
        # or behind the prefill leg's first token.
        relay = (self._http, self.metrics, self.decode, self._eject, self._draining)
        self.plain, self.early = Relay(*relay), FirstTokenRelay(*relay)
        self.releases = PrefillReleases(self._http, self.metrics)  # KV no decode will claim
        self.watch = HealthWatch(self.prefill.instances + self.decode.instances, self.metrics,
                                 self._http)  # fmt: skip
        self.reports = Reports(config.mode, self.prefill, self.decode, self.metrics, self.watch,
                               self._http, _forwarded)  # fmt: skip
        self.traces = self.reports.traces
        self.index = PrefixIndex()
        self.planner = Planner(config.policy, self.prefill, self.decode, self.index, self.metrics)
        pools = {"prefill": self.prefill, "decode": self.decode}
        self.members = Membership(pools, self.watch, self.index, self.metrics, self._try_learning,
                                  hold_s=2 * max(config.health_interval_s, 1.0),
                                  drain_timeout_s=config.timeout_s)  # fmt: skip

    # -- application ------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.reports.models)
        app.router.add_get("/health", self.reports.health)
        app.router.add_get("/metrics", self.reports.prometheus)
        app.router.add_get("/kvpush/trace", self.reports.trace)
        app.router.add_get("/instances", self.members.list_)
        app.router.add_post("/instances", self.members.post)
        app.router.add_delete("/instances", self.members.delete)
        app.router.add_delete("/instances/{url:.+}", self.members.delete)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # Idle, not total: a long stream is fine as long as tokens keep coming.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=10, sock_read=self.config.timeout_s
        )
        self.session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.keepalive_s),
        )
        for instance in self.prefill.instances + self.decode.instances:
            problem = await self._try_learning(instance)
            log.log(*introduction(instance, problem, self.config.mode))
        for prefill in self.prefill.instances:
            for decode in self.decode.instances:
                problem = self._pair_problem(prefill, decode)
                if problem:
                    log.error("kvpush router: %s", problem)

        for instance in self.prefill.instances + self.decode.instances:
            self.members.subscribe(instance)
        if self.config.health_interval_s > 0:
            self._health_task = asyncio.ensure_future(
                self.watch.forever(self.config.health_interval_s)
            )
        if self.config.instances_file:
            path = Path(self.config.instances_file)
            await self.members.reread(path)
            interval = self.config.health_interval_s or 5.0
            self._file_task = asyncio.ensure_future(self._reread_forever(path, interval))

    async def _reread_forever(self, path: Path, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.members.reread(path)

    async def _stop(self, app: web.Application) -> None:
        for task in (self._health_task, self._file_task):
            if task is not None:
                task.cancel()
        await self.members.close()
        await self.releases.close()
        if self.session is not None:
            await self.session.close()

    def _eject(self, instance: Instance) -> None:
        """Out of the pick for a cooldown: a leg failed on it."""
        cooldown_end = time.monotonic() + self.config.cooldown_s
        instance.ejected_until = max(instance.ejected_until, cooldown_end)
        self.metrics.inc("instance_ejections", instance=instance.url, why="leg_failed")

    # -- endpoints --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        endpoint = request.path
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return self._error(endpoint, 400, f"invalid JSON body: {exc}", "invalid_request_error")
        trace = request[TRACE] = Trace()
        headers = _forwarded(request)
        self.metrics.add("router_in_flight", 1)
        try:
            return await self._dispatch_with_retry(request, endpoint, body, headers)
        except LegFailed as exc:
            return self._error(endpoint, exc.status, exc.message, exc.kind)
        finally:
            self.metrics.add("router_in_flight", -1)
            self.metrics.observe("router_request_seconds", time.monotonic() - started)
            trace.mark("done")
            self.reports.record(trace)

    async def _dispatch_with_retry(
        self, request: web.Request, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """One dispatch; if an instance failed it before the client saw a byte, eject it
        and dispatch once more on another instance, with a new transfer id."""
        failed: Instance | None = None
        tokens = await self.planner.tokens(self._http(), endpoint, body, headers)
        for attempt in range(2):
            for instance in self.decode.instances:
                if not instance.ranks and (problem := await self._try_learning(instance)):
                    log.warning("kvpush router: %s", problem)
            route = self.planner.plan(tokens, failed, self._pairs)
            request[TRACE].route = route.as_dict()
            legs = [i for i in (route.prefill, route.decode) if i is not None]
            if route.prefill is not None:
                self._refuse_unpairable(route.prefill, route.decode)
            for instance in legs:
                instance.outstanding += 1
            computing = Computing(route.computer, route.computing)
            request[TRACE].at("prefill_answered" if route.prefill else "first_byte",
                              computing.answered)  # fmt: skip
            try:
                if route.prefill is None:  # the client's request, as a plain instance gets it
                    request[TRACE].mark("decode_sent")
                    posted = self._http().post(route.decode.url + endpoint, json=body,
                                               headers=headers)  # fmt: skip
                    response = await self.plain.stream(request, route.decode, endpoint, body,
                                                       asyncio.ensure_future(posted))  # fmt: skip
                else:
                    response = await self._dispatch(
                        request, endpoint, body, route.prefill, route.decode, headers
                    )
                self.planner.sent(route)
                for instance in legs:
                    self.metrics.inc("instance_outcomes", instance=instance.url, outcome="ok")
                return response
            except LegFailed as exc:
                if exc.instance is None:
                    raise
                self.metrics.inc("instance_outcomes", instance=exc.instance.url, outcome="failed")
                if not exc.retryable:
                    raise
                self._eject(exc.instance)
                elsewhere = self.planner.has_other(exc.instance, route)
                if attempt or request.get(ANSWERED) or not elsewhere:
                    raise
                failed = exc.instance
                self.metrics.inc("retries", role=exc.instance.role)
                log.warning("kvpush router: retrying on another instance: %s", exc.message)
            finally:
                computing.done()
                for instance in legs:
                    instance.outstanding -= 1
        raise AssertionError("unreachable")

    def _pairs(self, prefill: Instance, decode: Instance) -> bool:
        return self._pair_problem(prefill, decode) is None

    async def _dispatch(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        prefill: Instance,
        decode: Instance,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        transfer_id = new_transfer_id()
        trace: Trace = request[TRACE]
        trace.transfer_id = transfer_id
        relay = self._relay_for(body, prefill, decode)
        body, trace.seed = relay.seeded(body)
        # Only push needs the identity up front; pull learns it from the prefill answer.
        if self.config.mode == "push" and not prefill.ranks and prefill.identity_url:
            try:
                await self._learn_identity(prefill)
            except LegFailed as exc:
                log.warning(
                    "kvpush router: %s; so this request runs its legs one after the other: "
                    "the prefill leg runs before decode is sent (no overlap, the first token "
                    "later), and its answer names the instance for the next",
                    exc.message,
                )
            self._refuse_unpairable(prefill, decode)
        if self.config.mode == "pull" or not prefill.ranks:
            # Pull, or a producer we have not met yet: prefill first, learn who it is.
            trace.mark("prefill_sent")
            leg = relay.prefill_leg(body, transfer_id)
            answer = await self._post_json(prefill, endpoint, leg, headers)
            trace.mark("prefill_answered")
            echo = identity_from_decode_params(answer.get("kv_transfer_params") or {})
            if echo is None:
                raise LegFailed(
                    502,
                    f"prefill instance {prefill.url} answered without a kvpush identity: is "
                    "it running KVPushConnector? (an upstream NixlConnector cannot pair)",
                )
            prefill.learn(echo)
            self._refuse_unpairable(prefill, decode)
            leg = decode_leg(body, transfer_id, echo)
            answered: asyncio.Future = asyncio.get_running_loop().create_future()
            answered.set_result(answer)
            return await self._decode_relay(
                relay, request, prefill, decode, endpoint, leg, headers, answered, body
            )
        return await self._both_at_once(
            relay, request, endpoint, body, transfer_id, prefill, decode, headers
        )

    async def _both_at_once(
        self,
        relay: Relay,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        transfer_id: str,
        prefill: Instance,
        decode: Instance,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        rank, identity = prefill.pick_rank()
        prefill_leg_body = relay.prefill_leg(body, transfer_id)
        decode_leg_body = decode_leg(body, transfer_id, identity)
        # Data parallel: the decode leg names one DP rank's engine, so the prefill leg
        # must run on that rank, not wherever vLLM's own balancing would put it.
        prefill_headers = headers if rank is None else {**headers, DP_RANK_HEADER: str(rank)}
        trace: Trace = request[TRACE]
        trace.mark("prefill_sent")
        prefill_task = asyncio.ensure_future(
            self._post_json(prefill, endpoint, prefill_leg_body, prefill_headers)
        )
        prefill_task.add_done_callback(lambda _: trace.mark("prefill_answered"))
        prefill.pending.add(prefill_task)  # a drain waits for it (membership.py)
        prefill_task.add_done_callback(prefill.pending.discard)
        answer = self._decode_relay(
            relay, request, prefill, decode, endpoint, decode_leg_body, headers, prefill_task, body
        )
        relaying = asyncio.ensure_future(answer)
        try:
            both = {prefill_task, relaying}
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.exception() is not None:
                raise prefill_task.exception()  # the handler below cancels the decode leg
            response = await relaying
        except BaseException:
            for task in (prefill_task, relaying):
                task.cancel()  # closing a leg's connection makes vLLM abort it
            raise
        # The decode leg succeeded: let the prefill leg finish on its own.
        prefill_task.add_done_callback(lambda task: self._prefill_done(prefill, identity, task))
        return response

    def _relay_for(self, body: dict[str, Any], prefill: Instance, decode: Instance) -> Relay:
        """This request's relay: its first token from the prefill leg where it can
        be; a streamed one that cannot is counted by why."""
        if not self.config.first_token:
            return self.plain
        rewinds = [i.seeds_rewind for i in (prefill.any_identity(), decode.any_identity()) if i]
        why = first_token.not_served(body, seeds_rewind=bool(rewinds) and all(rewinds))
        if why is not None and why != "not_streamed":
            self.metrics.inc("first_token_from_decode", why=why)
        return self.plain if why is not None else self.early

    async def _decode_relay(
        self,
        relay: Relay,
        request: web.Request,
        prefill: Instance,
        decode: Instance,
        endpoint: str,
        leg: dict[str, Any],
        headers: dict[str, str],
        prefill_answer: asyncio.Future,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        """The decode leg, sent, and its answer through `relay`. A decode leg that
        ends before decode took it has prefill let go of the KV (release.py)."""
        leg = relay.decode_leg(leg)
        request[TRACE].mark("decode_sent")
        posted = asyncio.ensure_future(
            self._http().post(decode.url + endpoint, json=leg, headers=headers)
        )
        self.releases.watch(posted, prefill, prefill_answer)
        return await relay.relay(
            DecodeLeg(request, decode, endpoint, leg, headers, posted, prefill_answer, body)
        )

    def _prefill_done(
        self, prefill: Instance, named: InstanceIdentity, task: asyncio.Future
    ) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        echo = identity_from_decode_params(task.result().get("kv_transfer_params") or {})
        if echo and echo.epoch != named.epoch:
            log.info("kvpush router: %s restarted (new epoch); relearning", prefill.url)
            prefill.forget()
            prefill.learn(echo)
            self.metrics.inc("identity_relearned")

    async def _post_json(
        self, instance: Instance, endpoint: str, leg: dict[str, Any], headers: dict[str, str]
    ) -> dict:
        try:
            async with self._http().post(
                instance.url + endpoint, json=leg, headers=headers
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    self.metrics.inc("leg_failures", leg=instance.role, why=str(response.status))
                    message = upstream_message(instance, text)
                    raise LegFailed(response.status, message, instance=instance)
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.metrics.inc("leg_failures", leg=instance.role, why=cause(exc))
            instance.forget()  # it may come back as a new incarnation: ask again
            message = f"{instance.role} instance {instance.url} failed: {describe(exc)}"
            raise LegFailed(502, message, instance=instance) from exc

    # -- helpers ----------------------------------------------------------------------

    async def _try_learning(self, instance: Instance) -> str | None:
        """Learn an instance's identity if it names an endpoint, or say why it could
        not; one that does not answer yet is asked again when a request needs it, at
        most once a cooldown (not on every request while it is down)."""
        now = time.monotonic()
        if instance.identity_url and now >= instance.identity_asked + self.config.cooldown_s:
            instance.identity_asked = now
            try:
                await self._learn_identity(instance)
            except LegFailed as exc:
                return exc.message
        return None

    def _pair_problem(self, prefill: Instance, decode: Instance) -> str | None:
        mine, theirs = prefill.any_identity(), decode.any_identity()
        if mine is None or theirs is None:
            return None  # the handshake is left to check
        problem = pairing_problem(mine, theirs)
        return problem and f"prefill {prefill.url} and decode {decode.url} cannot pair: {problem}"

    def _refuse_unpairable(self, prefill: Instance, decode: Instance) -> None:
        """A pair whose KV cannot cross is refused before either does any work, with
        the reason: the client can act on it, a 500 from the handshake it cannot."""
        problem = self._pair_problem(prefill, decode)
        if problem:
            self.metrics.inc("pairing_refusals")
            raise LegFailed(502, problem, "pairing_error")

    async def _learn_identity(self, instance: Instance) -> None:
        """Ask the prefill instance's identity endpoint who it is. With data parallel
        DP rank d answers at the endpoint's port + d (engine `<base>_dp<d>`): learn
        each rank, up to the first port that is not one."""
        assert instance.identity_url is not None
        first = await self._fetch_identity(instance, instance.identity_url)
        base = instance.identity_url.removesuffix("/query")
        others = await asyncio.to_thread(dp_siblings, base, first)  # rare: off the loop
        instance.forget()
        for identity in [first, *others]:
            instance.learn(identity)

    async def _fetch_identity(self, instance: Instance, url: str) -> InstanceIdentity:
        try:
            # Bounded on its own: a port that never answers must not hold a request
            # for the legs' idle timeout.
            async with self._http().get(url, timeout=IDENTITY_TIMEOUT) as response:
                answer = await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            why = identity_unreachable(instance.role, instance.url, url, exc, IDENTITY_TIMEOUT_S)
            raise LegFailed(502, why) from exc
        try:
            identity = parse_identity(answer, f"{url}'s answer")
        except IdentityError as exc:
            why = not_an_identity(instance.role, instance.url, answer, exc)
            raise LegFailed(502, why) from None
        if identity.transfer_mode != self.config.mode:
            log.warning(
                "kvpush router: %s is in %s mode, the router in %s mode",
                instance.url, identity.transfer_mode, self.config.mode,
            )  # fmt: skip
        return identity

    def _http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router is not started"
        return self.session

    def _error(self, endpoint: str, status: int, message: str, kind: str) -> web.Response:
        self.metrics.inc("requests", endpoint=endpoint, status=str(status))
        return web.json_response(openai_error(message, kind, status), status=status)


def _forwarded(request: web.Request) -> dict[str, str]:
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}


def run(config: RouterConfig, host: str, port: int, loop: str = "auto") -> None:
    """Serve until interrupted."""
    raise_open_files()
    here = listening(host, port, config.mode, len(config.prefill), len(config.decode))
    # handler_cancellation: a client that goes away cancels its handler, which closes
    # both legs' connections, which makes vLLM abort them (streaming or not).
    web.run_app(
        Router(config).app(),
        host=host,
        port=port,
        print=lambda _: log.info(here),  # called once every socket listens
        backlog=BACKLOG,
        handle_signals=True,
        handler_cancellation=True,
        loop=event_loop(loop),
    )
