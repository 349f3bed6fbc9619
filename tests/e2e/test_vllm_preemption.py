"""Preemption: a KV cache too small for the load makes vLLM take blocks back from
running requests and recompute them later. Nothing kvpush holds may be freed under
a WRITE, no stale KV may be delivered, and every answer must be a plain instance's.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from conftest import PREFILL_TIMERS, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCKS = "24"  # 24 x 128 tokens: six 500-token prompts that grow to 1100 do not fit


@pytest.fixture(scope="module")
def cramped_pair(cluster):
    for name, role, core in (("small_prefill", "kv_producer", 0),
                             ("small_decode", "kv_consumer", 1)):  # fmt: skip
        server = cluster.add_server(name, role, core=core, **PREFILL_TIMERS)
        server.spec.extra_args = ["--num-gpu-blocks-override", BLOCKS]
    try:
        cluster.start("small_prefill", "small_decode")
        yield cluster.start_router(["small_prefill"], ["small_decode"], name="small")
    finally:
        cluster.stop_router("small")
        for name in ("small_prefill", "small_decode"):
            cluster.servers.pop(name).stop()


def _metric(client, url: str, name: str) -> float:
    lines = client.http.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_preempted_decode_requests_still_answer_as_a_plain_instance(cluster, cramped_pair, client):
    single = cluster.servers["single"].url
    prompts = [prompt(500, 1700 + i) for i in range(6)]
    expected = [client.tokens(single, p, 600) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: client.tokens(cramped_pair, p, 600), prompts))
    decode = cluster.servers["small_decode"].url
    assert _metric(client, decode, "vllm:num_preemptions_total") > 0, "nothing was preempted"
    assert got == expected
    for name in ("small_prefill", "small_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
