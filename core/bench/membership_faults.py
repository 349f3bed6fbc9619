"""The soak's membership faults: instances drained and added at the router while
requests are in flight, through `kvpush router`'s `/instances` (docs/router.md).

  drain-prefill, drain-decode   once the instance has requests in flight (at most
                                BUSY_WAIT_S), DELETE it at the router and wait until the
                                router forgets it (its requests in flight finished);
                                then, for HOLD_S, it must get no request and come to
                                hold nothing (`/kvpush/state` all 0); then POST it back:
                                it must serve again within one health interval
  add-prefill, add-decode       start a NEW vLLM instance with KVPushConnector, set up
                                as the others of its role, POST it: it must serve within
                                one health interval; it stays for the rest of the run

Each fault's `held` says whether its checks held, and its note what was seen: the
requests in flight at the DELETE, the legs that failed on the instance while it
drained (the router's `kvpush_instance_outcomes_total`), the requests it got after it
was forgotten, how soon it held nothing, how soon it served once added. An add's
window opens at its POST: starting vLLM troubles no request.

What an instance was sent is read from its own vLLM metrics: requests finished
(`vllm:request_success_total`, every finish reason) plus those running or waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from kvpush.bench.faults import Fault, instance_state
from kvpush.errors import KVPushError
from kvpush.metrics import samples

if TYPE_CHECKING:
    from kvpush.demo.cluster import Cluster

ACTIONS = ("drain", "add")
BUSY_WAIT_S = 10.0  # the longest a drain waits for its instance to have requests in flight
HOLD_S = 10.0  # after the router forgets a drained instance: nothing new may reach it
HEALTH_INTERVAL_S = 5.0  # the router's --health-interval (the soak's router: its default)
POLL_S = 0.2
RECEIVED = ("vllm:request_success_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting")  # fmt: skip
QUIET = {"sending": 0, "producing": 0, "receiving": 0}


def handles(kind: str) -> bool:
    return kind.partition("-")[0] in ACTIONS


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text's samples of metric `name` whose labels include
    `labels`."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(v for said, v in samples(text, name) if all(w in said for w in wanted))


class Injector:
    """Drains and adds instances at the router `router` of a soak's `cluster`, while
    the soak sends requests (`sent()`: how many so far).
    `roles` holds each role's instance names (an added one is appended: the soak
    watches it from then on); `configure(name, role)` sets a new server up in the
    cluster as the others of its role."""

    def __init__(
        self,
        cluster: Cluster,
        router: str,
        roles: dict[str, list[str]],
        configure: Callable[[str, str], Any],
        clock: Callable[[], float],
        sent: Callable[[], int],
        settle_s: float,
        drain_limit_s: float,
        health_s: float = HEALTH_INTERVAL_S,
        hold_s: float = HOLD_S,
    ) -> None:
        self.cluster, self.router, self.roles = cluster, router, roles
        self.configure, self.clock = configure, clock
        self.sent = sent  # how many requests the soak has sent so far
        self.settle_s = settle_s  # the longest a drained instance may take to hold nothing
        self.drain_limit_s = drain_limit_s  # the router forgets a drain this old regardless
        self.health_s, self.hold_s = health_s, hold_s

    async def inject(self, fault: Fault) -> Fault:
        action, _, role = fault.kind.partition("-")
        timeout = aiohttp.ClientTimeout(total=self.drain_limit_s + 60.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                if action == "drain":
                    await self._drain(http, fault, role)
                else:
                    await self._add(http, fault, role)
            except (KVPushError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                fault.held = False
                fault.note = f"{fault.note} failed: {type(exc).__name__}: {exc}".strip()
        return fault

    async def _drain(self, http: aiohttp.ClientSession, fault: Fault, role: str) -> None:
        url = self.cluster.servers[fault.target].url
        in_flight = await self._busy(http, url)
        failed_before = await self._failed_legs(http, url)
        fault.start = self.clock()
        status, answer = await self._call(http, "DELETE", {"url": url})
        if status == 409:  # the last instance of its role taking requests
            fault.end, fault.skipped = self.clock(), True
            fault.note = f"SKIPPED: the router refused the drain: {answer}"
            return
        if status != 200 or answer.get("state") != "forgotten":
            raise KVPushError(f"DELETE /instances answered {status}: {answer}")
        drained_s = float(answer.get("drained_s", 0.0))
        failed = await self._failed_legs(http, url) - failed_before
        forgotten, seen = self.clock(), await self._received(http, url)
        quiet_s = await self._quiet(fault.target, forgotten)
        await asyncio.sleep(max(0.0, forgotten + self.hold_s - self.clock()))
        # Below 0 where a request running at the first read was aborted (an abort is
        # no finished request in vLLM's count): nothing new, as 0 is.
        new = await self._received(http, url) - seen
        still_listed = url in await self._listed(http)
        served, serving = await self._add_and_serve(http, fault.target, role)
        fault.end = self.clock()
        fault.held = (
            drained_s < self.drain_limit_s and not failed and new <= 0 and not still_listed
            and quiet_s is not None and served
        )  # fmt: skip
        fault.note = (
            f"drained with {in_flight} in flight: forgotten after {drained_s:.1f}s, "
            f"{failed:g} of its legs failed meanwhile; then {new:g} new request(s) in "
            f"{self.hold_s:g}s{', STILL LISTED' if still_listed else ''}, "
            f"{_seconds('quiet', quiet_s)}; added back, {serving}"
        )

    async def _add(self, http: aiohttp.ClientSession, fault: Fault, role: str) -> None:
        name = fault.target
        self.configure(name, role)
        started = self.clock()
        try:
            await asyncio.to_thread(self.cluster.start, name)
        except KVPushError:
            self.cluster.servers[name].stop()
            raise
        self.roles[role].append(name)  # the soak watches it from now on
        fault.start = self.clock()  # the window opens when the router is told
        served, serving = await self._add_and_serve(http, name, role)
        fault.end = self.clock()
        fault.held = served
        fault.note = f"new {role} instance up after {fault.start - started:.0f}s; added, {serving}"

    async def _add_and_serve(
        self, http: aiohttp.ClientSession, name: str, role: str
    ) -> tuple[bool, str]:  # fmt: skip
        """POST instance `name` to the router: whether it got a request within one
        health interval, and what was seen. Where the soak sent none meanwhile (its
        load was over) there was nothing to serve, which is no failure."""
        url = self.cluster.servers[name].url
        seen = await self._received(http, url)
        body = {"role": role, "url": url, "identity": self.cluster.identity_ports[name]}
        status, answer = await self._call(http, "POST", body)
        if status != 201:
            raise KVPushError(f"POST /instances answered {status}: {answer}")
        posted, sent = self.clock(), self.sent()
        while self.clock() - posted <= self.health_s:
            if await self._received(http, url) > seen:
                return True, f"serving after {self.clock() - posted:.1f}s"
            await asyncio.sleep(POLL_S)
        if self.sent() == sent:
            return True, f"not seen serving: the soak sent no request in {self.health_s:g}s"
        return False, f"NOT serving {self.health_s:g}s on ({self.sent() - sent} sent meanwhile)"

    async def _quiet(self, name: str, since: float) -> float | None:
        """Seconds from `since` until instance `name` holds nothing, or None if it still
        held something `settle_s` after."""
        while True:
            if await asyncio.to_thread(instance_state, self.cluster, name) == QUIET:
                return self.clock() - since
            if self.clock() - since > self.settle_s:
                return None
            await asyncio.sleep(POLL_S)

    async def _call(
        self, http: aiohttp.ClientSession, method: str, body: dict[str, Any]
    ) -> tuple[int, Any]:  # fmt: skip
        async with http.request(method, self.router + "/instances", json=body) as response:
            text = await response.text()
            try:
                return response.status, await response.json(content_type=None)
            except ValueError:
                return response.status, text[:300]

    async def _busy(self, http: aiohttp.ClientSession, url: str) -> int:
        """Requests in flight on `url` at the router, once there are some (a drain of
        an idle instance proves little), or none after BUSY_WAIT_S."""
        waited = self.clock()
        while True:
            in_flight = (await self._listed(http)).get(url, {}).get("outstanding", 0)
            if in_flight or self.clock() - waited > BUSY_WAIT_S:
                return in_flight
            await asyncio.sleep(POLL_S / 4)

    async def _listed(self, http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        async with http.get(self.router + "/instances") as response:
            return {i["url"]: i for i in await response.json()}

    async def _failed_legs(self, http: aiohttp.ClientSession, url: str) -> float:
        async with http.get(self.router + "/metrics") as response:
            text = await response.text()
        return sample_sum(text, "kvpush_instance_outcomes_total", instance=url, outcome="failed")

    async def _received(self, http: aiohttp.ClientSession, url: str) -> float:
        async with http.get(url + "/metrics") as response:
            text = await response.text()
        return sum(sample_sum(text, name) for name in RECEIVED)


def _seconds(what: str, seconds: float | None) -> str:
    return f"NOT {what}" if seconds is None else f"{what} after {seconds:.1f}s"
