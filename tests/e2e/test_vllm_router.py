"""Behind the router users already run: vllm-router 0.1.17 (vLLM's own, from PyPI).

Its `nixl` mode is sequential at first: it sends the prefill leg, reads the answer's
kv_transfer_params and forwards them to decode. Seeing `transfer_mode: push` with
`remote_host` and `remote_port`, it keeps only those and the engine id, remembers
the instance, and from then on sends both legs at once with one X-Request-Id.
Its `mooncake` mode asks the prefill instance's bootstrap server who it is, then
sends both legs at once. Through each, in push and in pull mode, 1P1D and 1P2D:
answers equal a plain instance's, decode's prompt tokens came by transfer (and a
prefill with other K/V weights changes them), and nothing is held afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from pathlib import Path

import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, WRONG_KV, Client, perturbed_copy, prompt

from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

VLLM_ROUTER = str(Path(sys.executable).with_name("vllm-router"))
TOPOLOGIES = {  # name: (decode instances, policy)
    "1p1d": (1, "round_robin"),
    "1p2d-round-robin": (2, "round_robin"),
    "1p2d-cache-aware": (2, "cache_aware"),
}
SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "router_mode" in metafunc.fixturenames:
        metafunc.parametrize("router_mode", ["nixl", "mooncake"])


@pytest.fixture(scope="module", params=["push", "pull"])
def deployment(request, cluster):
    """A prefill (with a bootstrap server) and two decodes in `request.param` mode: the
    session's own pair and a second decode for push; a pair of their own for pull."""
    mode = request.param
    if mode == "push":
        names = {"prefill": "prefill", "decodes": ["decode", "router_decode2"]}
        added = ["router_decode2"]
    else:
        names = {"prefill": "pull_prefill", "decodes": ["pull_decode", "router_decode2"]}
        added = ["pull_prefill", "pull_decode", "router_decode2"]
        cluster.add_server(
            "pull_prefill", "kv_producer", core=0, mode="pull", bootstrap_port=free_port(),
            **PREFILL_TIMERS,
        )  # fmt: skip
        cluster.add_server("pull_decode", "kv_consumer", core=1, mode="pull", **DECODE_TIMERS)
    cluster.add_server("router_decode2", "kv_consumer", core=1, mode=mode, **DECODE_TIMERS)
    try:
        cluster.start(*added)
        yield {"mode": mode, **names}
    finally:
        for name in added:
            cluster.servers.pop(name).stop()


def _vllm_router(cluster, name: str, router_mode: str, prefill: str, decodes: list[str],
                 policy: str = "round_robin") -> str:  # fmt: skip
    """Start vllm-router in front of the named servers, as its README shows (its
    debug log says which requests it dispatched one leg after the other)."""
    port = free_port()
    command = [VLLM_ROUTER, "--vllm-pd-disaggregation", "--kv-connector", router_mode,
               "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "debug", "--prefill", cluster.servers[prefill].url]  # fmt: skip
    if router_mode == "mooncake":
        extra = cluster.servers[prefill].spec.kv_transfer_config["kv_connector_extra_config"]
        command.append(str(extra["bootstrap_port"]))
    for decode in decodes:
        command += ["--decode", cluster.servers[decode].url]
    return cluster.start_router_command(name, command, port)


def _sequential_dispatches(cluster, name: str) -> int:
    """How many requests router `name` sent prefill-then-decode (its "Stage 1" line)."""
    return (cluster.workdir / f"{name}.log").read_text(errors="replace").count("Stage 1 - Prefill")


def _sources(client: Client, urls: list[str]) -> dict[str, float]:
    """Decode prompt tokens by where their KV came from, summed over `urls`."""
    totals = dict.fromkeys(SOURCES, 0.0)
    for url in urls:
        for line in client.http.get(url + "/metrics").text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                totals[source] = totals.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _settled(
    client: Client, urls: list[str], metric: str, at_least: float, label: str = ""
) -> float:
    """A counter summed over `urls` (its series with `label` only, if given), once it
    reached `at_least` (it rides on the engines' steps) or 10 s passed."""
    deadline = time.monotonic() + 10
    while (total := sum(client.metric(u, metric, label) for u in urls)) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return total


def _drained(cluster, client: Client, names: list[str]) -> None:
    for name in names:
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_answers_equal_a_plain_instance_and_the_kv_moved(
    cluster, client, deployment, router_mode, topology
):
    count, policy = TOPOLOGIES[topology]
    decodes = deployment["decodes"][:count]
    urls = [cluster.servers[d].url for d in decodes]
    name = f"vllm-router-{deployment['mode']}-{router_mode}-{topology}"
    router = _vllm_router(cluster, name, router_mode, deployment["prefill"], decodes, policy)
    seed = 8000 + 100 * list(TOPOLOGIES).index(topology) + 1000 * (router_mode == "mooncake")
    seed += 5000 * (deployment["mode"] == "pull")
    prompts = [prompt(200 + 190 * i, seed + i) for i in range(6)]
    single = cluster.servers["single"].url
    expected = [client.tokens(single, p) for p in prompts]
    before = {
        "sources": _sources(client, urls),
        "delivered": sum(client.metric(u, "vllm:kvpush_delivered_total") for u in urls),
        "recomputed": sum(client.metric(u, "vllm:kvpush_local_recomputes_total") for u in urls),
    }
    try:
        first = client.tokens(router, prompts[0])  # nixl: sequential, learns the instance
        with cf.ThreadPoolExecutor(len(prompts) - 1) as pool:  # then both legs at once
            rest = list(pool.map(lambda p: client.tokens(router, p), prompts[1:]))
    finally:
        cluster.stop_router(name)
    assert [first, *rest] == expected
    delivered = _settled(client, urls, "vllm:kvpush_delivered_total", before["delivered"] + 6)
    assert delivered - before["delivered"] == len(prompts)
    recomputed = sum(client.metric(u, "vllm:kvpush_local_recomputes_total") for u in urls)
    assert recomputed == before["recomputed"]
    moved = {k: v - before["sources"][k] for k, v in _sources(client, urls).items()}
    # Every prompt token's KV came by transfer (vLLM counts the last one, which decode
    # computes again after a load, as transferred too).
    assert moved == {"external_kv_transfer": sum(len(p) for p in prompts),
                     "local_compute": 0, "local_cache_hit": 0}, moved  # fmt: skip
    if router_mode == "nixl":
        # Push: the first request taught it the instance; then both legs at once.
        sequential = 1 if deployment["mode"] == "push" else len(prompts)
        assert _sequential_dispatches(cluster, name) == sequential
    _drained(cluster, client, [deployment["prefill"], *decodes])


@pytest.fixture(scope="module")
def other_kv_prefill(cluster, deployment):
    """A prefill like the deployment's whose K/V projections differ: its KV is wrong."""
    name = f"router_other_kv_{deployment['mode']}"
    wrong = perturbed_copy(cluster.model, cluster.workdir / f"model-other-kv-{name}")
    cluster.add_server(
        name, "kv_producer", core=0, mode=deployment["mode"], model=wrong,
        bootstrap_port=free_port(), **PREFILL_TIMERS,
    )  # fmt: skip
    try:
        cluster.start(name)
        yield name
    finally:
        cluster.servers.pop(name).stop()


def test_a_prefill_with_other_kv_weights_changes_every_answer(
    cluster, client, deployment, router_mode, other_kv_prefill
):
    """The negative control: decode's answers come from the KV prefill computed."""
    decode = deployment["decodes"][0]
    router = _vllm_router(cluster, "vllm-router", router_mode, other_kv_prefill, [decode])
    seed = 9500 + 1000 * (router_mode == "mooncake") + 5000 * (deployment["mode"] == "pull")
    prompts = [prompt(300 + 150 * i, seed + i) for i in range(3)]
    single = cluster.servers["single"].url
    try:
        wrong = [client.tokens(router, p, **WRONG_KV) for p in prompts]
        changed = [got != client.tokens(single, p) for got, p in zip(wrong, prompts, strict=True)]
    finally:
        cluster.stop_router("vllm-router")
    assert all(changed), f"decode ignored the KV of prompts {changed}"
    # vllm-router passed the salt on to decode, which keeps the wrong KV apart.
    good = cluster.servers[deployment["prefill"]].url
    _, again = client.sequential(good, cluster.servers[decode].url, prompts[0])
    assert again == client.tokens(single, prompts[0]), "unsalted, decode found the wrong KV"
    _drained(cluster, client, [other_kv_prefill, decode])


def test_a_prefill_answer_nobody_forwards_is_released_after_the_grace(cluster, client, deployment):
    """An orchestrator that drops the echo (vllm-router did, before the echo carried
    upstream's fields): prefill lets the KV go after orphan_grace_s, not the lease,
    and says so in /metrics; a decode given no params says so too."""
    prefill = cluster.servers[deployment["prefill"]].url
    grace = PREFILL_TIMERS["orphan_grace_s"]
    # This reason only: KV other tests' decodes cancelled, or their routers released,
    # may be counted on the same prefill meanwhile.
    orphaned = ("vllm:kvpush_orphaned_total", 'reason="no_decode_announced"')
    before = client.metric(prefill, *orphaned)
    leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    seed = 9900 + 50 * (deployment["mode"] == "pull")
    answer = client.complete(prefill, prompt(400, seed), max_tokens=1, kv_transfer_params=leg)
    assert answer.status_code == 200, answer.text
    started = time.monotonic()
    state = client.wait_drained(cluster.identity_url(deployment["prefill"]), grace + 10)
    assert state == {"sending": 0, "producing": 0, "receiving": 0}, state
    assert time.monotonic() - started < grace + 10  # the grace, not the 60 s lease
    assert _settled(client, [prefill], orphaned[0], before + 1, orphaned[1]) == before + 1
    decode = cluster.servers["router_decode2"].url  # kv_consumer: every request a decode leg
    unforwarded = ("vllm:kvpush_orphaned_total", 'reason="no_kv_transfer_params"')
    before = client.metric(decode, *unforwarded)
    assert client.complete(decode, prompt(60, seed + 1)).status_code == 200
    assert _settled(client, [decode], unforwarded[0], before + 1, unforwarded[1]) == before + 1
