"""Two kvpush nodes on two simulated hosts (network namespaces joined by a veth link,
tests/netns.py), with UCX held to TCP so the KV crosses the link: the address each
advertises by default, a transfer across, a loopback address refused, and a host that
vanished let go of.
"""

from __future__ import annotations

import functools
import subprocess
import time

import pytest
from conftest import RemotePeer

pytestmark = pytest.mark.nixl

FAST = {"write_grace_s": 1.0, "watchdog_s": 20.0, "heartbeat_s": 0.5}
BLOCK_BYTES = 1 << 20
BLOCKS = [0, 1, 2, 3]
LAYERS = 2
# UCX would otherwise move the bytes through shared memory between the namespaces
# of one machine, and the link would carry none of them.
TCP_ONLY = {"UCX_TLS": "tcp,self"}


def _init(peer: RemotePeer, role: str, engine_id: str, **kwargs) -> dict:
    return peer.call(
        "init", kind="node", role=role, engine_id=engine_id, blocks=8,
        block_bytes=BLOCK_BYTES, layers=LAYERS, **{**FAST, **kwargs},
    )  # fmt: skip


def _one(peer: RemotePeer, seconds: float = 20.0) -> dict:
    outcomes = peer.call("results", count=1, seconds=seconds, timeout=seconds + 30)["outcomes"]
    assert outcomes, "no outcome arrived"
    return outcomes[0]


@pytest.fixture
def spawn():
    peers: list[RemotePeer] = []

    def start(**kwargs) -> RemotePeer:
        peers.append(RemotePeer(**kwargs))
        return peers[-1]

    yield start
    for peer in peers:
        peer.kill()


def test_a_producer_elsewhere_advertising_loopback_is_refused_before_any_dial(spawn):
    """One machine: the consumer is told the producer's loopback leads elsewhere."""
    producer, consumer = spawn(), spawn()
    address = _init(producer, "producer", "prefill")["address"]
    _init(consumer, "consumer", "decode", network="another-host")
    consumer.call("expect", tid="t1", producer=address, blocks=BLOCKS, network="the-producers")
    outcome = _one(consumer)
    assert (outcome["kind"], outcome["reason"]) == ("failed", "handshake_failed")
    detail = outcome["detail"]
    assert f"side channel at {address}, a loopback address" in detail
    assert "another host (or network namespace)" in detail
    assert "'host' setting" in detail and "$VLLM_HOST_IP" in detail
    assert producer.call("stats")["metrics"].get("handshakes", {}) == {}, "it was dialled"


def test_one_network_may_use_loopback(spawn):
    producer, consumer = spawn(), spawn()
    hello = _init(producer, "producer", "prefill")
    _init(consumer, "consumer", "decode")
    consumer.call("expect", tid="t1", producer=hello["address"], blocks=BLOCKS,
                  network=hello["network"])  # fmt: skip
    producer.call("kv_ready", tid="t1", blocks=BLOCKS, value=7)
    assert _one(consumer)["kind"] == "delivered"
    # One machine, UCX left to choose: shared memory, WRITEs side by side.
    paired = producer.call("stats")["metrics"]["paired_consumers"]
    assert paired == {"write_order=side_by_side": 1}, paired


def test_each_host_advertises_its_own_address_and_the_kv_crosses_the_link(two_hosts, spawn):
    prefill, decode = two_hosts.a, two_hosts.b
    producer = spawn(start=functools.partial(two_hosts.popen, prefill), **TCP_ONLY)
    consumer = spawn(start=functools.partial(two_hosts.popen, decode), **TCP_ONLY)
    hello = _init(producer, "producer", "prefill", host=None)
    consumer_hello = _init(consumer, "consumer", "decode", host=None)
    assert hello["address"].rpartition(":")[0] == prefill.address
    assert hello["network"] != consumer_hello["network"], "two namespaces, two loopbacks"
    before = prefill.sent_bytes()
    consumer.call("expect", tid="t1", producer=hello["address"], blocks=BLOCKS,
                  network=hello["network"])  # fmt: skip
    producer.call("kv_ready", tid="t1", blocks=BLOCKS, value=0x5A)
    outcome = _one(consumer)
    assert outcome["kind"] == "delivered", outcome
    values = consumer.call("values")["values"]
    assert all(values[layer][block] == [0x5A] for layer in range(LAYERS) for block in BLOCKS)
    kv_bytes = LAYERS * len(BLOCKS) * BLOCK_BYTES
    assert prefill.sent_bytes() - before >= kv_bytes, "the KV did not cross the link"
    # Over TCP, one consumer's WRITEs go oldest first (kvpush.node.write_order).
    paired = producer.call("stats")["metrics"]["paired_consumers"]
    assert paired == {"write_order=oldest_first": 1}, paired


def test_a_host_forced_to_advertise_loopback_is_refused_with_the_reason(two_hosts, spawn):
    producer = spawn(start=functools.partial(two_hosts.popen, two_hosts.a), **TCP_ONLY)
    consumer = spawn(start=functools.partial(two_hosts.popen, two_hosts.b), **TCP_ONLY)
    hello = _init(producer, "producer", "prefill", host="127.0.0.1")
    _init(consumer, "consumer", "decode", host=None)
    started = time.monotonic()
    consumer.call("expect", tid="t1", producer=hello["address"], blocks=BLOCKS,
                  network=hello["network"])  # fmt: skip
    outcome = _one(consumer)
    assert (outcome["kind"], outcome["reason"]) == ("failed", "handshake_failed")
    assert f"{hello['address']}, a loopback address" in outcome["detail"]
    assert "$VLLM_HOST_IP" in outcome["detail"]
    assert time.monotonic() - started < 5, "refused at once, not after a dial's timeout"


LINK_TIMEOUT_S = 5.0


def _side_channel(host, end: str, address: str) -> list[str]:
    """TCP connections established in `host`'s namespace whose `end` ("src": ours,
    "dst": the far one) is `address` ("address:port", a producer's side channel)."""
    shown = subprocess.run(
        ["ip", "netns", "exec", host.namespace, "ss", "-H", "-t", "-n", "state", "established",
         end, address],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return shown.stdout.splitlines()


@pytest.mark.parametrize("vanishing", ["producer", "consumer"])
def test_a_vanished_host_is_let_go_of_after_link_timeout_s(two_hosts, spawn, vanishing):
    """One node's host vanishes: its end of the link goes down, then its process is
    killed, so no FIN or RST reaches the other (a power cut, a cable pulled). The
    other's kernel drops the idle side channel once the vanished host has acknowledged
    nothing for link_timeout_s, and its node lets go of the link. Without the timeout
    the link stays established for ever. (UCX's own connections to the host are UCX's
    to end: docs/troubleshooting.md.)"""
    timers = {"link_timeout_s": LINK_TIMEOUT_S}
    producer = spawn(start=functools.partial(two_hosts.popen, two_hosts.a), **TCP_ONLY)
    consumer = spawn(start=functools.partial(two_hosts.popen, two_hosts.b), **TCP_ONLY)
    hello = _init(producer, "producer", "prefill", host=None, **timers)
    _init(consumer, "consumer", "decode", host=None, **timers)
    consumer.call("expect", tid="t1", producer=hello["address"], blocks=BLOCKS,
                  network=hello["network"])  # fmt: skip
    producer.call("kv_ready", tid="t1", blocks=BLOCKS, value=3)
    assert _one(consumer)["kind"] == "delivered"
    if vanishing == "producer":
        gone, survivor, peer, end = two_hosts.a, two_hosts.b, producer, "dst"
    else:
        gone, survivor, peer, end = two_hosts.b, two_hosts.a, consumer, "src"

    def kept() -> list[str]:
        return _side_channel(survivor, end, hello["address"])

    assert kept(), "no link to lose"
    subprocess.run(["ip", "-n", gone.namespace, "link", "set", gone.device, "down"],
                   check=True)  # fmt: skip
    down_at = time.monotonic()
    peer.kill()
    assert kept(), "the link went with the process: only the timeout may end it"
    deadline = down_at + LINK_TIMEOUT_S + 10
    while (left := kept()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the {vanishing}'s peer kept its side channel to the vanished host"
