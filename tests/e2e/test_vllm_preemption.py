"""Preemption: a KV cache too small for the load makes vLLM take blocks back from
running requests and recompute them later. Nothing kvpush holds may be freed under
a WRITE, no stale KV may be delivered, and every answer must be a plain instance's.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from conftest import PREFILL_TIMERS, prompt, routed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCKS = "24"  # 24 x 128 tokens: six 500-token prompts that grow to 1100 do not fit


@pytest.fixture(scope="module")
def cramped_pair(cluster):
    """The session's prefill, and a decode whose cache the load outgrows, behind a
    router of their own."""
    cluster.add_server("small_decode", "kv_consumer", core=1, **PREFILL_TIMERS)
    cluster.servers["small_decode"].spec.extra_args = ["--num-gpu-blocks-override", BLOCKS]
    with routed(cluster, ["small_decode"], ["prefill"], ["small_decode"], "small") as url:
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
    for name in ("prefill", "small_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_a_prefill_leg_preempted_between_chunks_still_answers_as_a_plain_instance(cluster, client):
    """Prefill's side: long prompts prefilled side by side, 256 tokens each a step, on
    a 12-block cache run out of blocks mid-prompt, and vLLM preempts the newest
    running leg (its blocks freed while a chunk's WRITE may read them; the prompt is
    recomputed later in new blocks). That transfer ends at the preemption; decode (the
    session's, under the recompute policy) computes the prompt itself. Every answer is
    still a plain instance's, and nothing is left held.

    Whether vLLM preempts depends on the legs overlapping, which a fast box may not
    arrange on the first batch: batches go until one preempted (a few at most)."""
    prefill, decode = "chunky_prefill", "decode"
    cluster.add_server(prefill, "kv_producer", core=0, **PREFILL_TIMERS)
    spec = cluster.servers[prefill].spec
    spec.max_model_len = 1408  # what 12 blocks hold, one being vLLM's null block
    spec.extra_args = ["--num-gpu-blocks-override", "12", "--max-num-batched-tokens", "512",
                       "--long-prefill-token-threshold", "256"]  # fmt: skip
    single = cluster.servers["single"].url
    decoded = cluster.servers[decode].url
    recomputed = client.metric(decoded, "vllm:kvpush_local_recomputes_total")
    try:
        cluster.start(prefill)
        router = cluster.start_router([prefill], [decode], name="chunky")
        url = cluster.servers[prefill].url
        for batch in range(3):
            prompts = [prompt(1100, 1800 + 10 * batch + i) for i in range(8)]  # 9 blocks each
            expected = [client.tokens(single, p) for p in prompts]
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: client.tokens(router, p), prompts))
            assert got == expected
            if client.metric(url, "vllm:num_preemptions_total") > 0:
                break
        assert client.metric(url, "vllm:num_preemptions_total") > 0, "nothing was preempted"
        # A preempted leg had pushed a chunk: its transfer ended, decode computed it.
        assert client.metric(decoded, "vllm:kvpush_local_recomputes_total") > recomputed
        for name in (prefill, decode):
            state = client.wait_drained(cluster.identity_url(name))
            assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
    finally:
        cluster.stop_router("chunky")
        cluster.servers.pop(prefill).stop()
