"""Tensor parallelism on real vLLM (CPU build, one core a rank): prefill TP 2 to decode
TP 2 (push and pull), and the mixed shapes TP 1 to TP 2 and TP 2 to TP 1, behind
`kvpush router`.
Each decode rank takes exactly its KV heads from the prefill rank that holds them;
answers equal a plain instance's, every prompt token's KV arrives by transfer, and
nothing is held afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from conftest import PREFILL_TIMERS, Client, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SHAPES = {  # name: (transfer mode, prefill server, decode server)
    "tp2-to-tp2": ("push", "tp2_prefill", "tp2_decode"),
    "tp1-to-tp2": ("push", "prefill", "tp2_decode"),
    "tp2-to-tp1": ("push", "tp2_prefill", "decode"),
    "tp2-to-tp2-pull": ("pull", "tp2_prefill", "tp2_decode"),
}
EXTERNAL = 'source="external_kv_transfer"'
TP2 = ("tp2_prefill", "tp2_decode")


class _TP2Pair:
    """A prefill and a decode instance at TP 2, beside the session's TP 1 pair, in one
    transfer mode at a time: two TP 2 pairs would not fit this machine's cores."""

    def __init__(self, cluster) -> None:
        self.cluster, self.mode = cluster, ""

    def running(self, mode: str) -> None:
        if mode == self.mode:
            return
        self.stop()
        self.cluster.add_server("tp2_prefill", "kv_producer", core=0, tp=2, mode=mode,
                                **PREFILL_TIMERS)  # fmt: skip
        # The default watchdog: a TP 2 engine's first forward pass on two busy cores
        # takes many seconds (its kernels are built then), longer than DECODE_TIMERS'.
        self.cluster.add_server("tp2_decode", "kv_consumer", core=1, tp=2, mode=mode,
                                **PREFILL_TIMERS)  # fmt: skip
        self.mode = mode
        self.cluster.start(*TP2)
        # A TP 2 engine's first forward pass builds its kernels, for many seconds on two
        # busy cores: done here, each engine on its own, so that no transfer's watchdog
        # waits on it (one expired in CI while other modules loaded the cores).
        client = Client()
        try:
            for name in TP2:
                client.tokens(self.cluster.servers[name].url, prompt(300, 10999), max_tokens=2)
        finally:
            client.http.close()

    def stop(self) -> None:
        for name in TP2:
            server = self.cluster.servers.pop(name, None)
            if server is not None:
                server.stop()
        self.mode = ""


@pytest.fixture(scope="module")
def tp2(cluster):
    pair = _TP2Pair(cluster)
    try:
        yield pair
    finally:
        pair.stop()


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
    mode, prefill, decode = SHAPES[shape]
    tp2.running(mode)
    identity = client.http.get(cluster.identity_url(prefill) + "/query").json()
    assert len(identity["addresses"]) == identity["tp_size"]  # every rank listed
    router = cluster.start_router([prefill], [decode], mode=mode, name=f"tp-{shape}")
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
