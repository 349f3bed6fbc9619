"""Random event orders and random bytes against the protocol.

Events include links that break on one end only and data-path calls that fail
(a WRITE or READ that cannot post, a staging copy that raises). Invariants: only
kvpush's own exceptions; after the dust settles every block on both sides is free
exactly once, nothing waits, every decode transfer ended once, no WRITE lands
where it should not.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_sim import PRODUCER, Sim

from kvpush.errors import KVPushError
from kvpush.protocol import messages as m
from kvpush.protocol.auth import Session

TIDS = [f"t{i}" for i in range(4)]
m_promises = (m.Failed, m.CancelAck, m.Complete)
CONSUMERS = ["decode0", "decode1"]

tid = st.sampled_from(TIDS)
consumer = st.sampled_from(CONSUMERS)
blocks = st.lists(st.integers(0, 70), max_size=5)
reason = st.sampled_from(m.REASONS)
# Messages an authenticated peer may send at odd times (late, duplicated, confused).
# Failed, CancelAck and Complete are also promises ("I write nothing more"): a producer
# that breaks them can corrupt its consumer's blocks whatever the protocol does, so the
# consumer is fed those only by the simulated producer itself, never as strays.
stray_message = st.one_of(
    st.builds(
        m.Register,
        tid,
        st.lists(blocks, min_size=1, max_size=2),
        st.text(max_size=16),
        st.integers(0, 3),
    ),
    st.builds(m.Complete, tid, st.binary(max_size=12), st.integers(0, 99), st.floats(0, 1)),
    st.builds(m.Failed, tid, reason),
    st.builds(m.Cancel, tid, reason),
    st.builds(m.CancelAck, tid),
    st.builds(m.Heartbeat, st.lists(tid, max_size=3)),
    st.builds(m.Grant, tid, st.lists(blocks, min_size=1, max_size=2), st.floats(0.1, 20)),
    st.builds(m.PullRequest, tid, st.integers(1, 6)),
    st.builds(m.Release, tid),
)

event = st.one_of(
    st.tuples(st.just("expect"), tid, consumer, st.integers(0, 4), st.integers(0, 2)),
    st.tuples(st.just("ready"), tid, st.integers(0, 4), st.sampled_from([1, 2, None])),
    st.tuples(st.just("progress"), tid, st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("pending"), tid),
    st.tuples(st.just("abort_c"), tid, consumer),
    st.tuples(st.just("abort_p"), tid),
    st.tuples(st.just("deliver"), st.integers(1, 4)),
    st.tuples(st.just("writes"), st.booleans()),
    st.tuples(st.just("reads"), st.booleans()),
    st.tuples(st.just("notifs")),
    st.tuples(st.just("advance"), st.sampled_from([0.1, 1.0, 3.0, 9.0, 25.0])),
    st.tuples(st.just("kill"), consumer),
    st.tuples(st.just("half_close"), consumer),
    st.tuples(st.just("fault"), st.sampled_from(["post", "stage"])),
    st.tuples(st.just("stray_to_producer"), consumer, stray_message),
    st.tuples(
        st.just("stray_to_consumer"),
        consumer,
        stray_message.filter(lambda m: not isinstance(m, m_promises)),
    ),
)


def _play(sim: Sim, events: list[tuple]) -> set[str]:
    """Play the events; returns the transfers prefill started computing and has not
    finished or aborted (the engine will report their last layer eventually)."""
    expected: set[tuple[str, str]] = set()
    # The engine's contract: chunk reports (progress) while the prompt is computed, then
    # the last step's layer reports in order, then a last one or an abort; after either,
    # nothing more for that transfer.
    ended: set[str] = set()
    computing: set[str] = set()
    last_step: set[str] = set()
    for ev in events:
        kind = ev[0]
        if kind == "expect" and (ev[1], ev[2]) not in expected:
            expected.add((ev[1], ev[2]))
            sim.expect(ev[1], blocks=ev[3], consumer=ev[2], skip=ev[4])
        elif kind == "ready" and ev[1] not in ended:
            (ended if ev[3] is None else computing).add(ev[1])
            last_step.add(ev[1])
            sim.ready(ev[1], blocks=ev[2], layers=ev[3])
        elif kind == "progress" and ev[1] not in ended | last_step:
            computing.add(ev[1])
            sim.progress(ev[1], blocks=ev[2], full=min(ev[2], ev[3]))
        elif kind == "pending":
            sim.pending(ev[1])
        elif kind == "abort_c":
            sim.abort_consumer(ev[1], consumer=ev[2])
        elif kind == "abort_p" and ev[1] not in ended:
            ended.add(ev[1])
            sim.abort_producer(ev[1])
        elif kind == "deliver":
            sim.deliver(ev[1])
        elif kind == "writes":
            sim.finish_writes(ok=ev[1])
        elif kind == "reads":
            sim.finish_reads(ok=ev[1])
        elif kind == "notifs":
            sim.poll_notifs()
        elif kind == "advance":
            sim.advance(ev[1])
        elif kind == "kill":
            sim.kill_link(ev[1])
        elif kind == "half_close":
            sim.half_close(ev[1])
        elif kind == "fault":
            sim.armed.append(ev[1])
        elif kind == "stray_to_producer":
            sim._run_producer(sim.producer.on_message(ev[1], ev[2], sim.now))
        elif kind == "stray_to_consumer":
            side = sim.consumers[ev[1]]
            sim._run_consumer(side, side.machine.on_message(PRODUCER, ev[2], sim.now))
    return computing - ended


# Stray messages come from an authenticated but misbehaving peer: they may fail that
# peer's own transfers, but must never break the ledgers.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["push", "pull"]), events=st.lists(event, max_size=40))
def test_random_event_orders_keep_every_block_accounted(mode, events):
    sim = Sim(mode=mode, consumers=2, layers=3)
    for transfer_id in _play(sim, events):  # prefill finishes what it started
        sim.ready(transfer_id)
    sim.settle()
    sim.check()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_foreign_exceptions(data):
    with contextlib.suppress(KVPushError):
        m.decode(data)
    session = Session(b"secret", initiator=False, nonce=bytes(16))
    with contextlib.suppress(KVPushError):
        session.open(data)
    assert session.peer_hello is None  # random bytes never carry a valid hello signature


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_frames_are_rejected_without_changing_the_session(data):
    from test_protocol_auth import established_pair

    client, server = established_pair()
    frame = client.seal(m.Heartbeat(["t1"]))
    position = data.draw(st.integers(0, len(frame) - 1))
    flip = data.draw(st.integers(1, 255))
    mutated = frame[:position] + bytes([frame[position] ^ flip]) + frame[position + 1 :]
    before = server._seq_in
    # Every byte of a frame is signed or structural: no single flip may get through.
    with pytest.raises(KVPushError):
        server.open(mutated)
    assert server._seq_in == before
    assert server.open(client.seal(m.Heartbeat(["t2"]))) == m.Heartbeat(["t2"])
