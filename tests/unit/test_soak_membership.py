"""The soak's membership faults against a stand-in router and instances: what a drain
and an add do at the router, what they check, and what their records say."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpush.bench import faults, membership_faults
from kvpush.bench.faults import Fault

QUIET = {"sending": 0, "producing": 0, "receiving": 0}


@dataclass
class StandIn:
    """One instance: its vLLM /metrics (requests it got) and its /kvpush/state."""

    requests: int = 0
    state: dict = field(default_factory=lambda: dict(QUIET))
    keeps_getting: bool = False  # gets a request at every read, drained or not
    url: str = ""
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True

    async def metrics(self, request: web.Request) -> web.Response:
        self.requests += self.keeps_getting
        text = (
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {self.requests}\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 0.0\n'
            'vllm:num_requests_running{model_name="m"} 0.0\n'
            'vllm:num_requests_waiting{model_name="m"} 0.0\n'
        )
        return web.Response(text=text)

    async def kvpush_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state)


class StandInRouter:
    """The router's /instances and /metrics; an added instance gets a request at once
    unless `ignores_added`."""

    def __init__(self, instances: dict[str, StandIn]) -> None:
        self.instances = instances  # url -> the stand-in there
        self.members = {url: "decode" for url in instances}
        self.calls: list[tuple[str, dict]] = []
        self.ignores_added = False
        self.refuses_drain = False
        self.reads = 0
        self.sent = itertools.count()  # the soak's requests sent: one more at each look

    async def list_(self, request: web.Request) -> web.Response:
        self.reads += 1  # idle at first: requests come in flight on the third read
        busy = 3 if self.reads >= 3 else 0
        return web.json_response(
            [
                {"url": u, "role": r, "outstanding": busy, "state": "open"}
                for u, r in self.members.items()
            ]
        )

    async def delete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("DELETE", body))
        if self.refuses_drain:
            return web.json_response({"error": {"message": "the last decode"}}, status=409)
        self.members.pop(body["url"])
        return web.json_response({"url": body["url"], "state": "forgotten", "drained_s": 0.4})

    async def post(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("POST", body))
        self.members[body["url"]] = body["role"]
        if not self.ignores_added:
            self.instances[body["url"]].requests += 1
        return web.json_response({"url": body["url"]}, status=201)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text='kvpush_instance_outcomes_total{instance="x",outcome="failed"} 2\n'
        )


class StandInCluster:
    def __init__(self) -> None:
        self.servers: dict[str, StandIn] = {}
        self.identity_ports: dict[str, int] = {}
        self.started: list[str] = []

    def identity_url(self, name: str) -> str:
        return self.servers[name].url

    def start(self, name: str) -> None:
        self.started.append(name)


async def _run(fault: Fault, setup=None) -> tuple[Fault, StandInCluster, StandInRouter, dict]:
    """Inject `fault` into a fleet of decode0 and decode1 behind a stand-in router
    (`setup(cluster, router)` changes it first); the fault, the fleet, the router, and
    the roles as the soak would see them after."""
    cluster = StandInCluster()
    names = ["decode0", "decode1", "decode2"]  # decode2: what an add starts
    servers = []
    for i, name in enumerate(names):
        standin = cluster.servers[name] = StandIn()
        app = web.Application()
        app.router.add_get("/metrics", standin.metrics)
        app.router.add_get("/kvpush/state", standin.kvpush_state)
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
        standin.url = str(server.make_url("")).rstrip("/")
        cluster.identity_ports[name] = 7900 + i
    router = StandInRouter({cluster.servers[n].url: cluster.servers[n] for n in names})
    del router.members[cluster.servers["decode2"].url]
    app = web.Application()
    app.router.add_get("/instances", router.list_)
    app.router.add_delete("/instances", router.delete)
    app.router.add_post("/instances", router.post)
    app.router.add_get("/metrics", router.metrics)
    async with TestServer(app) as router_server:
        if setup is not None:
            setup(cluster, router)
        roles = {"prefill": ["prefill0"], "decode": ["decode0", "decode1"]}
        configured: list[tuple[str, str]] = []
        injector = membership_faults.Injector(
            cluster, str(router_server.make_url("")).rstrip("/"), roles,
            lambda name, role: configured.append((name, role)), time.monotonic,
            lambda: next(router.sent), settle_s=1.0, drain_limit_s=30.0, health_s=1.0, hold_s=0.2,
        )  # fmt: skip
        await injector.inject(fault)
    for server in servers:
        await server.close()
    router.configured = configured
    return fault, cluster, router, roles


def _drain() -> Fault:
    return Fault(1, "drain-decode", "decode1", 0.0)


def test_a_drain_deletes_the_instance_checks_it_and_adds_it_back():
    fault, cluster, router, roles = asyncio.run(_run(_drain()))
    url = cluster.servers["decode1"].url
    assert [(method, body["url"]) for method, body in router.calls] == [
        ("DELETE", url),
        ("POST", url),
    ]
    assert router.calls[1][1] == {"role": "decode", "url": url, "identity": 7901}
    assert fault.held is True and not fault.skipped and fault.end is not None, fault.note
    assert (
        "drained with 3 in flight" in fault.note
    )  # it waited until some were and "0 new request(s)" in fault.note
    assert "0 of its legs failed" in fault.note  # the failures counted are another instance's
    assert roles["decode"] == ["decode0", "decode1"]
    assert "checks held" in fault.line()


def test_a_drained_instance_that_still_gets_requests_fails_its_checks():
    def keeps_getting(cluster, router):
        cluster.servers["decode1"].keeps_getting = True

    fault, *_ = asyncio.run(_run(_drain(), keeps_getting))
    assert fault.held is False and "0 new request(s)" not in fault.note, fault.note
    assert "CHECKS FAILED" in fault.line()


def test_a_drained_instance_still_holding_blocks_fails_its_checks():
    def holds(cluster, router):
        cluster.servers["decode1"].state = {**QUIET, "receiving": 1}

    fault, *_ = asyncio.run(_run(_drain(), holds))
    assert fault.held is False and "NOT quiet" in fault.note, fault.note


def test_a_drain_the_router_refuses_is_skipped_and_saying_why():
    def refuses(cluster, router):
        router.refuses_drain = True

    fault, _, router, _ = asyncio.run(_run(_drain(), refuses))
    assert fault.skipped and "refused" in fault.note and "the last decode" in fault.note
    assert [method for method, _ in router.calls] == ["DELETE"]  # nothing added back


def test_an_add_starts_a_new_instance_posts_it_and_the_soak_watches_it():
    fault, cluster, router, roles = asyncio.run(_run(Fault(1, "add-decode", "decode2", 0.0)))
    url = cluster.servers["decode2"].url
    assert router.configured == [("decode2", "decode")] and cluster.started == ["decode2"]
    assert router.calls == [("POST", {"role": "decode", "url": url, "identity": 7902})]
    assert roles["decode"] == ["decode0", "decode1", "decode2"]
    assert fault.held is True and "serving after" in fault.note, fault.note


def test_an_added_instance_that_gets_no_request_in_a_health_interval_fails():
    def ignores(cluster, router):
        router.ignores_added = True

    fault, *_ = asyncio.run(_run(Fault(1, "add-decode", "decode2", 0.0), ignores))
    assert fault.held is False and "NOT serving" in fault.note, fault.note


def test_an_added_instance_is_not_blamed_for_no_request_when_none_was_sent():
    def load_over(cluster, router):
        router.ignores_added = True
        router.sent = itertools.repeat(4000)

    fault, *_ = asyncio.run(_run(Fault(1, "add-decode", "decode2", 0.0), load_over))
    assert fault.held is True and "the soak sent no request" in fault.note, fault.note


def test_adds_are_scheduled_on_the_next_new_name_of_their_role():
    prefill, decode = ["prefill0"], ["decode0", "decode1"]
    pick = faults.schedule(("drain-decode", "add-decode", "add-prefill"), prefill, decode, 0)
    assert pick(0) == ("drain-decode", "decode0")
    assert pick(1) == ("add-decode", "decode2")
    decode.append("decode2")  # what the add did
    assert pick(2) == ("add-prefill", "prefill1")
    assert pick(4) == ("add-decode", "decode3")
    assert faults.parse_kinds("drain-prefill,add-decode") == ("drain-prefill", "add-decode")


def test_samples_are_summed_over_the_labels_asked():
    text = (
        '# HELP x\nkvpush_instance_outcomes_total{instance="http://a",outcome="failed"} 2\n'
        'kvpush_instance_outcomes_total{instance="http://a",outcome="ok"} 5\n'
        'kvpush_instance_outcomes_total{instance="http://b",outcome="failed"} 7\n'
        "vllm:num_requests_running 3\n"
    )
    name = "kvpush_instance_outcomes_total"
    assert membership_faults.sample_sum(text, name, instance="http://a", outcome="failed") == 2
    assert membership_faults.sample_sum(text, name, outcome="failed") == 9
    assert membership_faults.sample_sum(text, "vllm:num_requests_running") == 3
    assert membership_faults.sample_sum(text, "vllm:num_requests") == 0
