"""Preemption: a KV cache too small for the load makes vLLM take blocks back from
running requests and recompute them later. Nothing kvpush holds may be freed under
a WRITE, no stale KV may be delivered, and every answer must be a plain instance's.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from conftest import PREFILL_TIMERS, extra_pair, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCKS = "24"  # 24 x 128 tokens: six 500-token prompts that grow to 1100 do not fit


@pytest.fixture(scope="module")
def cramped_pair(cluster):
    extra = ("--num-gpu-blocks-override", BLOCKS)
    with extra_pair(cluster, "small", extra_args=extra, **PREFILL_TIMERS) as url:
        yield url


def test_preempted_decode_requests_still_answer_as_a_plain_instance(cluster, cramped_pair, client):
    single = cluster.servers["single"].url
    prompts = [prompt(500, 1700 + i) for i in range(6)]
    expected = [client.tokens(single, p, 600) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: client.tokens(cramped_pair, p, 600), prompts))
    decode = cluster.servers["small_decode"].url
    assert client.metric(decode, "vllm:num_preemptions_total") > 0, "nothing was preempted"
    assert got == expected
    for name in ("small_prefill", "small_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
