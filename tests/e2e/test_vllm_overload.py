"""An overloaded pair: queues far longer than every protocol timer, and no expiry.

A transfer's timers must run on liveness (heartbeats while either side still has
the request), not on how long it queues. This pair's timers are 4 s; prefill is
given a queue of well over three times that. KVPUSH_OVERLOAD=literal runs the same
test at full scale by hand (not in CI: minutes here): the default timers (lease and
registration 60 s, watchdog 30 s) and a queue over three times the watchdog.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest
from conftest import Client, extra_pair, prompt

from kvpush.protocol.config import ProtocolConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SHORT = {"lease_s": 4.0, "registration_ttl_s": 4.0, "watchdog_s": 4.0, "heartbeat_s": 1.0,
         "write_grace_s": 2.0}  # fmt: skip
LITERAL = os.environ.get("KVPUSH_OVERLOAD") == "literal"
TIMERS = {} if LITERAL else SHORT
WATCHDOG_S = ProtocolConfig(**TIMERS).watchdog_s
REQUESTS = 1800 if LITERAL else 256


@pytest.fixture(scope="module")
def overload_pair(cluster):
    with extra_pair(cluster, "busy", **TIMERS) as url:
        yield url


def test_a_queue_three_times_every_timer_completes_with_no_expiry(cluster, overload_pair, client):
    single = cluster.servers["single"].url
    # Every request in the servers' queues at once: a client with room for all.
    prompts = [prompt(1900, 1500 + i) for i in range(REQUESTS)]
    wide = Client(timeout=300, connections=len(prompts))
    started = time.monotonic()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: wide.complete(overload_pair, p, max_tokens=4), prompts))
    took = time.monotonic() - started
    assert took > 3 * WATCHDOG_S, f"the queue lasted only {took:.1f}s: not an overload"
    assert [a.status_code for a in answers] == [200] * len(prompts), [
        a.text for a in answers if a.status_code != 200
    ][:2]
    for p, answer in zip(prompts[:8], answers[:8], strict=True):
        assert answer.json()["choices"][0]["token_ids"] == client.tokens(single, p, 4)
    decode = cluster.servers["busy_decode"].url
    assert client.metric(decode, "vllm:kvpush_failed_total") == 0
    assert client.metric(decode, "vllm:kvpush_delivered_total") == len(prompts)
    for name in ("busy_prefill", "busy_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
