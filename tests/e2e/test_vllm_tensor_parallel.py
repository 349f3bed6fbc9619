"""Tensor parallelism on real vLLM (CPU build, one core a rank): prefill TP 2 to decode
TP 2, and the mixed shapes TP 1 to TP 2 and TP 2 to TP 1, behind `kvpush router`.
Each decode rank takes exactly its KV heads from the prefill rank that holds them;
answers equal a plain instance's, every prompt token's KV arrives by transfer, and
nothing is held afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from conftest import PREFILL_TIMERS, Client, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SHAPES = {  # name: (prefill server, decode server)
    "tp2-to-tp2": ("tp2_prefill", "tp2_decode"),
    "tp1-to-tp2": ("prefill", "tp2_decode"),
    "tp2-to-tp1": ("tp2_prefill", "decode"),
}
EXTERNAL = 'source="external_kv_transfer"'


@pytest.fixture(scope="module")
def tp2(cluster):
    """A prefill and a decode instance at TP 2 (push), beside the session's TP 1 pair."""
    cluster.add_server("tp2_prefill", "kv_producer", core=0, tp=2, **PREFILL_TIMERS)
    # The default watchdog: a TP 2 engine's first forward pass on two busy cores takes
    # many seconds (its kernels are built then), longer than DECODE_TIMERS' 6 s.
    cluster.add_server("tp2_decode", "kv_consumer", core=1, tp=2, **PREFILL_TIMERS)
    try:
        cluster.start("tp2_prefill", "tp2_decode")
        yield
    finally:
        for name in ("tp2_prefill", "tp2_decode"):
            cluster.servers.pop(name).stop()


def _external(client: Client, url: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.http.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and EXTERNAL in line
    )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_decode_rank_gets_its_heads_and_answers_equal_a_plain_instance(
    cluster, client, tp2, shape
):
    prefill, decode = SHAPES[shape]
    identity = client.http.get(cluster.identity_url(prefill) + "/query").json()
    assert len(identity["addresses"]) == identity["tp_size"]  # every rank listed
    router = cluster.start_router([prefill], [decode], name=f"tp-{shape}")
    seed = 11000 + 100 * list(SHAPES).index(shape)
    lengths = (2, 127, 128, 129, 300, 700)
    prompts = [prompt(n, seed + i) for i, n in enumerate(lengths)]
    single = cluster.servers["single"].url
    expected = [client.tokens(single, p) for p in prompts]
    url = cluster.servers[decode].url
    before = _external(client, url), client.metric(url, "vllm:kvpush_delivered_total")
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: client.tokens(router, p), prompts))
    finally:
        cluster.stop_router(f"tp-{shape}")
    assert got == expected
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(url, "vllm:kvpush_delivered_total") < before[1] + len(prompts):
        assert time.monotonic() < deadline, "decode did not receive every prompt's KV"
        time.sleep(0.2)
    assert _external(client, url) - before[0] == sum(lengths)
    for name in (prefill, decode):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
