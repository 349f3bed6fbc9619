"""Random data-path faults over real NIXL: every transfer still ends, once.

Short leases (5 s): a transfer whose pairing failed is held by prefill for its lease
(prefill cannot know decode gave up), and the test waits that out each time.

A prefill and a decode Node, each in its own process, move rounds of transfers while
kvpush.node.faults makes their NIXL and device calls (prepare, post, check, release,
stage, fence) raise or hang at random, seeded. Each round reuses the same blocks
with new values, so a WRITE that lands after its blocks were handed back shows up as
wrong bytes in a later round. After every round:

- every decode transfer got exactly one outcome, delivered or failed;
- every prefill transfer was released exactly once;
- delivered blocks hold exactly the prefill's bytes;
- nothing is left in flight or held on either side.

The protocol simulator runs the same property over its fake data path with many
more schedules (tests/unit/test_protocol_properties.py).
"""

from __future__ import annotations

import random
import time

import pytest

pytestmark = pytest.mark.nixl

TIMERS = {
    "write_grace_s": 1.0, "watchdog_s": 6.0, "heartbeat_s": 0.5, "landing_s": 2.0,
    "lease_s": 5.0, "registration_ttl_s": 5.0,
}  # fmt: skip
ROUNDS = 20
PER_ROUND = 6
RATE = 0.1


@pytest.fixture
def spawn():
    from conftest import RemotePeer

    peers = []

    def start(role: str, engine_id: str, **kwargs):
        peer = RemotePeer()
        peers.append(peer)
        hello = peer.call("init", kind="node", role=role, engine_id=engine_id, **kwargs)
        peer.address = hello["address"]
        return peer

    yield start
    for peer in peers:
        peer.kill()


def _outcomes(peer, count: int, seconds: float) -> list[dict]:
    return peer.call("results", count=count, seconds=seconds, timeout=seconds + 30)["outcomes"]


def _quiet(peer, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        stats = peer.call("stats")
        busy = stats["producer_holding"] or stats["consumer_waiting"]
        if not busy and stats["writes_in_flight"] == 0 and stats["reads_in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"still busy after every outcome: {stats}"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_random_data_path_faults_end_every_transfer_once(spawn, mode):
    seed = 20261202 + (mode == "pull")
    rng = random.Random(seed)
    producer = spawn(
        "producer", "prefill", mode=mode, blocks=2 * PER_ROUND, device="gated",
        faults={"seed": seed, "rate": RATE}, **TIMERS,
    )  # fmt: skip
    consumer = spawn(
        "consumer", "decode", mode=mode, blocks=2 * PER_ROUND,
        faults={"seed": seed + 1, "rate": RATE}, **TIMERS,
    )  # fmt: skip
    tally = {"delivered": 0, "failed": 0}
    for round_ in range(ROUNDS):
        value = {f"r{round_}t{i}": 1 + (round_ * PER_ROUND + i) % 250 for i in range(PER_ROUND)}
        blocks = {tid: [2 * i, 2 * i + 1] for i, tid in enumerate(value)}
        for tid in rng.sample(list(value), len(value)):  # some KV before its claim, some after
            if rng.random() < 0.5:
                producer.call("kv_ready", tid=tid, blocks=blocks[tid], value=value[tid])
                consumer.call("expect", tid=tid, producer=producer.address, blocks=blocks[tid])
            else:
                consumer.call("expect", tid=tid, producer=producer.address, blocks=blocks[tid])
                producer.call("kv_ready", tid=tid, blocks=blocks[tid], value=value[tid])

        ended = _outcomes(consumer, PER_ROUND, 60)
        released = _outcomes(producer, PER_ROUND, 60)
        where = f"round {round_} (seed {seed})"
        assert sorted(o["transfer_id"] for o in ended) == sorted(value), where
        assert {o["kind"] for o in ended} <= {"delivered", "failed"}, (where, ended)
        assert sorted(o["transfer_id"] for o in released) == sorted(value), where
        assert {o["kind"] for o in released} == {"released"}, (where, released)
        _quiet(producer)
        _quiet(consumer)
        assert _outcomes(consumer, 1, 0.2) == [] and _outcomes(producer, 1, 0.2) == [], where

        layers = consumer.call("values")["values"]
        for outcome in ended:
            tally[outcome["kind"]] += 1
            if outcome["kind"] == "delivered":
                tid = outcome["transfer_id"]
                for layer in layers:
                    for block in blocks[tid]:
                        assert layer[block] == [value[tid]], (where, tid, block, layer[block])

    injected = {**producer.call("injected")["injected"]}
    for key, count in consumer.call("injected")["injected"].items():
        injected[key] = injected.get(key, 0) + count
    print(f"{mode}: {ROUNDS * PER_ROUND} transfers, {tally}, faults injected {injected}")
    assert tally["delivered"] and tally["failed"], tally  # both paths were exercised
    ops = {key.split("/")[0] for key in injected}
    wanted = {"post", "check", "release", "fence"} | ({"stage"} if mode == "push" else set())
    assert wanted <= ops, injected
