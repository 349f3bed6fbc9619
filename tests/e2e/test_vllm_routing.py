"""The router's decisions, placement and runtime membership, in front of real vLLM
CPU engines: the session's prefill and decode, and a second decode (started once
for this module) that publishes vLLM's KV-cache events over ZMQ. Every answer is
checked against the plain instance's, and every instance left holding nothing."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from urllib.parse import quote

import pytest
from conftest import DECODE_TIMERS, MODEL_NAME, Client, prompt

from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

# The rule's threshold, scaled to the tiny model's 2,048-token context.
AUTO = ("--disaggregate", "auto", "--min-uncached-tokens", "256", "--no-alone-when-idle")


@pytest.fixture(scope="module")
def decode2(cluster):
    """A second decode instance, publishing its KV-cache events: its router spec."""
    events = free_port()
    cluster.add_server("decode2", "kv_both", core=1, policy="recompute", **DECODE_TIMERS)
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events}"}  # fmt: skip
    cluster.servers["decode2"].spec.extra_args = ["--kv-events-config", json.dumps(config)]
    cluster.start("decode2")
    try:
        yield f"{cluster.router_spec('decode2')},kv_events=tcp://127.0.0.1:{events}"
    finally:
        cluster.servers.pop("decode2").stop()


def _route(client: Client, router: str) -> dict:
    return client.http.get(router + "/kvpush/trace?last=1").json()[-1]["route"]


def _nothing_held(client: Client, cluster, names: list[str]) -> None:
    for name in names:
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_each_decision_path_answers_as_a_plain_instance(cluster, client, single):
    router = cluster.start_router(["prefill"], ["decode"], name="decide", flags=AUTO)
    try:
        short = prompt(100, 4100)
        assert client.tokens(router, short) == client.tokens(single, short)
        assert _route(client, router)["reason"] == "short"

        long = prompt(600, 4200)
        assert client.tokens(router, long) == client.tokens(single, long)
        route = _route(client, router)
        assert (route["path"], route["reason"]) == ("disaggregated", "long_uncached")

        turn = long + prompt(40, 4300)  # decode holds `long` now: no prefill leg
        assert client.tokens(router, turn) == client.tokens(single, turn)
        route = _route(client, router)
        assert (route["reason"], route["cached_on_decode"] >= 512) == ("cached_on_decode", True)

        # A prompt in words is counted by decode's /tokenize.
        body = {"model": MODEL_NAME, "prompt": "hello " * 20, "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        response = client.http.post(router + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert _route(client, router)["prompt_tokens"] > 0

        for reason in ("short", "long_uncached", "cached_on_decode"):
            assert client.metric(router, "kvpush_router_decisions_total", f'reason="{reason}"')
        _nothing_held(client, cluster, ["prefill", "decode"])
    finally:
        cluster.stop_router("decide")


def test_a_burst_of_long_prompts_runs_on_decode_where_prefill_is_behind(cluster, client, single):
    """Four long prompts at once: the first is disaggregated; the next finds prefill
    its whole prompt behind decode and runs on decode alone (`prefill_busier`), so
    the burst does not queue on the one prefill instance."""
    flags = (*AUTO, "--prefill-busier-tokens", "256")
    router = cluster.start_router(["prefill"], ["decode"], name="busier", flags=flags)
    try:
        prompts = [prompt(600, 4400 + i) for i in range(4)]
        plain = [client.tokens(single, p) for p in prompts]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: client.tokens(router, p), prompts))
        assert answers == plain
        routes = [t["route"] for t in client.http.get(router + "/kvpush/trace?last=4").json()]
        reasons = sorted(r["reason"] for r in routes)
        assert "long_uncached" in reasons and "prefill_busier" in reasons, reasons
        for route in routes:
            if route["reason"] == "prefill_busier":
                assert (route["path"], route["prefill"]) == ("decode_alone", None), route
        assert client.metric(router, "kvpush_router_decisions_total", 'reason="prefill_busier"')
        _nothing_held(client, cluster, ["prefill", "decode"])
    finally:
        cluster.stop_router("busier")


def test_a_sessions_turns_go_to_the_decode_holding_its_prefix(cluster, client, single, decode2):
    router = cluster.start_router(
        ["prefill"], ["decode", decode2], name="sessions", flags=(*AUTO, "--placement", "prefix")
    )
    try:
        sessions = {seed: prompt(300, seed) for seed in (4400, 4500, 4600)}
        where: dict[int, set[str]] = {seed: set() for seed in sessions}
        for turn in range(3):
            for seed, history in sessions.items():
                if turn:
                    history += prompt(30, seed + turn)
                assert client.tokens(router, history) == client.tokens(single, history)
                if turn:
                    where[seed].add(_route(client, router)["decode"])
        assert all(len(decodes) == 1 for decodes in where.values()), where
        # decode2's index came from its vLLM's own events.
        assert client.metric(router, "kvpush_kv_events_total") > 0
        _nothing_held(client, cluster, ["prefill", "decode", "decode2"])
    finally:
        cluster.stop_router("sessions")


def test_with_aggregate_on_prefill_the_prefill_instance_serves_whole_requests_and_sessions(
    cluster, client, single
):
    """Two sessions of short turns, one after the other: the first goes to the prefill
    instance (equal scores go round robin, prefill's first), the second to decode, and
    each next turn to where its prefix is, the prefill instance's learnt from the
    whole requests it ran."""
    flags = ("--disaggregate", "auto", "--min-uncached-tokens", "1024", "--placement",
             "prefix", "--aggregate-on", "prefill,decode")  # fmt: skip
    router = cluster.start_router(["prefill"], ["decode"], name="whole", flags=flags)
    try:
        sessions = {seed: prompt(300, seed) for seed in (4800, 4900)}
        where: dict[int, set[tuple[str, str]]] = {seed: set() for seed in sessions}
        for turn in range(3):
            for seed, history in sessions.items():
                if turn:
                    history += prompt(40, seed + turn)
                assert client.tokens(router, history) == client.tokens(single, history)
                route = _route(client, router)
                assert route["path"] == "decode_alone", route
                where[seed].add((route["decode"], route["decode_role"]))
        assert all(len(places) == 1 for places in where.values()), where
        assert {role for places in where.values() for _, role in places} == {"prefill", "decode"}
        assert client.metric(router, "kvpush_router_whole_requests_total", 'role="prefill"') == 3
        _nothing_held(client, cluster, ["prefill", "decode"])
    finally:
        cluster.stop_router("whole")


def test_an_added_decode_is_used_and_a_drained_one_finishes_its_load(
    cluster, client, single, decode2
):
    router = cluster.start_router(["prefill"], ["decode"], name="members",
                                  flags=("--health-interval", "1"))  # fmt: skip
    try:
        url, _, identity = decode2.partition(",")
        added = {"role": "decode", "url": url, "identity": identity.split("=")[1].split(",")[0],
                 "device": "core-1"}  # fmt: skip
        response = client.http.post(router + "/instances", json=added)
        assert response.status_code == 201, response.text

        prompts = [prompt(200 + 20 * i, 4700 + i) for i in range(12)]
        expected = [client.tokens(single, p, max_tokens=24) for p in prompts]
        gone = cluster.servers["decode"].url
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            answers = [pool.submit(client.tokens, router, p, 24) for p in prompts]
            time.sleep(0.5)  # requests in flight on both decodes
            drained = client.http.delete(router + "/instances/" + quote(gone, safe=""))
            got = [a.result() for a in answers]
        assert drained.status_code == 200 and drained.json()["state"] == "forgotten"
        assert got == expected  # nothing failed
        listed = {i["url"]: i for i in client.http.get(router + "/instances").json()}
        assert gone not in listed and listed[url]["device"] == "core-1"
        used = client.metric(router, "kvpush_instance_outcomes_total", f'instance="{url}"')
        assert used > 0, "the added decode took no request"
        before = client.metric(router, "kvpush_instance_outcomes_total", f'instance="{gone}"')
        assert client.tokens(router, prompts[0], 24) == expected[0]
        after = client.metric(router, "kvpush_instance_outcomes_total", f'instance="{gone}"')
        assert after == before  # forgotten: no more requests
        _nothing_held(client, cluster, ["prefill", "decode", "decode2"])
    finally:
        cluster.stop_router("members")
