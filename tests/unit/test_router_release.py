"""The router hands prefill's release token back when a decode leg never reached decode.

Real HTTP on loopback, the router in front of small vLLM-shaped servers (as in
test_router_app), and a prefill identity endpoint that records the releases it is
sent. Prefill's answer carries a release token; whenever the decode leg ends before
decode's engine could take it (decode refused it, could not be reached, or the client
left before decode answered), the router posts the token to prefill's identity
endpoint, and in no case does the client see the token.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from test_router_app import ECHO, Fake, _close, decode_ok, run, sleeping, streaming
from test_router_first_token import BODY, decode_fake, decode_stream, prefill_answer

from kvpush.ports import free_port
from kvpush.router.app import Router, RouterConfig
from kvpush.router.instances import Instance
from kvpush.router.release import release_url

UNROUTABLE = "203.0.113.9"  # TEST-NET-3: an echo's host the router must not need


class PrefillEndpoint:
    """A prefill instance's identity endpoint: GET /query, and POST /kvpush/release
    answered with `status`, each body kept."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.releases: list[dict] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> PrefillEndpoint:
        app = web.Application()
        identity = {"kvpush": True, "engine_id": "e", "epoch": "x", "transfer_mode": "push",
                    "addresses": ["127.0.0.1:1"], "tp_size": 1}  # fmt: skip
        app.router.add_get("/query", _answering(identity))
        app.router.add_post("/kvpush/release", self._release)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def _release(self, request: web.Request) -> web.Response:
        self.releases.append(await request.json())
        return web.json_response({"reason": "test"}, status=self.status)

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def _answering(answer: dict):
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(answer)

    return handle


def with_token(answer, endpoint: PrefillEndpoint, known: bool = True, token: bool = True):
    """A prefill answer whose echo names `endpoint`, unless the router was given it
    (`known`: the echo then names a host and port the router must not need, as one
    behind a NAT would) and, if `token`, carries a release token for its transfer."""
    host, port = (UNROUTABLE, free_port()) if known else ("127.0.0.1", endpoint.port)

    async def answered(request: web.Request, body: dict) -> web.Response:
        reply = json.loads((await answer(request, body)).body)
        params = reply["kv_transfer_params"]
        params.update(remote_host=host, remote_port=port)
        if token:
            params["release_token"] = f"token-{params['transfer_id']}"
        return web.json_response(reply)

    return answered


async def plain_prefill(request: web.Request, body: dict) -> web.Response:
    params = {**ECHO, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})


def refusing(status: int, after: float = 0.0):
    """vLLM's API refusing the decode leg before any stream, as decode does a
    max_tokens beyond its max_model_len that prefill's one-token leg passed; `after`
    prefill has answered (a leg still running when decode fails is cancelled: vLLM
    aborts it, and kvpush frees its KV without a token)."""

    async def answer(request: web.Request, body: dict) -> web.Response:
        await asyncio.sleep(after)
        message = "max_tokens=1000000 cannot be greater than max_model_len=2048"
        return web.json_response({"error": {"message": message, "code": status}}, status=status)

    return answer


async def _router(prefill: Fake, decode_url: str, endpoint: PrefillEndpoint, known: bool, **config):
    """The router; `known`: it was told prefill's identity endpoint (both legs at
    once from the first request), else it learns prefill from its first answer."""
    identity = f"http://127.0.0.1:{endpoint.port}/query" if known else None
    pools = [Instance(prefill.url, "prefill", identity)], [Instance(decode_url, "decode")]
    router = Router(RouterConfig(*pools, health_interval_s=0, **config))
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return router, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _released(endpoint: PrefillEndpoint, count: int = 1) -> list[dict]:
    for _ in range(100):
        if len(endpoint.releases) >= count:
            break
        await asyncio.sleep(0.02)
    return endpoint.releases


async def _counted(router: Router, outcome: str) -> float:
    """The router's count of releases that ended so, once it has one (or 1 s passed)."""
    for _ in range(50):
        if router.metrics.counter("prefill_releases"):
            break
        await asyncio.sleep(0.02)
    return router.metrics.counter("prefill_releases", outcome=outcome)


async def _ask(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions",
                                                          json=body) as response:  # fmt: skip
        return response.status, await response.text()


PATHS = {
    # The first-token path: prefill's leg asks for one token, decode's for all.
    "first_token": (lambda: prefill_answer(), {**BODY, "max_tokens": 10**6}),
    "stream": (lambda: plain_prefill, {"model": "m", "prompt": "p", "stream": True}),
    "whole": (lambda: plain_prefill, {"model": "m", "prompt": "p", "max_tokens": 10**6}),
}


@pytest.mark.parametrize("known", [True, False], ids=["both_at_once", "prefill_first"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("status", [400, 503])
def test_a_decode_leg_refused_before_its_stream_has_prefill_release_its_kv(status, path, known):
    """Decode's API refuses the leg (400: a max_tokens beyond its max_model_len, which
    prefill's one-token leg passed; 503: an engine that is down): decode's engine
    never took it, so no decode will claim the KV prefill holds for it."""

    async def scenario():
        endpoint = await PrefillEndpoint().start()
        answer, body = PATHS[path]
        prefill = Fake(with_token(answer(), endpoint, known))
        decode = decode_fake(refusing(status, 0.0 if path == "first_token" else 0.2))
        await prefill.start(), await decode.start()
        router, runner, url = await _router(prefill, decode.url, endpoint, known)
        _, text = await _ask(url, body)
        assert "max_model_len" in text and "release_token" not in text and "token-" not in text
        transfer_id = prefill.bodies[0]["kv_transfer_params"]["transfer_id"]
        assert await _released(endpoint) == [{"transfer_id": transfer_id,
                                              "token": f"token-{transfer_id}"}]  # fmt: skip
        await asyncio.sleep(0.05)
        assert len(endpoint.releases) == 1  # once, though a continuation failed too
        assert router.metrics.counter("prefill_releases", outcome="released") == 1
        await _close(runner, [prefill, decode])
        await endpoint.stop()

    run(scenario())


async def hanging_up(request: web.Request, body: dict) -> web.Response:
    """A decode that dies with the leg unanswered, once prefill has answered."""
    await asyncio.sleep(0.2)
    request.transport.close()
    return web.Response()


@pytest.mark.parametrize("path", PATHS)
def test_a_decode_instance_that_cannot_be_reached_or_hangs_up_has_prefill_release_the_kv(path):
    async def scenario():
        endpoint = await PrefillEndpoint().start()
        answer, body = PATHS[path]
        prefill = await Fake(with_token(answer(), endpoint)).start()
        fakes = [prefill]
        if path == "first_token":  # prefill's answer comes first on this path anyway
            decode_url = f"http://127.0.0.1:{free_port()}"  # nobody listens
        else:
            fakes.append(await decode_fake(hanging_up).start())
            decode_url = fakes[-1].url
        router, runner, url = await _router(prefill, decode_url, endpoint, known=True)
        _, text = await _ask(url, body)
        assert "release_token" not in text
        assert len(await _released(endpoint)) == 1
        assert await _counted(router, "released") == 1
        await _close(runner, fakes)
        await endpoint.stop()

    run(scenario())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_decode_answered_has_prefill_release_the_kv(stream):
    """The router closes the decode leg before decode answered: vLLM aborts it, and
    for a stream its engine never had it (it takes a streamed request after the
    headers). A decode that did take it would keep the KV at prefill: its word wins."""

    async def scenario():
        endpoint = await PrefillEndpoint().start()
        first_token = stream  # the client has prefill's token when it leaves
        answer = prefill_answer() if first_token else plain_prefill
        prefill = await Fake(with_token(answer, endpoint)).start()
        decode = await decode_fake(sleeping(5.0)).start()
        router, runner, url = await _router(prefill, decode.url, endpoint, known=True)
        body = {**BODY, "stream": stream}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(url + "/v1/completions", json=body) as response:
                    if stream:
                        first = await response.content.readline()
                        assert b'"text":"A"' in first and b"release_token" not in first
                    await response.read()
        assert len(await _released(endpoint)) == 1
        assert await _counted(router, "released") == 1
        assert decode.cancelled == 1
        await _close(runner, [prefill, decode])
        await endpoint.stop()

    run(scenario())


@pytest.mark.parametrize("shape", ["first_token", "first_token_only", "stream", "whole"])
def test_a_decode_leg_decode_answered_releases_nothing_and_no_client_sees_the_token(shape):
    async def scenario():
        endpoint = await PrefillEndpoint().start()
        first_token = shape.startswith("first_token")
        answer = prefill_answer() if first_token else plain_prefill
        prefill = await Fake(with_token(answer, endpoint)).start()
        decode_answer = decode_stream() if first_token else streaming(2, 0.0)
        decode = await decode_fake(decode_ok if shape == "whole" else decode_answer).start()
        router, runner, url = await _router(prefill, decode.url, endpoint, known=True)
        body = {**BODY, "stream": shape != "whole"}
        if shape == "first_token_only":
            body["max_tokens"] = 1  # prefill's token is the answer; decode's leg drains
        status, text = await _ask(url, body)
        assert status == 200 and "token-" not in text and "release_token" not in text
        while router._draining:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert endpoint.releases == [] and not router.metrics.counter("prefill_releases")
        await _close(runner, [prefill, decode])
        await endpoint.stop()

    run(scenario())


@pytest.mark.parametrize(("status", "outcome"), [(409, "kept"), (404, "unknown"),
                                                 (403, "refused"), (500, "failed")])  # fmt: skip
def test_what_prefill_answers_a_release_is_counted(status, outcome):
    async def scenario():
        endpoint = await PrefillEndpoint(status).start()
        prefill = await Fake(with_token(prefill_answer(), endpoint)).start()
        decode = await decode_fake(refusing(400)).start()
        router, runner, url = await _router(prefill, decode.url, endpoint, known=True)
        await _ask(url, {**BODY, "max_tokens": 10**6})
        assert len(await _released(endpoint)) == 1
        assert await _counted(router, outcome) == 1
        await _close(runner, [prefill, decode])
        await endpoint.stop()

    run(scenario())


def test_a_prefill_answer_without_a_token_is_counted_and_nothing_is_posted():
    """An instance without a secret hands out no token (or one older than tokens)."""

    async def scenario():
        endpoint = await PrefillEndpoint().start()
        prefill = await Fake(with_token(prefill_answer(), endpoint, token=False)).start()
        decode = await decode_fake(refusing(400)).start()
        router, runner, url = await _router(prefill, decode.url, endpoint, known=True)
        await _ask(url, {**BODY, "max_tokens": 10**6})
        assert await _counted(router, "no_token") == 1
        assert endpoint.releases == []
        await _close(runner, [prefill, decode])
        await endpoint.stop()

    run(scenario())


def test_a_release_goes_to_the_identity_endpoint_of_the_rank_that_answered():
    """The endpoint the router was given, at the port of the DP rank the echo names
    (rank d answers at its port + d); without one, the endpoint the echo names."""
    given = Instance("http://p:8000", "prefill", "http://10.0.0.7:7900/query")
    echo = {"remote_host": UNROUTABLE, "remote_port": 1, "remote_dp_rank": 2}
    assert release_url(given, echo) == "http://10.0.0.7:7902/kvpush/release"
    assert release_url(given, {}) == "http://10.0.0.7:7900/kvpush/release"
    named = Instance("http://p:8000", "prefill")
    assert release_url(named, echo) == f"http://{UNROUTABLE}:1/kvpush/release"
    assert release_url(named, {"remote_host": "fd00::7", "remote_port": 7900}) == (
        "http://[fd00::7]:7900/kvpush/release"
    )
    assert release_url(named, {"remote_host": "p", "remote_port": True}) is None
    assert release_url(named, {}) is None
