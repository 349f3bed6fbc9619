"""The router's decisions and its instances at runtime, over real HTTP in front of
small OpenAI-shaped servers (test_router_app.Fake): which leg each server gets, what
/metrics counts, and that a drained instance is left with nothing in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from test_router_app import Fake, _close, _serve, decode_ok, prefill_ok, run, sleeping

from kvpush.router.decide import DecisionRule
from kvpush.router.policy import RoutingPolicy

LONG = list(range(3000))


def auto(**rule: Any) -> RoutingPolicy:
    return RoutingPolicy(DecisionRule("auto", **rule), placement="prefix")


async def _post(http: aiohttp.ClientSession, url: str, prompt: Any) -> int:
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": prompt}) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_each_decision_path_sends_the_legs_it_says_and_is_counted_by_reason(mode):
    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(decode_ok)
        policy = auto(alone_when_idle=False)
        _router, runner, url = await _serve([prefill], [decode], policy=policy, mode=mode)
        async with aiohttp.ClientSession() as http:
            assert await _post(http, url, list(range(100))) == 200  # short
            assert not prefill.bodies
            assert "kv_transfer_params" not in decode.bodies[-1]  # a plain request
            assert await _post(http, url, LONG) == 200  # long, nothing cached
            assert prefill.bodies[-1]["kv_transfer_params"]["do_remote_decode"]
            assert decode.bodies[-1]["kv_transfer_params"]["do_remote_prefill"]
            sent = time.time()
            assert await _post(http, url, LONG + [5] * 100) == 200  # decode holds LONG
            assert len(prefill.bodies) == 1
            async with http.get(url + "/kvpush/trace?last=1") as r:
                [last] = await r.json()
            assert sent <= last["received_unix"] <= time.time()  # when, to line up with logs
            assert last["route"]["reason"] == "cached_on_decode"
            assert last["route"]["cached_on_decode"] == 2992
            async with http.get(url + "/metrics") as r:
                text = await r.text()
        for reason, path in (("short", "decode_alone"), ("long_uncached", "disaggregated"),
                             ("cached_on_decode", "decode_alone")):  # fmt: skip
            assert f'kvpush_router_decisions_total{{path="{path}",reason="{reason}"}} 1' in text
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_prompt_that_cannot_be_counted_is_disaggregated_and_the_failure_counted():
    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(decode_ok)  # no /tokenize on these
        router, runner, url = await _serve([prefill], [decode], policy=auto())
        async with aiohttp.ClientSession() as http:
            assert await _post(http, url, "a prompt in words") == 200
        assert len(prefill.bodies) == 1
        assert router.metrics.counter("router_decisions", path="disaggregated",
                                      reason="untokenized") == 1  # fmt: skip
        assert router.metrics.counter("tokenize_failures") == 1
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_sessions_turns_land_on_the_decode_that_holds_its_prefix():
    async def scenario():
        decodes = [Fake(decode_ok), Fake(decode_ok)]
        prefill = Fake(prefill_ok)
        _router, runner, url = await _serve([prefill], decodes, policy=auto())
        sessions = {s: [s] * 2100 for s in (1, 2)}
        async with aiohttp.ClientSession() as http:
            for turn in range(4):
                for s, history in sessions.items():
                    history += [s + 10 * turn] * 50
                    assert await _post(http, url, history) == 200
        by_decode = [{b["prompt"][0] for b in d.bodies} for d in decodes]
        assert sorted(map(sorted, by_decode)) == [[1], [2]], by_decode
        await _close(runner, [prefill, *decodes])

    run(scenario())


def test_an_added_instance_takes_the_next_requests_and_a_drained_one_ends_with_none_held():
    async def scenario():
        prefill, first, added = Fake(prefill_ok), Fake(sleeping(0.5)), Fake(decode_ok)
        await added.start()
        router, runner, url = await _serve([prefill], [first])
        async with aiohttp.ClientSession() as http:
            async with http.post(
                url + "/instances", json={"role": "decode", "url": added.url, "device": "gpu1"}
            ) as r:
                assert r.status == 201 and (await r.json())["healthy"]
            assert router.decode.find(added.url).device == "gpu1"
            # Under load: requests in flight on `first` while it drains.
            load = [asyncio.ensure_future(_post(http, url, "p")) for _ in range(6)]
            await asyncio.sleep(0.2)
            assert added.bodies, "the added instance took none of the next requests"
            busy = router.decode.find(first.url)
            assert busy is not None and busy.outstanding
            async with http.delete(url + "/instances/" + quote(first.url, safe="")) as r:
                assert r.status == 200 and (await r.json())["state"] == "forgotten"
            assert busy.outstanding == 0 and not busy.pending
            assert [i.url for i in router.decode.instances] == [added.url]
            assert [i.url for i in router.watch.instances] == [prefill.url, added.url]
            assert set(await asyncio.gather(*load)) == {200}
            taken = len(first.bodies)
            assert {await _post(http, url, "p") for _ in range(3)} == {200}
            assert len(first.bodies) == taken  # forgotten: no more requests
            async with http.delete(url + "/instances", json={"url": added.url}) as r:
                assert r.status == 409 and "last decode" in (await r.json())["error"]["message"]
            async with http.delete(url + "/instances", json={"url": "http://nowhere:1"}) as r:
                assert r.status == 404
            async with http.post(url + "/instances", json={"role": "router", "url": "x"}) as r:
                assert r.status == 400 and "role" in (await r.json())["error"]["message"]
            async with http.post(
                url + "/instances", json={"role": "decode", "url": added.url}
            ) as r:
                assert r.status == 409
        assert router.metrics.counter("membership_changes", change="drained", role="decode") == 1
        await _close(runner, [prefill, first, added])

    run(scenario())


def test_an_instances_file_adds_what_it_names_and_drains_what_it_drops(tmp_path):
    async def scenario():
        prefill, decode, extra = Fake(prefill_ok), Fake(decode_ok), Fake(decode_ok)
        await extra.start()
        listing = tmp_path / "instances"
        listing.write_text(f"# one more decode\ndecode {extra.url}\n")
        router, runner, _url = await _serve([prefill], [decode], health_interval_s=0.2,
                                           instances_file=str(listing))  # fmt: skip
        assert router.decode.find(extra.url) is not None
        listing.write_text("\n")
        for _ in range(50):
            await asyncio.sleep(0.1)
            if router.decode.find(extra.url) is None:
                break
        assert router.decode.find(extra.url) is None
        listing.write_text("decode not-a-url\n")
        await asyncio.sleep(0.5)
        assert router.metrics.counter("instances_file_errors") >= 1
        await _close(runner, [prefill, decode, extra])

    run(scenario())


async def either(request: Any, body: dict) -> Any:
    """A prefill instance: a prefill leg's answer, or a whole request's."""
    return await (prefill_ok if "kv_transfer_params" in body else decode_ok)(request, body)


def test_with_aggregate_on_prefill_a_prefill_instance_serves_whole_requests_and_sessions():
    async def scenario():
        prefill, decode = Fake(either), Fake(decode_ok)
        policy = RoutingPolicy(DecisionRule("auto", alone_when_idle=False), placement="prefix",
                               aggregate_on=("prefill", "decode"))  # fmt: skip
        _router, runner, url = await _serve([prefill], [decode], policy=policy)
        sessions = {s: [s] * 300 for s in (1, 2)}
        async with aiohttp.ClientSession() as http:
            for turn in range(3):
                for s, history in sessions.items():
                    history += [s + 10 * turn] * 40
                    assert await _post(http, url, history) == 200
            assert await _post(http, url, LONG) == 200  # long and uncached: a pair
            async with http.get(url + "/metrics") as r:
                text = await r.text()
        whole = [b for b in prefill.bodies if "kv_transfer_params" not in b]
        # Each session's turns all ran on one instance, one session on each.
        held = [{b["prompt"][0] for b in bodies} for bodies in (whole, decode.bodies[:-1])]
        assert sorted(map(sorted, held)) == [[1], [2]], held
        assert prefill.bodies[-1]["kv_transfer_params"]["do_remote_decode"]
        assert decode.bodies[-1]["kv_transfer_params"]["do_remote_prefill"]
        for role in ("prefill", "decode"):
            assert f'kvpush_router_whole_requests_total{{role="{role}"}} 3' in text
        await _close(runner, [prefill, decode])

    run(scenario())


@pytest.mark.parametrize("pace", [True, False])
def test_whole_requests_go_to_the_decode_that_answers_faster_once_its_pace_is_learnt(pace):
    """Two decodes alike in all the router counts, but one takes 6x as long to its
    first byte: with pace, once each has been charged enough tokens, every request
    goes to the fast one; without, they alternate."""

    async def scenario():
        slow, fast = Fake(sleeping(0.12)), Fake(sleeping(0.02))
        policy = RoutingPolicy(DecisionRule("never"), placement="prefix", pace=pace)
        _router, runner, url = await _serve([Fake(prefill_ok)], [slow, fast], policy=policy)
        async with aiohttp.ClientSession() as http:
            for i in range(16):  # 1,500 tokens each, none sharing a block with another
                assert await _post(http, url, [i] * 1500) == 200
            async with http.get(url + "/instances") as r:
                listed = {i["url"]: i["seconds_per_token"] for i in await r.json()}
        await _close(runner, [slow, fast])
        return len(slow.bodies), len(fast.bodies), listed[slow.url], listed[fast.url]

    on_slow, on_fast, slow_pace, fast_pace = run(scenario())
    assert slow_pace > 3 * fast_pace > 0  # learnt with --pace or without
    if pace:  # 4 each to learn both (4,096 tokens), then the fast one only
        assert on_slow <= 5 and on_fast >= 11
    else:
        assert (on_slow, on_fast) == (8, 8)
