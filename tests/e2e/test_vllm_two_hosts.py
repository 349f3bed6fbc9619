"""Two hosts for real: a vLLM prefill in one network namespace, its decode in another,
joined by a veth link, and the router and the plain instance (the oracle) in the root
namespace, reaching each at the address it advertises (tests/netns.py). No `host` is
set: each instance advertises its namespace's routable address by default.

UCX is held to TCP on the link's device on both servers (`UCX_TLS=tcp,self`,
`UCX_NET_DEVICES`): between the namespaces of one machine it would otherwise move the
KV through shared memory, and the link would carry none of it. Every test checks,
over push, its first-token streams, vllm-router's nixl mode, TP 2 to TP 1 and pull,
that
- the answers equal the plain instance's;
- every prompt token's KV arrived by transfer (decode's counters);
- nothing is held afterwards (/kvpush/state on both);
- the bytes crossed on UCX's TCP lane: UCX's own report of each endpoint's transports
  (`UCX_PROTO_INFO=y`, in the servers' logs) names the host-to-host link's TCP device
  and nothing else, and that link's byte counter rose by at least the KV's size.

The pull tests run first on a pull pair; TP 2 then restarts both in push, and the
push, first-token, vllm-router and fault tests share one push pair. Runs as root
(CI); elsewhere it skips, naming why.
`KVPUSH_TWO_HOSTS_UCX_TLS=unpinned` leaves UCX free to choose, to see the lane check
fail as it must.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import httpx
import netns
import network_faults as faults
import pytest
from conftest import DECODE_TIMERS, Client, prompt, streamed
from two_hosts import (
    COMPLETIONS,
    LENGTHS,
    VLLM_ROUTER,
    Shape,
    TwoHostPair,
    across_the_link,
    concurrently,
    decode_sources,
    expected_tokens,
)  # fmt: skip

from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import MODEL_NAME
from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.TwoHosts]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made = netns.TwoHosts(reachable=True)
    try:
        yield made.start()
    finally:
        made.close()


@pytest.fixture(scope="module")
def pair(workspace: Cluster, single: str, hosts: netns.TwoHosts) -> Iterator[TwoHostPair]:
    """The pair; `single` first, so that the oracle is up before the pair starts."""
    made = TwoHostPair(workspace, hosts)
    try:
        yield made
    finally:
        made.stop()


# -- the tests --------------------------------------------------------------------------
# Pull first, then TP 2 to TP 1, then push and the faults with one shape, so that the
# module starts five servers, not seven: push runs with the fault tests' timers
# (prefill's lease_s and registration_ttl_s at 10 s, both sides' link_timeout_s at
# 16 s), which no answer of the others waits on.
PUSH = Shape("push", lease_s=10.0, link_timeout_s=16.0)


def test_pull_answers_equal_a_plain_instance_and_the_kv_crossed_the_link(pair, client, single):
    """Decode READs the KV from host a once prefill has answered; a stream's first
    token comes from prefill here too."""
    pair.running(Shape("pull"))
    prompts = [prompt(n, 25000 + i) for i, n in enumerate(LENGTHS)]
    body = {"model": MODEL_NAME, "prompt": prompt(257, 25100), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    expected = expected_tokens(client, single, prompts)
    stream_expected = streamed(client, single, COMPLETIONS, body)
    router = pair.router("hosts-pull")
    try:
        with across_the_link(client, pair, [*prompts, body["prompt"]]):
            got = concurrently(client, router, prompts)
            stream = streamed(client, router, COMPLETIONS, body)
        from_decode = client.metric(router, "kvpush_first_token_from_decode_total")
    finally:
        pair.cluster.stop_router("hosts-pull")
    assert got == expected
    assert stream == stream_expected and from_decode == 0


def test_pull_reads_across_the_link_again_after_decodes_end_was_cut(pair, client, single):
    """Decode's end of the link down 2 s under pull load: no request hangs or answers
    other than plain, and once the link is back each prompt's KV crosses it again.
    (Decode posts a READ on the producer's word, which the cut holds back, so a READ
    is seldom caught in it; a READ that failed outright and the fresh endpoint after
    it are tested on real NIXL in tests/integration/test_protocol_nixl.py.)"""
    pair.running(Shape("pull"))
    router = pair.router("hosts-pull-cut")

    def cut() -> None:
        with faults.partitioned(pair.hosts.b):
            time.sleep(2.0)

    try:
        sent, struck, healed, recovered = _under_load(router, 26000, cut)
        assert _in_flight(sent, struck, healed) >= faults.LOAD_CLIENTS, "no load during the cut"
        wrong = faults.wrong_outcomes(sent, _plain_answers(client, single, sent))
        assert not wrong, wrong
        assert recovered < faults.BOUND_S, "no request answered after the link came back"
        prompts = [prompt(n, 26100 + i) for i, n in enumerate((129, 400, 700))]
        expected = expected_tokens(client, single, prompts)
        with across_the_link(client, pair, prompts):
            assert concurrently(client, router, prompts) == expected
    finally:
        pair.cluster.stop_router("hosts-pull-cut")


def test_tp2_prefill_feeds_a_tp1_decode_on_another_host(pair, client, single):
    """Each prefill rank writes its KV heads from host a into the one decode rank."""
    pair.running(dataclasses.replace(PUSH, prefill_tp=2))
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    assert identity["tp_size"] == 2 and len(identity["addresses"]) == 2
    assert {a.rpartition(":")[0] for a in identity["addresses"]} == {pair.hosts.a.address}
    prompts = [prompt(n, 24000 + i) for i, n in enumerate(LENGTHS)]
    expected = expected_tokens(client, single, prompts)
    assert _answered_across(client, pair, "hosts-tp", prompts) == expected


def test_push_answers_equal_a_plain_instance_and_the_kv_crossed_the_link(pair, client, single):
    pair.running(PUSH)
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    advertised = {address.rpartition(":")[0] for address in identity["addresses"]}
    assert advertised == {pair.hosts.a.address}, "not the namespace's routable address"
    prompts = [prompt(n, 21000 + i) for i, n in enumerate(LENGTHS)]
    expected = expected_tokens(client, single, prompts)
    assert _answered_across(client, pair, "hosts-push", prompts) == expected


def _answered_across(client, pair: TwoHostPair, name: str, prompts: list) -> list:
    """The prompts' answers, sent at once through a router `name` in front of the pair;
    each prompt's KV crossed the link."""
    router = pair.router(name)
    try:
        with across_the_link(client, pair, prompts):
            return concurrently(client, router, prompts)
    finally:
        pair.cluster.stop_router(name)


def test_push_streams_take_their_first_token_from_prefill(pair, client, single):
    """Greedy streams whose first token the router streams from the prefill leg, the
    rest from decode's: text, ids and logprobs as a plain instance streams them."""
    pair.running(PUSH)
    bodies = [
        {"model": MODEL_NAME, "prompt": prompt(n, 22000 + n), "max_tokens": 8, "temperature": 0,
         "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
        for n in (129, 256, 385)
    ]  # fmt: skip
    expected = [streamed(client, single, COMPLETIONS, body) for body in bodies]
    router = pair.router("hosts-first-token")
    try:
        with across_the_link(client, pair, [b["prompt"] for b in bodies]):
            got = [streamed(client, router, COMPLETIONS, body) for body in bodies]
        from_decode = client.metric(router, "kvpush_first_token_from_decode_total")
        unusable = client.metric(router, "kvpush_first_token_unusable_total")
    finally:
        pair.cluster.stop_router("hosts-first-token")
    assert got == expected
    assert (from_decode, unusable) == (0, 0), "a first token came from decode"


def _vllm_router_nixl(pair: TwoHostPair, name: str) -> str:
    """vllm-router in nixl mode in front of the pair, as its README shows."""
    port = free_port()
    command = [VLLM_ROUTER, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "debug", "--prefill", pair.url("prefill"),
               "--decode", pair.url("decode")]  # fmt: skip
    return pair.cluster.start_router_command(name, command, port)


def test_vllm_router_nixl_mode_moves_the_kv_across_the_link(pair, client, single):
    """Sequential for the first request (it learns the instance from the prefill
    answer's remote_host, prefill's own address), then both legs at once."""
    pair.running(PUSH)
    prompts = [prompt(200 + 190 * i, 23000 + i) for i in range(4)]
    expected = expected_tokens(client, single, prompts)
    router = _vllm_router_nixl(pair, "hosts-vllm-router")
    try:
        with across_the_link(client, pair, prompts):
            got = [client.tokens(router, prompts[0]), *concurrently(client, router, prompts[1:])]
    finally:
        pair.cluster.stop_router("hosts-vllm-router")
    assert got == expected
    log = (pair.cluster.workdir / "hosts-vllm-router.log").read_text(errors="replace")
    assert log.count("Stage 1 - Prefill") == 1, "not both legs at once after the first"


# -- network faults, under load (tests/e2e/network_faults.py) -------------------------
# Push, with prefill's lease_s and registration_ttl_s at 10 s so that what a fault
# strands is let go within a test, and link_timeout_s at 16 s, longer than the
# longest cut below (12 s), which the links outlive; decode's watchdog_s is
# DECODE_TIMERS' 6 s.
FAULT_SHAPE = PUSH
WATCHDOG_S = DECODE_TIMERS["watchdog_s"]
# What a fault may leave behind is gone by then: the lease, a WRITE's grace and a
# heartbeat, and the producer's silence rule (silence_s, 10 s by default).
SETTLE_S = FAULT_SHAPE.lease_s + DECODE_TIMERS["write_grace_s"] + 10.0
LEAD_S = 3.0  # load before a fault: requests in flight when it strikes


@pytest.fixture(scope="module")
def fault_router(pair: TwoHostPair, request: pytest.FixtureRequest) -> Iterator[str]:
    pair.running(FAULT_SHAPE)
    name = "hosts-faults"
    url = pair.cluster.start_router([pair.prefill], [pair.decode], mode="push",
                                    timeout_s=faults.ROUTER_TIMEOUT_S, name=name)  # fmt: skip
    try:
        yield url
    finally:
        pair.cluster.stop_router(name)
        table = ["| fault | for | what each request got | recovered in | held after |",
                 "|---|---|---|---|---|", *FAULT_TABLE]  # fmt: skip
        print("\n".join(["", *table]))
        # Kept where a run under xdist (whose output is captured) can still be read:
        # pytest --cache-show kvpush/two_hosts_faults
        request.config.cache.set("kvpush/two_hosts_faults", table)


FAULT_TABLE: list[str] = []


def _under_load(router: str, seed: int, fault, healed_by: float = 30.0):
    """Load through `router`; `fault()` (a context manager) after LEAD_S; the load goes
    on until a request sent after the fault answers 200 (or `healed_by` seconds).
    The requests, the fault's start and end, and the seconds to that first answer."""
    with faults.Load(router, seed) as load:
        time.sleep(LEAD_S)
        struck = time.monotonic()
        fault()
        healed = time.monotonic()
        deadline = healed + healed_by
        while time.monotonic() < deadline and not any(
            s.sent >= healed and s.status == 200 for s in list(load.sent)
        ):
            time.sleep(0.2)
    after = [s.ended - healed for s in load.sent if s.sent >= healed and s.status == 200]
    recovered = min(after) if after else float("inf")
    return load.sent, struck, healed, recovered


def _plain_answers(client: Client, single: str, sent: list[faults.Sent]) -> dict:
    return {tuple(s.tokens): client.tokens(single, s.tokens, max_tokens=faults.MAX_TOKENS)
            for s in sent if s.status == 200}  # fmt: skip


def _in_flight(sent: list[faults.Sent], start: float, end: float) -> int:
    return sum(1 for s in sent if s.sent < end and s.ended > start)


def _after_healing(client: Client, pair: TwoHostPair, router: str, single: str, seed: int) -> str:
    """New requests move their KV across the link (decode's counters, the lane); then
    nothing is held on either side and no connection is open on one side only. What
    is held, for the fault table."""
    prompts = [prompt(n, seed + i) for i, n in enumerate((129, 400, 700))]
    expected = expected_tokens(client, single, prompts)
    with across_the_link(client, pair, prompts):
        assert concurrently(client, router, prompts) == expected
    held = {side: client.wait_drained(pair.cluster.identity_url(getattr(pair, side)), SETTLE_S)
            for side in ("prefill", "decode")}  # fmt: skip
    assert all(
        state == {"sending": 0, "producing": 0, "receiving": 0} for state in held.values()
    ), held
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    side_channels = set(identity["addresses"])

    def stranded() -> list[faults.OneSided]:
        """One-sided connections that should have gone: a side channel, or any that
        the kernel probes. UCX's TCP transport keeps no keepalive on the connections
        it accepts, and one whose other end went during the cut is never probed and
        stays (docs/two-hosts.md): that is UCX's, counted, not asserted."""
        return [c for c in faults.half_open(pair.hosts.a, pair.hosts.b)
                if c.kept_alive or side_channels & {c.local, c.peer}]  # fmt: skip

    left = faults.until(stranded, SETTLE_S)
    assert not left, [str(c) for c in left]
    ucx = faults.half_open(pair.hosts.a, pair.hosts.b)
    return "0 / 0 / 0 on both; " + (
        f"UCX keeps {len(ucx)} unprobed connection(s) one-sided" if ucx
        else "no one-sided connection"
    )  # fmt: skip


@pytest.mark.parametrize("cut_s", [2.0, 12.0], ids=["shorter-than-watchdog", "longer"])
def test_a_partition_of_prefills_link_under_load_ends_every_request(
    pair, client, single, fault_router, cut_s
):
    """Prefill's end of the host-to-host link down `cut_s`, then up. Either way a
    request caught in it may fail, naming its cause (UCX fails a WRITE whose route
    went: write_failed); shorter than decode's watchdog, none fails on the watchdog;
    longer, some fail."""

    def cut() -> None:
        with faults.partitioned(pair.hosts.a):
            time.sleep(cut_s)

    seed = 31000 + int(cut_s) * 100
    sent, struck, healed, recovered = _under_load(fault_router, seed, cut)
    assert _in_flight(sent, struck, healed) >= faults.LOAD_CLIENTS, "no load during the cut"
    wrong = faults.wrong_outcomes(sent, _plain_answers(client, single, sent))
    assert not wrong, wrong
    if cut_s < WATCHDOG_S:
        assert not [s.error for s in sent if "watchdog" in s.error]
    else:
        assert any(s.status != 200 for s in sent), "no transfer outlived the watchdog's cut"
    assert recovered < faults.BOUND_S, "no request answered after the link came back"
    held = _after_healing(client, pair, fault_router, single, seed + 90)
    FAULT_TABLE.append(faults.table_row(f"partition of prefill's link ({cut_s:g}s)", cut_s,
                                        sent, recovered, held))  # fmt: skip


def test_a_slow_link_under_load_answers_every_request(pair, client, single, fault_router):
    """Prefill's sends held to 100 Mbit/s (tbf): slower, but every answer is plain's
    and every answered prompt's KV crossed (decode's counters)."""
    decode = pair.url("decode")
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    moved = decode_sources(client, decode)["external_kv_transfer"]

    def slow() -> None:
        with faults.slowed(pair.hosts.a):
            time.sleep(8.0)

    sent, struck, healed, recovered = _under_load(fault_router, 33000, slow)
    assert _in_flight(sent, struck, healed) >= faults.LOAD_CLIENTS, "no load on the slow link"
    wrong = faults.wrong_outcomes(sent, _plain_answers(client, single, sent))
    assert not wrong, wrong
    assert all(s.status == 200 for s in sent), [s.error for s in sent if s.status != 200]
    counted = faults.until(
        lambda: client.metric(decode, "vllm:kvpush_delivered_total") < delivered + len(sent), 10
    )
    assert not counted, "an answered request's KV did not arrive by transfer"
    tokens = decode_sources(client, decode)["external_kv_transfer"] - moved
    assert tokens == sum(len(s.tokens) for s in sent)
    held = _after_healing(client, pair, fault_router, single, 33900)
    FAULT_TABLE.append(faults.table_row("prefill's link at 100 Mbit/s", healed - struck, sent,
                                        recovered, held))  # fmt: skip


def test_a_vanishing_prefill_host_ends_every_request(pair, client, single, fault_router):
    """Prefill's host goes away under load as a machine whose power goes does: its
    links first, so that no FIN or RST of its reaches decode, then its processes.
    Every request ends within the bound, new ones at once, naming prefill; decode
    lets go of everything and drops its side channel to the vanished host once that
    host has acknowledged nothing for link_timeout_s. (UCX's own TCP connections to
    it are UCX's to end: docs/troubleshooting.md.) Last in the module: the pair's
    prefill is gone."""
    vanished = pair.cluster.servers[pair.prefill]
    gone = faults.addresses_of(pair.hosts.a)  # before its links, and addresses, go
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    side_channels = set(identity["addresses"])

    def vanish() -> None:
        faults.vanish(pair.hosts.a, pair.hosts.b)
        vanished.kill()  # reaped: the process is gone already
        time.sleep(3.0)

    sent, struck, healed, _ = _under_load(fault_router, 34000, vanish, healed_by=3.0)
    assert _in_flight(sent, struck, healed) >= faults.LOAD_CLIENTS, "no load when it vanished"
    wrong = faults.wrong_outcomes(sent, _plain_answers(client, single, sent))
    assert not wrong, wrong
    # Asked afresh, not read off the load: on a slow machine its clients may all
    # still be in requests sent before the host went.
    with httpx.Client(timeout=faults.DEADLINE_S) as http:
        afterwards = [faults.ask(http, fault_router, prompt(300, 34900 + i)) for i in range(3)]
    assert all(s.status != 200 and "prefill" in s.error for s in afterwards), afterwards
    assert max(s.seconds for s in afterwards) < WATCHDOG_S, "a request to a gone host waited"
    decode = pair.cluster.identity_url(pair.decode)
    held = client.wait_drained(decode, SETTLE_S)
    assert held == {"sending": 0, "producing": 0, "receiving": 0}, held

    def links_kept() -> set[tuple[str, str]]:
        return {c for c in faults.tcp_between(pair.hosts.b, gone) if c[1] in side_channels}

    # The link's silence began when the host vanished, before the checks above.
    kept = faults.until(links_kept, FAULT_SHAPE.link_timeout_s)
    assert not kept, f"decode keeps its side channel to the vanished host: {kept}"
    assert client.http.get(pair.url("decode") + "/health").status_code == 200
    row = faults.table_row("prefill's host vanishes", healed - struck, sent, float("inf"),
                           "decode 0 / 0 / 0; no side channel to it")  # fmt: skip
    FAULT_TABLE.append(row)
