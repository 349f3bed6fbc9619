"""The two-host e2e suite's pair and checks (tests/e2e/test_vllm_two_hosts.py): a vLLM
prefill on host a and its decode on host b, held to UCX's TCP lane, and what every
test asserts of a request that crossed the link."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import netns
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt

from kvpush.demo.cluster import Cluster
from kvpush.demo.tinymodel import SHAPE, kv_bytes_per_token
from kvpush.transport.ucx_report import peer_lanes

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
    # Both sides' lease_s and registration_ttl_s; None: the defaults (60 s). The fault
    # tests shorten them, so that what a fault strands is let go within a test.
    lease_s: float | None = None
    link_timeout_s: float | None = None  # both sides'; None: the default (30 s)

    @property
    def timers(self) -> dict[str, float]:
        timers = {} if self.lease_s is None else {"lease_s": self.lease_s,
                                                  "registration_ttl_s": self.lease_s}  # fmt: skip
        if self.link_timeout_s is not None:
            timers["link_timeout_s"] = self.link_timeout_s
        return timers

    @property
    def tag(self) -> str:
        return "".join(f"_{name[:4]}{value:g}" for name, value in self.timers.items())


class TwoHostPair:
    """A prefill on host a and a decode on host b, in one shape at a time; a new shape
    restarts only the side it changes (two of either would not fit two cores)."""

    def __init__(self, cluster: Cluster, hosts: netns.TwoHosts) -> None:
        self.cluster, self.hosts = cluster, hosts
        self.prefill = self.decode = ""
        self.shape = Shape()

    def running(self, shape: Shape) -> None:
        prefill = f"hosts_prefill_{shape.mode}_tp{shape.prefill_tp}{shape.tag}"
        decode = f"hosts_decode_{shape.mode}{shape.tag}"
        wanted = [n for n, now in ((prefill, self.prefill), (decode, self.decode)) if n != now]
        for old in (self.prefill, self.decode):
            if old and old not in (prefill, decode):
                self.cluster.servers.pop(old).stop()
        self.prefill, self.decode, self.shape = prefill, decode, shape
        if prefill in wanted:
            self._add(prefill, self.hosts.a, "kv_producer", shape.mode, shape.prefill_tp,
                      **PREFILL_TIMERS, **shape.timers)  # fmt: skip
        if decode in wanted:
            self._add(decode, self.hosts.b, "kv_consumer", shape.mode, 1, **DECODE_TIMERS,
                      **shape.timers)  # fmt: skip
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
            # Only the link's device, as a machine pins its data NIC: UCX otherwise
            # also connects over the root namespace's link, and an accepting end that
            # UCX keeps no keepalive on outlives a partition, open on one side only.
            server.spec.env.update(UCX_TLS=UCX_TLS, UCX_NET_DEVICES=host.device)

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


# -- what every test checks -----------------------------------------------------------


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
    sources, sent = decode_sources(client, decode), pair.hosts.a.sent_bytes()
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
    crossed = pair.hosts.a.sent_bytes() - sent
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
        lanes = peer_lanes(log)
        reported += len(lanes)
        if lanes - {f"tcp/{host.device}"}:
            wrong.append(f"UCX on {side} reports {sorted(lanes)}, not tcp/{host.device} alone")
    return wrong if reported else ["no UCX endpoint reported its transports"]


def expected_tokens(client: Client, single: str, prompts: list[list[int]]) -> list[list[int]]:
    return [client.tokens(single, p) for p in prompts]


def concurrently(client: Client, url: str, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda p: client.tokens(url, p), prompts))
