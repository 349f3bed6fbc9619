"""The router's own behaviour under slow, failing and departing peers.

Real HTTP on loopback: the router app as `kvpush router` serves it, in front of
small OpenAI-shaped servers whose timing and failures each test sets (the real
vLLM pairs are in tests/e2e).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.addresses import loopback_problem
from kvpush.identities import InstanceIdentity, decode_params, parse_identity
from kvpush.ports import free_port
from kvpush.router.app import Router, RouterConfig, event_loop
from kvpush.router.decide import DecisionRule
from kvpush.router.instances import Instance, pairing_problem
from kvpush.router.policy import RoutingPolicy

ECHO = {"remote_engine_id": "e", "remote_epoch": "x", "transfer_mode": "push",
        "remote_addresses": ["127.0.0.1:1"], "tp_size": 1}  # fmt: skip


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class Fake:
    """An OpenAI-shaped server that records what it was sent."""

    def __init__(self, answer: Callable[[web.Request, dict], Awaitable[web.StreamResponse]]):
        self.answer = answer
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.cancelled = 0
        self.connections: set[int] = set()  # the client ports requests came from
        self.url = ""
        self.texts: dict[int, str] = {}  # what /detokenize makes of a token id
        self._runner: web.AppRunner | None = None

    async def start(self) -> Fake:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", _healthy)
        app.router.add_post("/detokenize", self._detokenize)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.connections.add(request.transport.get_extra_info("peername")[1])
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        try:
            return await self.answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1  # the router closed the connection: vLLM would abort
            raise

    async def _detokenize(self, request: web.Request) -> web.Response:
        ids = (await request.json())["tokens"]
        return web.json_response({"prompt": "".join(self.texts.get(i, f"<{i}>") for i in ids)})

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def prefill_ok(request: web.Request, body: dict) -> web.Response:
    params = {**ECHO, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})


async def decode_ok(request: web.Request, body: dict) -> web.Response:
    return web.json_response({"choices": [{"text": "answer"}]})


def streaming(pieces: int, gap: float):
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for i in range(pieces):
            await asyncio.sleep(gap)
            await stream.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    return answer


def sleeping(seconds: float):
    async def answer(request: web.Request, body: dict) -> web.Response:
        await asyncio.sleep(seconds)
        return web.json_response({"choices": [{"text": "late"}]})

    return answer


async def failing(request: web.Request, body: dict) -> web.Response:
    return web.json_response({"error": {"message": "engine dead"}}, status=503)


async def _serve(prefill: list[Fake], decode: list[Fake], **config: Any):
    for fake in prefill + decode:
        await fake.start()
    router = Router(
        RouterConfig(
            [Instance(f.url, "prefill") for f in prefill],
            [Instance(f.url, "decode") for f in decode],
            **{"health_interval_s": 0, **config},
        )
    )
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return router, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _close(runner: web.AppRunner, fakes: list[Fake]) -> None:
    await runner.cleanup()
    for fake in fakes:
        await fake.stop()


def run(coroutine) -> Any:
    return asyncio.run(coroutine)


def test_an_idle_connection_is_not_kept_as_long_as_a_server_keeps_it():
    """vLLM closes a connection idle for 5 s. One the router reuses just then fails
    the request with "Server disconnected" (seen in CI: the first request after the
    cluster came up), so the router drops idle connections well before."""

    async def scenario() -> None:
        prefill, decode = Fake(prefill_ok), Fake(decode_ok)
        _, runner, url = await _serve([prefill], [decode], keepalive_s=0.2)
        async with aiohttp.ClientSession() as client:
            for pause in (0.0, 0.05, 0.5):  # the second reuses, the third must not
                await asyncio.sleep(pause)
                async with client.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    assert r.status == 200
        assert len(decode.connections) == 2 and len(prefill.connections) == 2
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_long_stream_is_not_cut_by_the_timeout_a_silent_leg_is():
    async def scenario():
        prefill = Fake(prefill_ok)
        decode = Fake(streaming(pieces=6, gap=0.3))  # 1.8 s in all, never 1 s silent
        _, runner, url = await _serve([prefill], [decode], timeout_s=1.0)
        body = {"model": "m", "prompt": "p", "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as response:
                text = await response.text()
            assert response.status == 200 and text.count("data: {") == 6
            decode.answer = sleeping(3.0)
            started = asyncio.get_running_loop().time()
            async with http.post(url + "/v1/completions", json={**body, "stream": False}) as r:
                assert r.status == 502
                assert "idle timeout" in (await r.json())["error"]["message"]
            assert asyncio.get_running_loop().time() - started < 2.5
        await _close(runner, [prefill, decode])

    run(scenario())


def test_credentials_and_request_id_reach_both_legs():
    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(decode_ok)
        _, runner, url = await _serve([prefill], [decode])
        headers = {"Authorization": "Bearer k", "X-Request-Id": "req-7"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json={"prompt": "p"}, headers=headers) as r,
        ):
            assert r.status == 200
        for fake in (prefill, decode):
            got = {k.lower(): v for k, v in fake.headers[0].items()}
            assert got["authorization"] == "Bearer k", got
            assert got["x-request-id"] == "req-7", got
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_failed_instance_is_retried_elsewhere_with_a_new_transfer_and_ejected():
    async def scenario():
        prefill = Fake(prefill_ok)
        broken, healthy = Fake(failing), Fake(decode_ok)
        router, runner, url = await _serve([prefill], [broken, healthy], cooldown_s=30)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    assert r.status == 200, await r.text()
        assert len(broken.bodies) == 1  # tried once, then left alone for the cool-down
        tids = [b["kv_transfer_params"]["transfer_id"] for b in prefill.bodies]
        assert len(set(tids)) == len(tids) == 4  # the retry minted its own transfer id
        metrics = router.metrics.prometheus(prefix="kvpush_")
        assert f'kvpush_instance_ejections_total{{instance="{broken.url}",why="leg_failed"}} 1' in (
            metrics
        )
        assert f'instance="{broken.url}",outcome="failed"' in metrics
        await _close(runner, [prefill, broken, healthy])

    run(scenario())


def test_a_client_error_is_not_retried():
    async def scenario():
        async def refuse(request, body):
            return web.json_response({"error": {"message": "bad max_tokens"}}, status=400)

        prefill, decode_a, decode_b = Fake(prefill_ok), Fake(refuse), Fake(refuse)
        _, runner, url = await _serve([prefill], [decode_a, decode_b])
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json={"prompt": "p"}) as r,
        ):
            assert r.status == 400
        assert len(decode_a.bodies) + len(decode_b.bodies) == 1
        await _close(runner, [prefill, decode_a, decode_b])

    run(scenario())


def test_a_non_streamed_answer_cut_short_by_a_dying_decode_is_an_error_not_a_200():
    """Found by the CI run: decode killed mid-answer had sent its 200 headers, and the
    router passed the empty body on as a 200."""

    async def scenario():
        async def die_mid_answer(request, body):
            # Headers without a length, then the end of the connection: the body is
            # whatever came before it, here nothing.
            request.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
            )
            request.transport.close()  # the process is gone
            await asyncio.sleep(3600)

        prefill, decode = Fake(prefill_ok), Fake(die_mid_answer)
        _, runner, url = await _serve([prefill], [decode])
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json={"prompt": "p"}) as r,
        ):
            assert r.status >= 500
            assert decode.url in (await r.json())["error"]["message"]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_non_streaming_client_that_leaves_aborts_the_decode_leg():
    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(sleeping(5.0))
        _, runner, url = await _serve([prefill], [decode])
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    await r.read()
        for _ in range(40):
            if decode.cancelled:
                break
            await asyncio.sleep(0.05)
        assert decode.cancelled == 1
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_client_leaving_mid_stream_is_not_a_decode_failure():
    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(streaming(pieces=50, gap=0.05))
        router, runner, url = await _serve([prefill], [decode])
        body = {"prompt": "p", "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json=body) as response,
        ):
            await response.content.readline()  # one event, then walk away
        for _ in range(60):
            if decode.cancelled:
                break
            await asyncio.sleep(0.05)
        assert decode.cancelled == 1
        metrics = router.metrics.prometheus(prefix="kvpush_")
        assert 'leg="decode"' not in metrics
        await _close(runner, [prefill, decode])

    run(scenario())


def _dp_identity(rank: int) -> dict:
    return {"kvpush": True, "engine_id": f"prefill_dp{rank}", "epoch": f"boot{rank}",
            "transfer_mode": "push", "addresses": [f"127.0.0.1:{7000 + rank}"], "tp_size": 1,
            "dp_rank": rank, "data_parallel": True}  # fmt: skip


def _identity_handler(identity: dict):
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(identity)

    return handle


def test_a_data_parallel_prefill_has_each_leg_pinned_to_the_rank_its_decode_leg_names():
    async def scenario():
        # DP rank d of the prefill instance answers GET /query at identity_port + d.
        base = free_port()
        while True:
            runners = []
            try:
                for rank in range(2):
                    app = web.Application()
                    app.router.add_get("/query", _identity_handler(_dp_identity(rank)))
                    runner = web.AppRunner(app)
                    await runner.setup()
                    await web.TCPSite(runner, "127.0.0.1", base + rank).start()
                    runners.append(runner)
                break
            except OSError:  # base + 1 was taken: try elsewhere
                for runner in runners:
                    await runner.cleanup()
                base = free_port()

        async def prefill_answer(request: web.Request, body: dict) -> web.Response:
            rank = int(request.headers["X-data-parallel-rank"])
            params = {
                **ECHO,
                "remote_engine_id": f"prefill_dp{rank}",
                "remote_epoch": f"boot{rank}",
                "remote_dp_rank": rank,
                "remote_data_parallel": True,
                "transfer_id": body["kv_transfer_params"]["transfer_id"],
            }
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

        prefill, decode = Fake(prefill_answer), Fake(decode_ok)
        for fake in (prefill, decode):
            await fake.start()
        identity_url = f"http://127.0.0.1:{base}/query"
        pools = [Instance(prefill.url, "prefill", identity_url)], [Instance(decode.url, "decode")]
        router = Router(RouterConfig(*pools, health_interval_s=0))
        runner = web.AppRunner(router.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                body = {"model": "m", "prompt": "hi", "max_tokens": 2}
                async with http.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
        await asyncio.sleep(0.05)  # the prefill legs finish on their own
        pinned = [int(h["X-data-parallel-rank"]) for h in prefill.headers]
        named = [b["kv_transfer_params"]["remote_engine_id"] for b in decode.bodies]
        assert sorted(pinned) == [0, 0, 1, 1]
        # Each decode leg names the engine of the rank its prefill leg was pinned to.
        by_transfer = {b["kv_transfer_params"]["transfer_id"]: r
                       for b, r in zip(prefill.bodies, pinned, strict=True)}  # fmt: skip
        for body, engine in zip(decode.bodies, named, strict=True):
            assert engine == f"prefill_dp{by_transfer[body['kv_transfer_params']['transfer_id']]}"
        assert router.metrics.counter("identity_relearned") == 0
        await _close(runner, [prefill, decode])
        for identity_runner in runners:
            await identity_runner.cleanup()

    run(scenario())


def error_stream(preamble: list[dict]):
    """vLLM's stream of a request that fails before its first token (a KV load failed
    under kv_load_failure_policy "fail"): chat's role chunk, if any, then a bare error."""

    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                           "param": None, "code": 500}}  # fmt: skip
        for event in [*preamble, error]:
            await stream.write(f"data: {json.dumps(event)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    return answer


ROLE_CHUNK = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


@pytest.mark.parametrize("preamble", [[], [ROLE_CHUNK]], ids=["completion", "chat"])
def test_a_stream_whose_decode_leg_fails_before_its_first_token_is_an_error_naming_decode(
    preamble,
):
    """Found by the soak: the bare error event went to the client inside a 200 stream,
    naming neither the instance nor the leg, and was never retried elsewhere."""

    async def scenario():
        prefill, decode = Fake(prefill_ok), Fake(error_stream(preamble))
        _, runner, url = await _serve([prefill], [decode])
        body = {"model": "m", "prompt": "p", "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 500, await r.text()
                message = (await r.json())["error"]["message"]
            assert message == f"decode instance {decode.url}: Internal server error"
            other = await Fake(streaming(pieces=2, gap=0.0)).start()
        await _close(runner, [prefill, decode])
        # With another decode instance, the request is retried there and answered.
        prefill, decode = Fake(prefill_ok), Fake(error_stream(preamble))
        _, runner, url = await _serve([prefill], [decode, other])
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and (await r.text()).count("data: {") == 2
        await _close(runner, [prefill, decode, other])

    run(scenario())


def _identity(engine: str, block_size: int, tp_size: int = 1, mode: str = "push") -> dict:
    return {"kvpush": True, "engine_id": engine, "epoch": "boot", "transfer_mode": mode,
            "addresses": [f"127.0.0.1:{7000 + r}" for r in range(tp_size)],
            "tp_size": tp_size, "block_size": block_size, "dp_rank": 0}  # fmt: skip


async def _identity_endpoint(identity: dict, traces=None) -> tuple[web.AppRunner, str]:
    """An instance's identity endpoint; `traces()`: what its /kvpush/trace answers."""
    app = web.Application()
    app.router.add_get("/query", _identity_handler(identity))

    async def trace(request: web.Request) -> web.Response:
        return web.json_response(traces() if traces else [])

    app.router.add_get("/kvpush/trace", trace)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/query"


async def _paired(
    prefill: dict,
    decodes: list[dict],
    mode: str = "push",
    requests: int = 4,
    prefill_endpoint: bool = True,
    decode_answer=decode_ok,
    decode_traces=None,
    stream: bool = False,
):
    """A router told every decode's identity endpoint (and prefill's, unless not
    `prefill_endpoint`): what `requests` requests got, the fakes (prefill first) with
    what each was sent, and the refusals counted. `decode_traces(fake)`: what a
    decode's /kvpush/trace answers."""

    async def prefill_answer(request: web.Request, body: dict) -> web.Response:
        tid = body["kv_transfer_params"]["transfer_id"]
        params = {**decode_params(tid, parse_identity(prefill)), "remote_host": "127.0.0.1",
                  "remote_port": 1}  # fmt: skip
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    fakes = [Fake(prefill_answer), *(Fake(decode_answer) for _ in decodes)]
    endpoints = [await _identity_endpoint(prefill)] + [
        await _identity_endpoint(i, decode_traces and (lambda f=fake: decode_traces(f)))
        for i, fake in zip(decodes, fakes[1:], strict=True)
    ]
    for fake in fakes:
        await fake.start()
    instances = [
        Instance(fake.url, role, url)
        for fake, (_, url), role in zip(
            fakes, endpoints, ["prefill"] + ["decode"] * len(decodes), strict=True
        )
    ]
    if not prefill_endpoint:
        instances[0].identity_url = None
    router = Router(RouterConfig(instances[:1], instances[1:], mode=mode, health_interval_s=0))
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    answers = []
    async with aiohttp.ClientSession() as http:
        for _ in range(requests):
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream}
            async with http.post(url + "/v1/completions", json=body) as response:
                answers.append((response.status, await response.json()))
    await asyncio.sleep(0.05)
    refusals = router.metrics.counter("pairing_refusals")
    await _close(runner, fakes)
    for endpoint_runner, _ in endpoints:
        await endpoint_runner.cleanup()
    return answers, fakes, refusals


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_requests_go_only_to_a_decode_whose_blocks_and_ranks_pair_with_prefill(mode):
    prefill = _identity("prefill", 128, tp_size=2, mode=mode)
    decodes = [
        _identity("odd-blocks", 96, tp_size=2, mode=mode),
        _identity("tp3", 128, tp_size=3, mode=mode),
        _identity("fits", 128, tp_size=1, mode=mode),
    ]
    answers, (_, small, tp3, fits), refusals = run(_paired(prefill, decodes, mode))
    assert [status for status, _ in answers] == [200] * 4
    assert (len(small.bodies), len(tp3.bodies), len(fits.bodies)) == (0, 0, 4)
    assert refusals == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("decode", "named"),
    [
        (
            _identity("d", 96),
            ["block sizes differ", "prefill holds 128 tokens per block, decode 96", "one divides"],
        ),
        (_identity("d", 128, tp_size=3), ["tensor-parallel sizes 2 (prefill) and 3 (decode)"]),
        (
            {**_identity("d", 64, tp_size=2), "block_pages": False},
            [
                "prefill holds 128 tokens per block, decode 64",
                "decode's KV cache keeps its tokens in its attention kernel's own order",
                "same --block-size",
            ],
        ),
        (
            {**_identity("d", 128, tp_size=2), "kv_groups": 2},
            ["KV cache groups differ: prefill 1, decode 2", "hybrid KV cache manager"],
        ),
        (
            {**_identity("d", 128, tp_size=2), "kv_states": 3},
            ["recurrent-state groups differ: prefill 0, decode 3"],
        ),
    ],
    ids=["block-size", "tensor-parallel", "block-size-unpaged", "kv-groups", "kv-states"],
)
def test_a_pair_that_cannot_exchange_kv_is_refused_with_both_sides_values(mode, decode, named):
    prefill = _identity("p", 128, tp_size=2, mode=mode)
    decode = {**decode, "transfer_mode": mode}
    answers, (prefill_fake, decode_fake), refusals = run(_paired(prefill, [decode], mode, 2))
    for status, answer in answers:
        assert status == 502
        assert answer["error"]["type"] == "pairing_error"
        for words in named:
            assert words in answer["error"]["message"], answer
    # Refused before either instance did any work: both identities were known.
    assert decode_fake.bodies == [] and prefill_fake.bodies == []
    assert refusals == 2


def test_recurrent_state_pairs_only_at_equal_tp_in_the_routers_eyes():
    def shape(tp_size: int, states: int) -> InstanceIdentity:
        return parse_identity({**_identity("x", 256, tp_size=tp_size), "kv_groups": 4,
                               "kv_states": states})  # fmt: skip

    assert pairing_problem(shape(2, 3), shape(2, 3)) is None
    assert "prefill runs TP 2 and decode TP 1 with recurrent state" in pairing_problem(
        shape(2, 3), shape(1, 3)
    )
    assert pairing_problem(shape(2, 0), shape(1, 0)) is None  # attention KV maps heads


def test_a_pull_router_that_learns_prefill_from_its_answer_refuses_before_decode():
    prefill, decode = _identity("p", 128, mode="pull"), _identity("d", 96, mode="pull")
    answers, (prefill_fake, decode_fake), refusals = run(
        _paired(prefill, [decode], "pull", 2, prefill_endpoint=False)
    )
    assert [status for status, _ in answers] == [502, 502]
    assert "prefill holds 128 tokens per block, decode 96" in answers[0][1]["error"]["message"]
    assert len(prefill_fake.bodies) == 1  # the first answer taught the router its shape
    assert decode_fake.bodies == [] and refusals == 2


async def internal_error(request: web.Request, body: dict) -> web.Response:
    error = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
    return web.json_response({"error": error}, status=500)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_decode_leg_kvpush_failed_tells_the_client_why_not_internal_server_error(stream):
    """vLLM answers a request whose KV load failed with a bare 500 (or error event);
    the decode instance's trace holds kvpush's reason, and the client gets that."""
    why = "handshake_refused: block sizes differ: prefill holds 128 tokens per block, decode 96"

    def traces(decode: Fake) -> list[dict]:
        named = [b["kv_transfer_params"]["transfer_id"] for b in decode.bodies]
        return [{"transfer_id": "xfer-other", "error": "not this one"}] + [
            {"transfer_id": tid, "marks": {}, "error": why} for tid in named
        ]

    identity = _identity("p", 128)
    answers, _, _ = run(
        _paired(
            identity,
            [identity],
            requests=1,
            decode_answer=error_stream([]) if stream else internal_error,
            decode_traces=traces,
            stream=stream,
        )
    )
    ((status, answer),) = answers
    assert status == 500
    assert answer["error"]["type"] == "kv_transfer_error"
    assert why in answer["error"]["message"] and "could not load" in answer["error"]["message"]


def test_a_decode_failure_kvpush_has_no_reason_for_stays_as_decode_said():
    identity = _identity("p", 128)
    answers, _, _ = run(
        _paired(identity, [identity], requests=1, decode_answer=internal_error,
                decode_traces=lambda decode: [])
    )  # fmt: skip
    ((status, answer),) = answers
    assert status == 500 and answer["error"]["type"] != "kv_transfer_error"


def test_a_decode_identity_endpoint_that_does_not_answer_is_not_asked_per_request():
    async def scenario():
        asked = []

        async def not_kvpush(request: web.Request) -> web.Response:
            asked.append(1)
            return web.json_response({"kvpush": False})

        app = web.Application()
        app.router.add_get("/query", not_kvpush)
        endpoint = web.AppRunner(app)
        await endpoint.setup()
        await web.TCPSite(endpoint, "127.0.0.1", 0).start()
        identity_url = f"http://127.0.0.1:{endpoint.addresses[0][1]}/query"
        prefill, decode = Fake(prefill_ok), Fake(decode_ok)
        for fake in (prefill, decode):
            await fake.start()
        pools = [Instance(prefill.url, "prefill")], [Instance(decode.url, "decode", identity_url)]
        runner = web.AppRunner(Router(RouterConfig(*pools, health_interval_s=0)).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                body = {"model": "m", "prompt": "hi", "max_tokens": 2}
                async with http.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
        await _close(runner, [prefill, decode])
        await endpoint.cleanup()
        return len(asked)

    assert run(scenario()) == 1  # at start; not again within the cooldown


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_the_router_relays_a_stream_on_the_event_loop_it_is_given(kind):
    """`kvpush router --loop`: "auto" (the default) is uvloop, installed with vLLM."""
    loop = event_loop(kind)
    assert type(loop).__module__.partition(".")[0] == kind

    async def scenario() -> str:
        prefill, decode = Fake(prefill_ok), Fake(streaming(pieces=3, gap=0.0))
        _, runner, url = await _serve([prefill], [decode])
        body = {"model": "m", "prompt": "p", "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json=body) as r,
        ):
            assert r.status == 200
            text = await r.text()
        await _close(runner, [prefill, decode])
        return text

    try:
        text = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert [json.loads(line[6:])["choices"][0]["text"] for line in text.split("\n\n")
            if line.startswith("data: {")] == ["0", "1", "2"]  # fmt: skip
    assert text.rstrip().endswith("data: [DONE]")


def test_auto_is_uvloop_and_an_unknown_loop_is_refused():
    import uvloop

    loop = event_loop("auto")
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        event_loop("trio")


def test_a_loopback_producer_refused_by_decode_reaches_the_client_and_the_log(caplog):
    """Decode refused a prefill that advertised loopback from another host: its trace
    says so, and the router tells the client and logs it."""
    why = "handshake_failed: " + loopback_problem("127.0.0.1:38503", "theirs", "ours")

    def traces(decode: Fake) -> list[dict]:
        named = [b["kv_transfer_params"]["transfer_id"] for b in decode.bodies]
        return [{"transfer_id": tid, "marks": {}, "error": why} for tid in named]

    identity = _identity("p", 128)
    with caplog.at_level(logging.WARNING, logger="kvpush.router.app"):
        answers, _, _ = run(
            _paired(identity, [identity], requests=1, decode_answer=internal_error,
                    decode_traces=traces)
        )  # fmt: skip
    ((status, answer),) = answers
    assert (status, answer["error"]["type"]) == (500, "kv_transfer_error")
    assert "127.0.0.1:38503, a loopback address" in answer["error"]["message"]
    assert any("127.0.0.1:38503, a loopback address" in r.getMessage() for r in caplog.records)


def test_a_long_prompt_being_computed_sends_a_turn_sharing_its_prefix_elsewhere():
    """The router counts on each instance the prompt tokens its requests compute
    before their first token, and placement weighs them: a turn whose prefix sits
    where a long prompt is being computed would wait behind it, so it goes to the
    idle instance. Counted by requests alone (one, 512 tokens), the prefix would win."""

    async def scenario():
        computed = asyncio.Event()

        async def answer(request: web.Request, body: dict) -> web.StreamResponse:
            if len(body["prompt"]) > 2000:
                await computed.wait()  # its prompt is being computed until then
                return await streaming(pieces=3, gap=0.3)(request, body)
            return await streaming(pieces=1, gap=0)(request, body)

        decodes = [Fake(answer), Fake(answer)]
        policy = RoutingPolicy(DecisionRule("never"), placement="prefix")
        prefill = Fake(prefill_ok)
        router, runner, url = await _serve([prefill], decodes, policy=policy)
        prefix = list(range(6, 1006))
        long_prompt = prefix + [7] * 2000
        async with aiohttp.ClientSession() as http:

            async def send(prompt: list[int]) -> None:
                body = {"model": "m", "prompt": prompt, "stream": True}
                async with http.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                    await response.text()

            await send(prefix)
            held = router.index.cached_tokens
            holder, other = sorted(router.decode.instances, key=lambda i: -held(i.url, prefix))
            long_request = asyncio.ensure_future(send(long_prompt))
            while holder.outstanding == 0:
                await asyncio.sleep(0.01)
            lacks = len(long_prompt) - router.index.cached_tokens(holder.url, long_prompt)
            assert (holder.computing, other.computing) == (lacks, 0) and lacks > 2000
            await send(prefix + [9] * 50)
            fakes = {i.url: f for i, f in zip(router.decode.instances, decodes, strict=True)}
            assert fakes[other.url].bodies[-1]["prompt"] == prefix + [9] * 50
            computed.set()
            while holder.computing:  # its first byte is out; the rest still streams
                await asyncio.sleep(0.01)
            assert holder.outstanding == 1
            await long_request
        assert [(i.computing, i.outstanding) for i in router.decode.instances] == [(0, 0)] * 2
        await _close(runner, [prefill, *decodes])

    run(scenario())


def test_a_prefill_legs_compute_is_counted_on_prefill_until_it_answers():
    async def scenario():
        answered = asyncio.Event()

        async def slow_prefill(request: web.Request, body: dict) -> web.Response:
            await answered.wait()
            return await prefill_ok(request, body)

        decoded = asyncio.Event()

        async def slow_decode(request: web.Request, body: dict) -> web.Response:
            await decoded.wait()
            return await decode_ok(request, body)

        prefill, decode = Fake(slow_prefill), Fake(slow_decode)
        policy = RoutingPolicy(DecisionRule("always"), placement="prefix")
        router, runner, url = await _serve([prefill], [decode], policy=policy)
        p, d = router.prefill.instances[0], router.decode.instances[0]
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": list(range(6, 606))}
            sent = asyncio.ensure_future(http.post(url + "/v1/completions", json=body))
            while p.outstanding == 0:
                await asyncio.sleep(0.01)
            assert (p.computing, d.computing) == (600, 0)
            answered.set()
            while not decode.bodies:  # prefill answered; decode has the request now
                await asyncio.sleep(0.01)
            assert (p.computing, p.outstanding) == (0, 1) and not sent.done()
            decoded.set()
            async with await sent as response:
                assert response.status == 200
        assert (p.computing, p.outstanding) == (0, 0)
        await _close(runner, [prefill, decode])

    run(scenario())
