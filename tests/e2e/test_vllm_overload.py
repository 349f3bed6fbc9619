"""An overloaded pair: queues far longer than every protocol timer, and no expiry.

A transfer's timers must run on liveness (heartbeats while either side still has
the request), not on how long it queues. This pair's timers are 6 s; prefill is
given a queue of well over three times that. KVPUSH_OVERLOAD=literal runs the same
test at full scale by hand (not in CI: minutes here): the default timers (lease and
registration 60 s, watchdog 30 s) and a queue over three times the watchdog.

How many requests make such a queue depends on the machine: the test measures the
pair's flat-out rate first and sends enough for five times the watchdog at that rate.
Should the queue still drain too soon (the machine got faster meanwhile), it sends a
larger one, a bounded number of times; the overload itself is never assumed. Each
request in flight holds a socket here and three in the router, so the queue is also
bounded by the open-file limit, raised as far as the hard limit allows.

The pair's servers refuse requests without an API key (vLLM's --api-key), so the
queue also shows that the router hands the client's key to both legs, and a last
test checks that a request without it is refused.
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import httpx
import pytest
from conftest import extra_pair, prompt

from kvpush.demo.servers import MODEL_NAME
from kvpush.limits import raise_open_files
from kvpush.protocol.config import ProtocolConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SHORT = {"lease_s": 6.0, "registration_ttl_s": 6.0, "watchdog_s": 6.0, "heartbeat_s": 1.0,
         "write_grace_s": 2.0}  # fmt: skip
LITERAL = os.environ.get("KVPUSH_OVERLOAD") == "literal"
TIMERS = {} if LITERAL else SHORT
WATCHDOG_S = ProtocolConfig(**TIMERS).watchdog_s
PROMPT_LEN, OUTPUT = 1900, 4
CALIBRATION = 32  # requests whose drain time gives the pair's flat-out rate
MARGIN = 5.0  # the queue aimed for, in watchdogs (three are required; a longer queue
# drains faster than the calibration's, as batches fill)
ATTEMPTS = 3
SPARE_FILES = 256  # the router's and this process's other files
API_KEY = "sk-kvpush-test"
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def overload_pair(cluster):
    with extra_pair(cluster, "busy", extra_args=("--api-key", API_KEY), **TIMERS) as url:
        yield url


async def _all_at_once(url: str, prompts: list[list[int]]) -> tuple[list[httpx.Response], float]:
    """Every request in the servers' queues at once; the answers, and how long the
    last took."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=AUTHORIZED) as http:

        async def one(tokens: list[int]) -> httpx.Response:
            body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": OUTPUT,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            return await http.post(url + "/v1/completions", json=body)

        started = time.monotonic()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        return list(answers), time.monotonic() - started


def _overload(url: str, seed: int, count: int) -> tuple[list, list[httpx.Response], float]:
    prompts = [prompt(PROMPT_LEN, seed + i) for i in range(count)]
    answers, took = asyncio.run(_all_at_once(url, prompts))
    assert [a.status_code for a in answers] == [200] * count, [
        a.text for a in answers if a.status_code != 200
    ][:2]
    return prompts, answers, took


def test_a_queue_three_times_every_timer_completes_with_no_expiry(cluster, overload_pair, client):
    single = cluster.servers["single"].url
    decode = cluster.servers["busy_decode"].url
    most = (raise_open_files() - SPARE_FILES) // 3  # the router's share bounds the queue
    _, _, took = _overload(overload_pair, 1400, CALIBRATION)
    rate = CALIBRATION / took
    count = min(most, max(2 * CALIBRATION, math.ceil(rate * MARGIN * WATCHDOG_S)))
    sent = CALIBRATION
    for attempt in range(ATTEMPTS):
        prompts, answers, took = _overload(overload_pair, 1500 + 10_000 * attempt, count)
        sent += count
        print(f"{count} requests at a measured {rate:.1f}/s drained in {took:.1f}s")
        if took > 3 * WATCHDOG_S or count == most:
            break
        rate = count / took
        count = min(most, math.ceil(rate * MARGIN * WATCHDOG_S))
    assert took > 3 * WATCHDOG_S, (
        f"the queue of {count} lasted only {took:.1f}s: not an overload"
        + (f" (the open-file limit caps it at {most})" if count == most else "")
    )
    for p, answer in zip(prompts[:8], answers[:8], strict=True):
        assert answer.json()["choices"][0]["token_ids"] == client.tokens(single, p, OUTPUT)
    assert client.metric(decode, "vllm:kvpush_failed_total") == 0
    assert client.metric(decode, "vllm:kvpush_delivered_total") == sent
    for name in ("busy_prefill", "busy_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_an_api_key_reaches_both_legs(cluster, overload_pair, client):
    tokens = prompt(220, 960)
    decode = cluster.servers["busy_decode"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    assert client.complete(overload_pair, tokens).status_code == 401
    headers = {**AUTHORIZED, "X-Request-Id": "kvpush-e2e-key"}
    response = client.complete(overload_pair, tokens, headers=headers)
    assert response.status_code == 200, response.text
    expected = client.tokens(cluster.servers["single"].url, tokens)
    assert response.json()["choices"][0]["token_ids"] == expected
    # The KV was pushed, not recomputed.
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + 1
