"""The machines across tensor-parallel sizes: a producer rank whose KV several
consumer ranks claim (prefill TP < decode TP), and a consumer rank that takes its
heads from several producer ranks (prefill TP > decode TP). Every block still goes
back exactly once, and every transfer gets exactly one outcome."""

from __future__ import annotations

from protocol_sim import hello, layout

from kvpush.protocol import actions as act
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer, Source
from kvpush.protocol.messages import Complete, Failed, Heartbeat, Register, encode_notif
from kvpush.protocol.producer import Producer

CONFIG = ProtocolConfig(lease_s=10, registration_ttl_s=10, watchdog_s=8, heartbeat_s=1,
                        write_grace_s=2, landing_s=3, tombstone_s=60, max_wait_s=40)  # fmt: skip
RANKS = ("decode:r0", "decode:r1")


def _producer() -> Producer:
    producer = Producer(CONFIG)
    for i, peer in enumerate(RANKS):
        producer.on_ready(
            peer, hello("consumer", "push", 16, peer, 0x9000, CONFIG), layout(16, 0x9000), 0.0
        )
        assert peer == RANKS[i]
    return producer


def _register(producer: Producer, peer: str, blocks: list[int], now: float, parts: int = 2):
    message = Register("t1", [blocks], layout(16, 0x9000).digest(), 0, parts)
    return producer.on_message(peer, message, now)


def _kinds(actions) -> list[str]:
    return [type(a).__name__ if not isinstance(a, act.Send) else type(a.message).__name__
            for a in actions]  # fmt: skip


def test_two_consumer_ranks_claim_one_kv_and_its_blocks_go_back_once():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    assert _register(producer, RANKS[0], [3, 4], 0.1) == []
    assert _register(producer, RANKS[1], [3, 4], 0.1) == []
    writes = producer.kv_ready("t1", [7, 8], 0.2)
    posted = [a for a in writes if isinstance(a, act.PostWrite)]
    assert sorted(w.peer for w in posted) == list(RANKS)  # each rank its own WRITE
    first = producer.on_write_done("t1", RANKS[0], True, 0.3, nbytes=10)
    assert "ReleaseBlocks" not in _kinds(first)  # the other rank's WRITE still reads them
    second = producer.on_write_done("t1", RANKS[1], True, 0.3, nbytes=10)
    (release,) = [a for a in second if isinstance(a, act.ReleaseBlocks)]
    assert (release.outcome, release.nbytes) == ("sent", 20)
    assert producer.holding() == [] and not producer.tracks("t1")


def test_a_third_claim_of_two_parts_is_a_conflict():
    producer = _producer()
    producer.on_ready(
        "decode:r2", hello("consumer", "push", 16, "r2", 0x9000, CONFIG), layout(16, 0x9000), 0
    )
    producer.kv_pending("t1", 0.0)
    _register(producer, RANKS[0], [1], 0.1)
    _register(producer, RANKS[1], [1], 0.1)
    (refusal,) = _register(producer, "decode:r2", [1], 0.1)
    assert isinstance(refusal.message, Failed) and refusal.message.reason == "conflict"


def test_kv_whose_first_claim_was_sent_waits_for_the_other_under_the_lease():
    producer = _producer()
    producer.kv_ready("t1", [7, 8], 0.0)  # computed before anyone claimed it
    _register(producer, RANKS[0], [3, 4], 0.1)
    done = producer.on_write_done("t1", RANKS[0], True, 0.2, nbytes=10)
    assert "ReleaseBlocks" not in _kinds(done)  # the second rank has not claimed it yet
    assert producer.holding() == ["t1"]
    actions = _register(producer, RANKS[1], [5, 6], 1.0)
    (write,) = [a for a in actions if isinstance(a, act.PostWrite)]
    assert (write.peer, write.src_blocks, write.dst_blocks) == (RANKS[1], [7, 8], [5, 6])
    done = producer.on_write_done("t1", RANKS[1], True, 1.1, nbytes=10)
    assert "ReleaseBlocks" in _kinds(done)


def test_kv_a_second_claim_never_comes_for_goes_back_at_the_lease():
    producer = _producer()
    producer.kv_ready("t1", [7, 8], 0.0)
    _register(producer, RANKS[0], [3, 4], 0.1)
    producer.on_write_done("t1", RANKS[0], True, 0.2, nbytes=10)
    assert producer.tick(5.0) == [] and producer.holding() == ["t1"]
    (release,) = [a for a in producer.tick(CONFIG.lease_s + 1) if isinstance(a, act.ReleaseBlocks)]
    assert release.outcome == "lease_expired" and producer.holding() == []


def test_one_consumer_rank_lost_mid_write_fails_its_claim_and_the_other_finishes():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    _register(producer, RANKS[0], [3], 0.1)
    _register(producer, RANKS[1], [3], 0.1)
    producer.kv_ready("t1", [7], 0.2)
    assert producer.on_peer_lost(RANKS[0], "gone", 0.3) == []  # its WRITE is in flight
    assert "ReleaseBlocks" not in _kinds(producer.on_write_done("t1", RANKS[0], True, 0.4))
    (release,) = [
        a for a in producer.on_write_done("t1", RANKS[1], True, 0.4, nbytes=5)
        if isinstance(a, act.ReleaseBlocks)
    ]  # fmt: skip
    assert release.outcome == "peer_lost"  # the transfer as a whole did not reach decode


def _consumer() -> Consumer:
    consumer = Consumer(CONFIG, layout(16, 0x9000).digest())
    for peer in ("prefill:r0", "prefill:r1"):
        consumer.on_ready(
            peer, hello("producer", "push", 16, peer, 0x9000, CONFIG), layout(16, 0x9000), 0
        )
    return consumer


SOURCES = [Source("prefill:r0", "", 1), Source("prefill:r1", "", 1)]


def test_a_consumer_rank_taking_heads_from_two_producers_is_delivered_once_both_landed():
    consumer = _consumer()
    claims = consumer.expect("t1", SOURCES, [2, 3], 0.0)
    assert sorted(a.peer for a in claims if isinstance(a, act.Send)) == [s.peer for s in SOURCES]
    notif = encode_notif("t1", 0.5)
    assert consumer.on_notif("prefill:r0", notif, 0.5) == []  # half the heads
    (delivered,) = consumer.on_notif("prefill:r1", notif, 0.6)
    assert isinstance(delivered, act.Delivered) and consumer.waiting() == []


def test_a_failed_part_gives_up_the_other_and_fails_once_nothing_can_land():
    consumer = _consumer()
    consumer.expect("t1", SOURCES, [2, 3], 0.0)
    failed = consumer.on_message("prefill:r0", Failed("t1", "write_failed", "boom"), 0.1)
    # The other producer is told to stop; its blocks are held until it says so.
    assert _kinds(failed) == ["Cancel"] and consumer.waiting() == ["t1"]
    acked = consumer.on_message("prefill:r1", Complete("t1", b"", 0, 0.0), 0.2)
    (outcome,) = [a for a in acked if isinstance(a, act.TransferFailed)]
    assert outcome.reason == "write_failed" and consumer.waiting() == []


def test_kv_only_a_lost_consumer_announced_is_held_a_few_heartbeats_not_the_lease():
    """A decode with a queue dies: the KV its queued requests announced (heartbeats)
    but never claimed goes back within a few heartbeats, not after lease_s."""
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    producer.kv_pending("t2", 0.0)
    producer.on_message(RANKS[0], Heartbeat(["t1", "t2", "t3"]), 0.1)  # t3: not yet here
    producer.kv_ready("t1", [7], 0.2)  # held for the announcer
    assert producer.on_peer_lost(RANKS[0], "gone", 0.5) == []
    released = [a for a in producer.tick(0.5 + 2 * CONFIG.heartbeat_s + 0.1)
                if isinstance(a, act.ReleaseBlocks)]  # fmt: skip
    assert [(r.transfer_id, r.outcome) for r in released] == [("t1", "lease_expired")]
    producer.kv_ready("t2", [8], 3.0)  # computed after its announcer died
    producer.kv_pending("t3", 3.0)
    producer.kv_ready("t3", [9], 3.0)
    later = [a for a in producer.tick(3.0 + 2 * CONFIG.heartbeat_s + 0.1)
             if isinstance(a, act.ReleaseBlocks)]  # fmt: skip
    assert sorted(r.transfer_id for r in later) == ["t2", "t3"]
    assert producer.holding() == []


def test_kv_another_live_consumer_announced_keeps_its_lease():
    producer = _producer()
    producer.kv_ready("t1", [7], 0.0)
    producer.on_message(RANKS[0], Heartbeat(["t1"]), 0.1)
    producer.on_message(RANKS[1], Heartbeat(["t1"]), 0.1)
    producer.on_peer_lost(RANKS[0], "gone", 0.2)
    assert not [a for a in producer.tick(5.0) if isinstance(a, act.ReleaseBlocks)]
    assert producer.holding() == ["t1"]
