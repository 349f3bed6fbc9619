"""A partition of the link between producer and consumer, as TCP sees one: nothing is
lost, everything sent during the cut arrives after it heals.

protocol_sim's `partitioned` drops messages (a link that died); here they wait in the
network queue while the clock runs, and arrive in order when the cut ends.
"""

from __future__ import annotations

import dataclasses

import pytest
from protocol_sim import PRODUCER, Sim

from kvpush.protocol.config import ProtocolConfig

# The two-host e2e suite's timers (tests/e2e/test_vllm_two_hosts.py, FAULT_SHAPE).
E2E = ProtocolConfig(
    mode="push", lease_s=10, registration_ttl_s=10, watchdog_s=6, heartbeat_s=1,
    write_grace_s=2, landing_s=3, tombstone_s=60, max_wait_s=40, orphan_grace_s=3,
    silence_s=10,
)  # fmt: skip


def cut(sim: Sim, seconds: float) -> None:
    """`seconds` pass with the link cut: timers fire on both sides, nothing arrives."""
    sim.partitioned = True  # a close the producer makes meanwhile cannot reach decode
    target = sim.now + seconds
    while sim.now < target:
        sim.now = min(target, sim.now + 0.5)
        sim._run_producer(sim.producer.tick(sim.now))
        for side in sim.consumers.values():
            sim._run_consumer(side, side.machine.tick(sim.now))


def registered() -> Sim:
    """A pair with the e2e timers whose consumer has registered its blocks for t1."""
    sim = Sim(config=E2E)
    sim.expect("t1")
    sim.deliver()
    return sim


def heal(sim: Sim) -> None:
    """The link is back: what was sent arrives, and then a close the producer made."""
    sim.partitioned = False
    sim.deliver()
    if sim.c.name in sim.disconnected:
        sim._run_consumer(sim.c, sim.c.machine.on_peer_lost(PRODUCER, "closed", sim.now, True))


def test_a_cut_longer_than_the_watchdog_fails_as_the_watchdog_when_it_heals():
    # The KV waits at the producer under its lease; decode's registration is caught in
    # the cut, which outlasts both decode's watchdog and prefill's lease.
    sim = Sim(config=E2E)
    sim.ready("t1")
    sim.expect("t1")  # the Register is sent into the cut
    cut(sim, 12.0)
    heal(sim)
    assert sim.released == {"t1": "lease_expired"}  # prefill let its KV go meanwhile
    sim.advance(sim.config.write_grace_s + sim.config.heartbeat_s + 2)
    assert sim.c.failed == {"t1": "watchdog_expired"}
    sim.settle()
    sim.check()


@pytest.mark.xfail(
    strict=True,
    reason="the request waits for the cut to heal or the registration to provably end "
    "(claimed_at + registration_ttl_s + landing bound) before it fails; its blocks must "
    "stay held that long, but its failure need not wait",
)
def test_a_cut_longer_than_the_watchdog_fails_the_request_at_the_watchdog():
    sim = registered()  # prefill is still computing when the link goes
    cut(sim, E2E.watchdog_s + 1)  # not yet healed
    # The producer may still WRITE into the blocks: held, but the request is over.
    assert sim.c.ledger.holds("t1", sim.c.expected["t1"])
    assert sim.c.failed == {"t1": "watchdog_expired"}


def test_a_write_failed_by_a_short_cut_is_written_again_once_the_link_is_back():
    sim = registered()
    sim.ready("t1")
    assert "t1" in sim.writes
    sim.finish_writes(ok=False)  # UCX fails a WRITE whose route went
    sim.advance(2.0)  # the cut heals, well within the lease and the watchdog
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def fail_the_write(sim: Sim) -> None:
    """The WRITE in flight fails outright (UCX lost its route): nothing of it lands."""
    assert "t1" in sim.writes
    sim.finish_writes(ok=False)
    sim.deliver()


def test_a_write_that_keeps_failing_fails_write_failed_once_its_retries_run_out():
    sim = registered()
    sim.ready("t1")
    for _ in range(E2E.write_retries):
        fail_the_write(sim)
        assert not sim.writes and sim.c.failed == {}  # it waits out its back-off
        sim.advance(E2E.heartbeat_s)
    fail_the_write(sim)
    assert sim.c.failed == {"t1": "write_failed"}
    assert sim.released == {"t1": "write_failed"}
    retries = [c for c in sim.counted if c.name == "write_retries"]
    assert len(retries) == E2E.write_retries
    sim.advance(E2E.heartbeat_s * 2)
    assert not sim.writes  # nothing more is posted
    sim.settle()
    sim.check()


def test_no_retry_after_the_consumer_cancelled_during_the_back_off():
    sim = registered()
    sim.ready("t1")
    fail_the_write(sim)
    sim.abort_consumer("t1")  # decode's request ended: its registration with it
    sim.deliver()
    assert sim.released == {"t1": "aborted"}
    sim.advance(E2E.heartbeat_s * 2)
    assert not sim.writes
    sim.settle()
    assert sim.c.failed == {"t1": "aborted"}
    sim.check()


def test_no_retry_after_the_consumer_link_is_lost_during_the_back_off():
    sim = registered()
    sim.ready("t1")
    fail_the_write(sim)
    sim.kill_link()
    assert sim.released == {"t1": "peer_lost"}
    sim.advance(E2E.heartbeat_s * 2)
    assert not sim.writes
    sim.settle()
    sim.check()


def test_no_retry_after_the_registration_expired():
    # A cut that lasts: every try fails, decode's heartbeats are lost, and the claim's
    # registration (layers still to come) runs out between two tries, before silence_s.
    config = dataclasses.replace(E2E, write_retries=100, registration_ttl_s=4)
    sim = Sim(config=config, layers=2)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1", layers=1)
    sim.partitioned = True
    while "t1" in sim.producer.books.sources:
        if sim.writes:
            sim.finish_writes(ok=False)
        sim.advance(0.5)
        assert sim.now < config.registration_ttl_s + 5
    assert sim.released == {"t1": "registration_expired"}
    sim.advance(config.heartbeat_s * 3)
    assert not sim.writes  # the pending back-off posted nothing
    heal(sim)
    sim.settle()
    sim.check()


def test_no_retry_for_a_write_that_may_still_land():
    # A WRITE given up on unfinished (timed out) may land yet: it is not posted again.
    sim = registered()
    sim.ready("t1")
    sim.writes.pop("t1")
    sim._run_producer(sim.producer.on_write_done("t1", sim.c.name, False, sim.now,
                                                 "timed out", may_land=True))  # fmt: skip
    sim.deliver()
    assert sim.released == {"t1": "write_failed"}
    sim.advance(E2E.heartbeat_s * 2)
    assert not sim.writes
