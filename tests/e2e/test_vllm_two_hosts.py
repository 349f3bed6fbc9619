"""Two hosts for real: a vLLM prefill in one network namespace, its decode in another,
joined by a veth link, and the router and the plain instance (the oracle) in the root
namespace, reaching each at the address it advertises (tests/netns.py). No `host` is
set: each instance advertises its namespace's routable address by default.

UCX is held to TCP on both servers (`UCX_TLS=tcp,self`): between the namespaces of one
machine it would otherwise move the KV through shared memory, and the link would
carry none of it. Every test checks, over push, its first-token streams, vllm-router's
nixl mode, TP 2 to TP 1 and pull, that
- the answers equal the plain instance's;
- every prompt token's KV arrived by transfer (decode's counters);
- nothing is held afterwards (/kvpush/state on both);
- the bytes crossed on UCX's TCP lane: UCX's own report of each endpoint's transports
  (`UCX_PROTO_INFO=y`, in the servers' logs) names the host-to-host link's TCP device
  and nothing else, and that link's byte counter rose by at least the KV's size.

One pair serves the push, first-token and vllm-router tests; only TP 2 restarts the
prefill, and pull both. Runs as root (CI); elsewhere it skips, naming why.
`KVPUSH_TWO_HOSTS_UCX_TLS=unpinned` leaves UCX free to choose, to see the lane check
fail as it must.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import netns
import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt, streamed

from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import MODEL_NAME
from kvpush.demo.tinymodel import SHAPE, kv_bytes_per_token
from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

UCX_TLS = os.environ.get("KVPUSH_TWO_HOSTS_UCX_TLS", "tcp,self")
# UCX prints the protocols it chose for each endpoint, with their transports.
UCX_REPORT = {"UCX_PROTO_INFO": "y"}
KV_BYTES_PER_TOKEN = kv_bytes_per_token(SHAPE)  # fp32, as the servers run
# 2 tokens to several 128-token blocks, with a block's edges.
LENGTHS = (2, 127, 128, 129, 300, 700)
SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")
VLLM_ROUTER = str(Path(sys.executable).with_name("vllm-router"))
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Shape:
    """What runs on the two hosts: prefill on `a` at `prefill_tp`, decode on `b`."""

    mode: str = "push"
    prefill_tp: int = 1


class TwoHostPair:
    """A prefill on host a and a decode on host b, in one shape at a time; a new shape
    restarts only the side it changes (two of either would not fit two cores)."""

    def __init__(self, cluster: Cluster, hosts: netns.TwoHosts) -> None:
        self.cluster, self.hosts = cluster, hosts
        self.prefill = self.decode = ""
        self.shape = Shape()

    def running(self, shape: Shape) -> None:
        prefill = f"hosts_prefill_{shape.mode}_tp{shape.prefill_tp}"
        decode = f"hosts_decode_{shape.mode}"
        wanted = [n for n, now in ((prefill, self.prefill), (decode, self.decode)) if n != now]
        for old in (self.prefill, self.decode):
            if old and old not in (prefill, decode):
                self.cluster.servers.pop(old).stop()
        self.prefill, self.decode, self.shape = prefill, decode, shape
        if prefill in wanted:
            self._add(prefill, self.hosts.a, "kv_producer", shape.mode, shape.prefill_tp,
                      **PREFILL_TIMERS)  # fmt: skip
        if decode in wanted:
            self._add(decode, self.hosts.b, "kv_consumer", shape.mode, 1, **DECODE_TIMERS)
        if wanted:
            self.cluster.start(*wanted)
        if prefill in wanted and shape.prefill_tp > 1:
            # A TP 2 engine's first forward pass builds its kernels for many seconds:
            # done here, so that no transfer's watchdog waits on it.
            warm = Client()
            try:
                warm.tokens(self.cluster.servers[prefill].url, prompt(300, 10999), max_tokens=2)
            finally:
                warm.http.close()

    def _add(self, name: str, host: netns.Host, role: str, mode: str, tp: int, **timers) -> None:
        core = 0 if host is self.hosts.a else 1  # a TP 2 server takes both
        server = self.cluster.add_server(name, role, core=core, mode=mode, tp=tp, **timers)
        server.spec.host, server.spec.launcher = host.address, host.command([])
        server.spec.env.update(UCX_REPORT)
        if UCX_TLS != "unpinned":
            server.spec.env["UCX_TLS"] = UCX_TLS

    def stop(self) -> None:
        for name in (self.prefill, self.decode):
            server = self.cluster.servers.pop(name, None)
            if server is not None:
                server.stop()
        self.prefill = self.decode = ""

    def url(self, side: str) -> str:
        return self.cluster.servers[getattr(self, side)].url

    def router(self, name: str) -> str:
        return self.cluster.start_router(
            [self.prefill], [self.decode], mode=self.shape.mode, name=name
        )


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


# -- what every test checks -----------------------------------------------------------


def link_sent_bytes(host: netns.Host) -> int:
    """Bytes `host` has sent on its end of the host-to-host link."""
    shown = subprocess.run(
        ["ip", "-j", "-s", "-n", host.namespace, "link", "show", "dev", host.device],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"]


TABLE_TITLE = re.compile(r"\s(\S+) cfg#\d+\s*\|")  # "| kvpush-1f2e- inter-node cfg#1 |"
TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([\w.:-]+)")  # "tcp/eth0", "cma/memory"


def ucx_peer_lanes(log: str) -> set[str]:
    """The transports UCX reported (UCX_PROTO_INFO) for remote memory writes and reads
    to another process: its tables for "intra-node" and "inter-node" endpoints, not
    for this process's own ("self")."""
    lanes: set[str] = set()
    scope, rma = "", False
    for line in log.splitlines():
        if (title := TABLE_TITLE.search(line)) is not None:
            scope, rma = title.group(1), False
        elif "remote memory write" in line or "remote memory read" in line:
            rma = True
        elif "active message" in line:
            rma = False
        elif scope and scope != "self" and rma and line.rstrip().endswith("|"):
            lanes |= {m.group(0) for m in TRANSPORT.finditer(line.rsplit("|", 2)[-2])}
    return lanes


def decode_sources(client: Client, url: str) -> dict[str, float]:
    """Decode's prompt tokens by where their KV came from."""
    totals = dict.fromkeys(SOURCES, 0.0)
    for line in client.http.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            totals[source] = totals.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


@contextlib.contextmanager
def across_the_link(client: Client, pair: TwoHostPair, prompts: list[list[int]]) -> Iterator[None]:
    """Asserts, after the block's requests (`prompts`, each once, through the pair),
    that each prompt's KV arrived by transfer, across the link on UCX's TCP lane, and
    that neither side holds anything afterwards."""
    decode = pair.url("decode")
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    sources, sent = decode_sources(client, decode), link_sent_bytes(pair.hosts.a)
    yield
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(decode, "vllm:kvpush_delivered_total") < delivered + len(prompts):
        assert time.monotonic() < deadline, "decode did not receive every prompt's KV"
        time.sleep(0.2)
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + len(prompts)
    moved = {k: v - sources[k] for k, v in decode_sources(client, decode).items()}
    # vLLM counts the last prompt token, which decode computes again, as transferred.
    tokens = sum(len(p) for p in prompts)
    assert moved == {"external_kv_transfer": tokens, "local_compute": 0,
                     "local_cache_hit": 0}, moved  # fmt: skip
    for side in ("prefill", "decode"):
        state = client.wait_drained(pair.cluster.identity_url(getattr(pair, side)))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (side, state)
    # Every prompt token's KV but the last, which decode computes again, must cross.
    least = sum(len(p) - 1 for p in prompts) * KV_BYTES_PER_TOKEN
    crossed = link_sent_bytes(pair.hosts.a) - sent
    wrong = off_the_tcp_lane(pair)
    if crossed < least:
        wrong.append(f"prefill's host sent {crossed} bytes on the link, less than the KV's {least}")
    assert not wrong, wrong


def off_the_tcp_lane(pair: TwoHostPair) -> list[str]:
    """What UCX reported other than TCP on the host-to-host link for the remote
    memory writes and reads between the two servers, or that it reported none."""
    reported, wrong = 0, []
    for side, host in (("prefill", pair.hosts.a), ("decode", pair.hosts.b)):
        log = pair.cluster.servers[getattr(pair, side)].log_path.read_text(errors="replace")
        lanes = ucx_peer_lanes(log)
        reported += len(lanes)
        if lanes - {f"tcp/{host.device}"}:
            wrong.append(f"UCX on {side} reports {sorted(lanes)}, not tcp/{host.device} alone")
    return wrong if reported else ["no UCX endpoint reported its transports"]


def expected_tokens(client: Client, single: str, prompts: list[list[int]]) -> list[list[int]]:
    return [client.tokens(single, p) for p in prompts]


def concurrently(client: Client, url: str, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda p: client.tokens(url, p), prompts))


# -- the tests --------------------------------------------------------------------------


def test_push_answers_equal_a_plain_instance_and_the_kv_crossed_the_link(pair, client, single):
    pair.running(Shape("push"))
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    advertised = {address.rpartition(":")[0] for address in identity["addresses"]}
    assert advertised == {pair.hosts.a.address}, "not the namespace's routable address"
    prompts = [prompt(n, 21000 + i) for i, n in enumerate(LENGTHS)]
    expected = expected_tokens(client, single, prompts)
    router = pair.router("hosts-push")
    try:
        with across_the_link(client, pair, prompts):
            got = concurrently(client, router, prompts)
    finally:
        pair.cluster.stop_router("hosts-push")
    assert got == expected


def test_push_streams_take_their_first_token_from_prefill(pair, client, single):
    """Greedy streams whose first token the router streams from the prefill leg, the
    rest from decode's: text, ids and logprobs as a plain instance streams them."""
    pair.running(Shape("push"))
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
    pair.running(Shape("push"))
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


def test_tp2_prefill_feeds_a_tp1_decode_on_another_host(pair, client, single):
    """Each prefill rank writes its KV heads from host a into the one decode rank."""
    pair.running(Shape("push", prefill_tp=2))
    identity = client.http.get(pair.cluster.identity_url(pair.prefill) + "/query").json()
    assert identity["tp_size"] == 2 and len(identity["addresses"]) == 2
    assert {a.rpartition(":")[0] for a in identity["addresses"]} == {pair.hosts.a.address}
    prompts = [prompt(n, 24000 + i) for i, n in enumerate(LENGTHS)]
    expected = expected_tokens(client, single, prompts)
    router = pair.router("hosts-tp")
    try:
        with across_the_link(client, pair, prompts):
            got = concurrently(client, router, prompts)
    finally:
        pair.cluster.stop_router("hosts-tp")
    assert got == expected


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
