"""xPyD on one machine: two prefill instances and one decode, one prefill and two
decode instances, and a data-parallel prefill, behind `kvpush router`. Answers equal a
plain instance's, the load reaches every instance (each one's scheduler takes part
in some transfers), and decode receives every prompt's KV by transfer."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt

from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def _seen(client: Client, cluster, name: str) -> set[str]:
    """The transfers an instance's scheduler has taken part in (GET /kvpush/trace), as
    soon as it has: vLLM's own counters from an engine that went idle wait for its
    next step."""
    url = cluster.identity_url(name) + "/kvpush/trace?last=512"
    return {trace["transfer_id"] for trace in client.http.get(url).json()}


def _spread(client: Client, cluster, router: str, instances: list[str], seed: int) -> None:
    """Eight concurrent requests through `router`: every answer a plain instance's, every
    one of `instances` took part in some, and the decode instances among them received
    all eight prompts' KV by transfer."""
    single = cluster.servers["single"].url
    prompts = [prompt(200 + 40 * i, seed + i) for i in range(8)]
    expected = [client.tokens(single, p) for p in prompts]
    decoders = [cluster.servers[n].url for n in instances if n.startswith("decode")]

    def delivered() -> float:
        return sum(client.metric(url, "vllm:kvpush_delivered_total") for url in decoders)

    before = {name: _seen(client, cluster, name) for name in instances}
    delivered_before = delivered()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: client.tokens(router, p), prompts))
    assert got == expected
    # An instance traces a transfer once it has let it go, which can come a little
    # after the answers (a prefill's release rides on its engine's next step).
    deadline = time.monotonic() + 10
    while True:
        moved = {name: len(_seen(client, cluster, name) - before[name]) for name in instances}
        if all(moved.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(moved.values()), f"instances the load did not reach: {moved}"
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while delivered() < delivered_before + len(prompts) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert delivered() == delivered_before + len(prompts)
    for name in instances:
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_two_prefill_instances_and_one_decode(cluster, client):
    cluster.add_server("prefill2", "kv_producer", core=0, **PREFILL_TIMERS)
    try:
        cluster.start("prefill2")
        router = cluster.start_router(["prefill", "prefill2"], ["decode"], name="2p1d")
        _spread(client, cluster, router, ["prefill", "prefill2", "decode"], seed=3000)
    finally:
        cluster.stop_router("2p1d")
        cluster.servers.pop("prefill2").stop()


def test_one_prefill_instance_and_two_decode(cluster, client):
    cluster.add_server("decode2", "kv_consumer", core=1, **DECODE_TIMERS)
    try:
        cluster.start("decode2")
        router = cluster.start_router(["prefill"], ["decode", "decode2"], name="1p2d")
        _spread(client, cluster, router, ["prefill", "decode", "decode2"], seed=3100)
    finally:
        cluster.stop_router("1p2d")
        cluster.servers.pop("decode2").stop()


def test_a_data_parallel_prefill_instance_serves_from_each_rank(cluster, client):
    """--data-parallel-size 2: two engines behind one API server, each with its own
    identity and side channels; the router pins each prefill leg to the rank whose
    engine its decode leg names, so every prompt's KV arrives (none recomputed)."""
    bootstrap_port = free_port()
    cluster.add_server(
        "prefill_dp", "kv_producer", core=0, dp=2, bootstrap_port=bootstrap_port, **PREFILL_TIMERS
    )
    decode = cluster.servers["decode"].url
    recomputed = "vllm:kvpush_local_recomputes_total"
    try:
        cluster.start("prefill_dp")
        ranks = [client.state(cluster.identity_url("prefill_dp", d)) for d in range(2)]
        assert all(r == {"sending": 0, "producing": 0, "receiving": 0} for r in ranks), ranks
        router = cluster.start_router(["prefill_dp"], ["decode"], name="dp2")
        delivered = "vllm:kvpush_delivered_total"
        before = {m: client.metric(decode, m) for m in (recomputed, delivered)}
        _spread(client, cluster, router, ["decode"], seed=3200)
        # One at a time too: vLLM's balancer places an unpinned leg by its own view of
        # the engines' load, which need not be the rank the decode leg names. Without
        # the router's pins, one run of four here put legs on the other rank (decode
        # then recomputed those prompts, so fewer were delivered); in the others the
        # balancer agreed by chance. The router unit test catches a missing pin always.
        single = cluster.servers["single"].url
        for i in range(4):
            tokens = prompt(300 + 20 * i, 3300 + i)
            expected = client.tokens(single, tokens)
            time.sleep(1.0)  # both engines idle again in the balancer's view
            assert client.tokens(router, tokens) == expected
        # Every prompt's KV crossed from the rank its decode leg named: none recomputed.
        assert client.metric(decode, recomputed) == before[recomputed]
        assert client.metric(decode, delivered) - before[delivered] == 8 + 4
        _mooncake_leg_to_dp_rank_1(client, cluster, f"http://127.0.0.1:{bootstrap_port}")
        for d in range(2):
            url = cluster.identity_url("prefill_dp", d)
            assert client.wait_drained(url) == {"sending": 0, "producing": 0, "receiving": 0}
            traces = client.http.get(url + "/kvpush/trace?last=100").json()
            assert traces, f"DP rank {d} computed no prompt"
    finally:
        cluster.stop_router("dp2")
        cluster.servers.pop("prefill_dp").stop()


def _mooncake_leg_to_dp_rank_1(client: Client, cluster, bootstrap: str) -> None:
    """A Mooncake-mode router: DP rank 0's bootstrap answers for both ranks, and both
    legs at once — prefill pinned to rank 1, decode naming rank 1's engine and only
    the bootstrap server — move rank 1's KV."""
    entries = client.http.get(bootstrap + "/query").json()
    assert sorted(entries) == ["0", "1"], entries
    for d in range(2):
        identity = client.http.get(cluster.identity_url("prefill_dp", d) + "/query").json()
        assert entries[str(d)]["engine_id"] == identity["engine_id"]
        assert entries[str(d)]["engine_id"].endswith(f"_dp{d}")
    prefill, decode = cluster.servers["prefill_dp"].url, cluster.servers["decode"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    tokens = prompt(460, 3600)
    transfer = {"transfer_id": "xfer-dp-mooncake"}
    prefill_leg = {**transfer, "do_remote_decode": True, "do_remote_prefill": False}
    decode_leg = {**transfer, "do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": entries["1"]["engine_id"],
                  "remote_bootstrap_addr": bootstrap}  # fmt: skip
    with cf.ThreadPoolExecutor(2) as pool:
        pin = {"X-data-parallel-rank": "1"}
        first = pool.submit(
            client.complete, prefill, tokens, 1, pin, kv_transfer_params=prefill_leg
        )
        second = pool.submit(client.complete, decode, tokens, 12, kv_transfer_params=decode_leg)
        answers = first.result(), second.result()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    got = answers[1].json()["choices"][0]["token_ids"]
    assert got == client.tokens(cluster.servers["single"].url, tokens)
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + 1
