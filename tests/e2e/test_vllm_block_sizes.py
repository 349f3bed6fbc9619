"""Different block sizes on real vLLM (CPU build): a prefill of 64-token blocks into a
decode of 128 (vLLM's CPU default), and 128 into 64, behind `kvpush router`, push.

A larger block is two pages of the smaller; each page moves by descriptor. Answers
equal a plain instance's, every prompt token's KV arrives by transfer (none is
recomputed: the session decode would recompute a failed load, so the counters say
whether KV moved), a prefix decode holds already is not sent again, and nothing is
held afterwards. Prompt lengths are multiples of neither size, and of both."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SMALL = ("bs64_prefill", "bs64_decode")
SHAPES = {  # name: (prefill server, decode server)
    "64-to-128": ("bs64_prefill", "decode"),
    "128-to-64": ("prefill", "bs64_decode"),
}
EXTERNAL = 'source="external_kv_transfer"'
LOCAL = 'source="local_cache_hit"'


@pytest.fixture(scope="module")
def small_blocks(cluster):
    """A prefill and a decode of 64-token blocks beside the session's 128-token pair."""
    cluster.add_server(SMALL[0], "kv_producer", core=0, **PREFILL_TIMERS)
    cluster.add_server(SMALL[1], "kv_consumer", core=1, **DECODE_TIMERS)
    for name in SMALL:
        cluster.servers[name].spec.extra_args = ["--block-size", "64"]
    try:
        cluster.start(*SMALL)
        yield
    finally:
        for name in SMALL:
            cluster.servers.pop(name).stop()


def _by_source(client: Client, url: str, source: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.http.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and source in line
    )


def _delivered(client: Client, url: str, at_least: float) -> None:
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(url, "vllm:kvpush_delivered_total") < at_least:
        assert time.monotonic() < deadline, "decode did not receive every prompt's KV"
        time.sleep(0.2)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_blocks_of_either_size_fill_the_other_and_answers_equal_a_plain_instance(
    cluster, client, small_blocks, shape
):
    prefill, decode = SHAPES[shape]
    router = cluster.start_router([prefill], [decode], name=f"bs-{shape}")
    seed = 21000 + 1000 * list(SHAPES).index(shape)
    lengths = (2, 63, 64, 65, 128, 200, 700)
    prompts = [prompt(n, seed + i) for i, n in enumerate(lengths)]
    # Decode caches the first prompt's blocks; the second shares its first 300 tokens.
    first = prompt(450, seed + 100)
    shared = first[:300] + prompt(150, seed + 101)
    single = cluster.servers["single"].url
    expected = [client.tokens(single, p) for p in [*prompts, first, shared]]
    url = cluster.servers[decode].url
    external, local = _by_source(client, url, EXTERNAL), _by_source(client, url, LOCAL)
    delivered = client.metric(url, "vllm:kvpush_delivered_total")
    failed = client.metric(url, "vllm:kvpush_failed_total")
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: client.tokens(router, p), prompts))
        got += [client.tokens(router, first), client.tokens(router, shared)]
    finally:
        cluster.stop_router(f"bs-{shape}")
    assert got == expected
    _delivered(client, url, delivered + len(prompts) + 2)
    assert client.metric(url, "vllm:kvpush_failed_total") == failed
    hit = _by_source(client, url, LOCAL) - local
    assert hit >= 128  # whole blocks of decode's, of the 300 tokens the two share
    assert _by_source(client, url, EXTERNAL) - external == sum(lengths) + 450 + 450 - hit
    for name in (prefill, decode):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
