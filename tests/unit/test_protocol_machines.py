"""The producer and consumer state machines through every path the protocol promises.

Each scenario ends with Sim.check(): every block on both sides free exactly once,
no request left waiting, no WRITE landing in a block that was not its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from protocol_sim import PRODUCER, Sim, hello

from kvpush.errors import ConfigError, ProtocolError
from kvpush.protocol import consumer as consumer_machine
from kvpush.protocol import producer as producer_machine
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import TRANSITIONS, Consumer, Source, State
from kvpush.protocol.consumer import moves as consumer_moves
from kvpush.protocol.handshake import pairing_problem
from kvpush.protocol.messages import (
    Cancel,
    CancelAck,
    Complete,
    Failed,
    Grant,
    PullRequest,
    Register,
    Writing,
)
from kvpush.protocol.producer import moves as producer_moves


def test_registration_first_then_kv():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    assert sim.c.machine.state_of("t1") == "registered"
    sim.ready("t1")
    assert "t1" in sim.writes
    sim.settle()
    assert sim.c.delivered == ["t1"]
    assert sim.released == {"t1": "sent"}
    sim.check()


def test_kv_first_then_registration():
    sim = Sim()
    sim.ready("t1")
    assert not sim.writes
    sim.expect("t1")
    sim.deliver()
    assert "t1" in sim.writes
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_notification_delivers_at_once_and_the_later_complete_is_harmless():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.finish_writes()
    sim.poll_notifs()  # the NIXL notification overtakes the Complete message
    assert sim.c.delivered == ["t1"]
    sim.deliver()  # the Complete arrives for a transfer already delivered
    assert sim.c.delivered == ["t1"]
    assert not [c for c in sim.counted if c.name == "rejected_messages"]
    sim.settle()
    sim.check()


def test_a_notification_from_another_peer_is_not_trusted():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.finish_writes()
    _, notif = sim.notifs.popleft()
    sim._run_consumer(sim.c, sim.c.machine.on_notif("intruder:1", notif, sim.now))
    assert sim.c.delivered == []
    assert sim.counted[-1].labels == {"why": "unknown_transfer"}
    sim.notifs.append(("decode0", notif))
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_complete_without_notification_fails_after_landing_timeout():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.finish_writes()
    sim.notifs.clear()  # the notification never arrives
    sim.deliver()
    assert sim.c.machine.landing()
    sim.advance(sim.config.landing_s + 0.5)
    assert sim.c.failed == {"t1": "write_failed"}
    sim.settle()
    sim.check()


def test_prefix_cached_blocks_are_skipped():
    sim = Sim()
    sim.ready("t1", blocks=5)
    sim.expect("t1", blocks=3, skip=2)
    sim.deliver()
    _, post = sim.writes["t1"]
    assert len(post.src_blocks) == 3 and len(post.dst_blocks) == 3
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_fully_cached_prefix_completes_without_a_write():
    sim = Sim()
    sim.ready("t1", blocks=2)
    sim.expect("t1", blocks=0, skip=2)
    sim.deliver()
    assert not sim.writes
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_duplicate_registration_is_ignored():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    register = Register("t1", [sim.c.expected["t1"]], sim.c.hello.layout_digest)
    sim.network.append(("producer", "decode0", register))
    sim.deliver()
    assert any(c.name == "duplicate_registrations" for c in sim.counted)
    sim.ready("t1")
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_second_consumer_claiming_the_same_transfer_gets_a_conflict():
    sim = Sim(consumers=2)
    sim.expect("t1", consumer="decode0")
    sim.deliver()
    sim.expect("t1", consumer="decode1")
    sim.deliver()
    assert sim.consumers["decode1"].failed == {"t1": "conflict"}
    sim.ready("t1")
    sim.settle()
    assert sim.consumers["decode0"].delivered == ["t1"]
    sim.check()


def test_late_registration_after_lease_expiry_fails_fast():
    sim = Sim()
    sim.ready("t1")
    sim.advance(sim.config.lease_s + 1)
    assert sim.released == {"t1": "lease_expired"}
    sim.expect("t1")
    sim.deliver()
    sim.deliver()
    assert sim.c.failed == {"t1": "lease_expired"}
    sim.settle()
    sim.check()


def test_kv_a_sequential_orchestrator_never_claims_is_released_after_the_grace():
    """The producer named the transfer (no transfer id on the prefill leg): its decode
    leg comes only after the answer, so a decode that has not announced it within
    orphan_grace_s never will. A late one is refused by name."""
    sim = Sim()
    sim.pending("t1", sequential=True)
    sim.ready("t1")
    sim.advance(sim.config.orphan_grace_s - 1)
    assert "t1" not in sim.released
    sim.advance(2)
    assert sim.released == {"t1": "orphaned"}
    sim.expect("t1")
    sim.deliver()
    sim.deliver()
    assert sim.c.failed == {"t1": "orphaned"}
    sim.settle()
    sim.check()


@pytest.mark.parametrize("announced_first", [True, False])
def test_a_sequential_transfer_a_decode_announced_keeps_the_whole_lease(announced_first):
    sim = Sim()
    if announced_first:  # decode's heartbeat came before prefill heard of the request
        sim._run_consumer(sim.c, sim.c.machine.announce("t1", PRODUCER, sim.now))
        sim.deliver()
    sim.pending("t1", sequential=True)
    sim.ready("t1")
    if not announced_first:
        sim._run_consumer(sim.c, sim.c.machine.announce("t1", PRODUCER, sim.now))
    sim.advance(sim.config.orphan_grace_s * 2)
    assert "t1" not in sim.released
    sim.expect("t1")
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_a_transfer_the_router_named_keeps_the_whole_lease_unannounced():
    sim = Sim()
    sim.pending("t1")
    sim.ready("t1")
    sim.advance(sim.config.orphan_grace_s * 2)
    assert "t1" not in sim.released
    sim.advance(sim.config.lease_s)
    assert sim.released == {"t1": "lease_expired"}
    sim.check()


def test_heartbeats_keep_finished_kv_while_decode_queues():
    sim = Sim()
    sim.ready("t1")
    sim._run_consumer(sim.c, sim.c.machine.announce("t1", PRODUCER, sim.now))
    sim.advance(sim.config.lease_s * 3)  # decode's queue is long; heartbeats flow
    assert "t1" not in sim.released
    sim.expect("t1")
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_producer_heartbeats_keep_a_long_prefill_alive():
    sim = Sim()
    sim.pending("t1")  # prefill queued the request
    sim.expect("t1")
    sim.advance(sim.config.watchdog_s * 3)  # a long prefill, but the producer says so
    assert sim.c.failed == {}
    sim.ready("t1")
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_watchdog_without_producer_news_cancels_then_fails():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.advance(sim.config.watchdog_s + 1)
    # The producer never heard of t1 from its engine: its ack settles the cancel at once.
    assert sim.c.failed == {"t1": "watchdog_expired"}
    sim.ready("t1")  # the KV shows up afterwards: released at once, nothing written
    assert sim.released == {"t1": "watchdog_expired"}
    sim.settle()
    sim.check()


@pytest.mark.parametrize("stage", ["before_claim", "registered", "kv_ready_no_claim", "landing"])
def test_consumer_abort_at_each_stage(stage):
    sim = Sim()
    if stage == "kv_ready_no_claim":
        sim.ready("t1")
    sim.expect("t1")
    if stage != "before_claim":
        sim.deliver()
    if stage == "landing":
        sim.ready("t1")
        sim.finish_writes()
        sim.notifs.clear()
        sim.deliver()
        assert sim.c.machine.state_of("t1") == "landing"
    sim.abort_consumer("t1")
    sim.settle()
    assert sim.c.failed == {"t1": "aborted"}
    sim.check()


def test_consumer_abort_while_write_in_flight_holds_blocks_until_settled():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    assert "t1" in sim.writes  # the WRITE is posted and has not landed
    sim.abort_consumer("t1")
    sim.deliver()  # the cancel reaches the producer; the WRITE cannot be recalled
    assert sim.c.failed == {}
    assert sim.c.ledger.holds("t1", sim.c.expected["t1"])  # blocks not back in the pool
    retry = sim.expect("t2")  # a retry gets other blocks
    assert not set(retry) & set(sim.c.expected["t1"])
    sim.finish_writes()  # the old WRITE lands in t1's still-held blocks
    sim.deliver()  # CancelAck
    assert sim.c.failed == {"t1": "aborted"}
    sim.ready("t2")
    sim.settle()
    assert sim.c.delivered == ["t2"]
    sim.check()


def test_cancel_settles_by_provable_expiry_when_the_producer_is_silent():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.partitioned = True  # the cancel, and everything after, is lost
    sim.abort_consumer("t1")
    sim.advance(sim.config.registration_ttl_s - 1)
    assert sim.c.failed == {}
    sim.advance(sim.config.write_grace_s + 2)
    assert sim.c.failed == {"t1": "aborted"}


@pytest.mark.parametrize("stage", ["pending", "kv_ready", "registered", "writing"])
def test_producer_abort_at_each_stage(stage):
    sim = Sim()
    if stage == "pending":
        sim.pending("t1")
    if stage in ("registered", "writing"):
        sim.expect("t1")
        sim.deliver()
    if stage in ("kv_ready", "writing"):
        sim.ready("t1")
    sim.abort_producer("t1")
    if stage in ("pending", "kv_ready"):
        sim.expect("t1")
    sim.settle()
    if "t1" in sim.released:
        assert sim.released["t1"] == "aborted"
    if stage == "writing":
        # The WRITE in flight landed whole (its notification came): the KV is usable.
        assert sim.c.delivered == ["t1"] and sim.c.failed == {}
    else:
        assert sim.c.failed == {"t1": "aborted"}
    sim.check()


def test_write_post_failure_reaches_the_consumer_at_once_without_retries():
    sim = Sim(config=dataclasses.replace(Sim().config, write_retries=0))
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.finish_writes(ok=False)
    sim.deliver()
    assert sim.c.failed == {"t1": "write_failed"}
    assert sim.released == {"t1": "write_failed"}
    sim.settle()
    sim.check()


def test_handshake_failure_fails_every_waiting_transfer():
    sim = Sim(handshake_ok=False)
    sim.expect("t1")
    assert sim.c.failed == {"t1": "handshake_failed"}
    sim.settle()
    sim.check()


def test_peer_death_mid_registration_waits_out_the_write_grace():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.kill_link()
    assert sim.c.failed == {}  # the WRITE posted before the link died may still land
    sim.finish_writes()
    sim.advance(sim.config.write_grace_s + sim.config.heartbeat_s + 0.5)
    assert sim.c.failed == {"t1": "peer_lost"}
    sim.settle()
    sim.check()


def test_half_open_link_keeps_registered_blocks_while_the_producer_may_still_write():
    # Only decode's end saw the link break: prefill still thinks it up, and its KV
    # comes after decode's old 12 s wait (here 3 s) was over.
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.half_close()
    sim.advance(sim.config.write_grace_s + sim.config.heartbeat_s + 0.5)
    assert sim.c.failed == {}  # the blocks are still decode's
    sim.ready("t1")
    sim.finish_writes()  # lands in blocks decode still holds, not in freed ones
    sim.settle()
    assert sim.c.failed == {"t1": "peer_lost"}
    sim.check()


def test_silent_consumer_is_dropped_before_its_blocks_can_be_reused():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.half_close()
    sim.advance(sim.config.silence_s + 0.5)
    assert sim.disconnected == ["decode0"]
    assert ("silent_consumers", {}) in [(c.name, c.labels) for c in sim.counted]
    assert sim.c.failed == {}  # decode waits out the silence and a WRITE's landing
    sim.ready("t1")
    assert not sim.writes  # nothing more is written into blocks decode will reuse
    sim.settle()
    assert sim.c.failed == {"t1": "peer_lost"}
    assert sim.released == {"t1": "peer_lost"}
    sim.check()


def test_consumer_heartbeating_slower_than_the_producers_silence_rule_is_refused():
    config = ProtocolConfig(heartbeat_s=4, watchdog_s=30, silence_s=12)
    slow = hello("consumer", "push", 8, "decode", 0x900000, config)
    strict = hello("producer", "push", 8, "prefill", 0x100000, ProtocolConfig(silence_s=10))
    problem = pairing_problem(slow, strict)
    assert problem is not None and "heartbeat_s" in problem
    assert pairing_problem(strict, slow) == problem
    fine = hello("consumer", "push", 8, "decode", 0x900000, ProtocolConfig())
    assert pairing_problem(fine, strict) is None


def test_silence_shorter_than_three_heartbeats_is_a_config_error():
    with pytest.raises(ConfigError, match="silence_s"):
        ProtocolConfig(heartbeat_s=4, watchdog_s=30, silence_s=10)


def test_a_link_timeout_shorter_than_three_heartbeats_is_a_config_error():
    with pytest.raises(ConfigError, match=r"link_timeout_s \(5\) must be at least three"):
        ProtocolConfig(heartbeat_s=2, link_timeout_s=5)
    assert ProtocolConfig(heartbeat_s=2, link_timeout_s=6).link_timeout_s == 6


def test_peer_death_before_the_kv_releases_it_when_it_comes():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.kill_link()
    sim.ready("t1")
    assert not sim.writes
    sim.settle()
    assert sim.c.failed == {"t1": "peer_lost"}
    assert sim.released == {"t1": "peer_lost"}
    sim.check()


def test_out_of_range_blocks_are_refused_before_any_write():
    sim = Sim(consumer_blocks=64)
    sim.ready("t1")
    bad = Register("t1", [[1, 2, 64]], sim.c.hello.layout_digest)
    sim._run_consumer(sim.c, sim.c.machine.expect("t1", [Source(PRODUCER)], [1, 2], sim.now))
    sim.c.ledger.alloc("t1", 0)
    sim.network.clear()
    sim.network.append(("producer", "decode0", bad))
    sim.deliver(1)
    assert not sim.writes
    failed = [m for _, _, m in sim.network if isinstance(m, Failed)]
    assert failed and failed[0].reason == "bad_blocks" and "64" in failed[0].detail


def test_stale_layout_digest_is_refused():
    sim = Sim()
    sim.ready("t1")
    register = Register("t1", [[1]], "0" * 16)
    sim._run_consumer(sim.c, sim.c.machine.expect("t1", [Source(PRODUCER)], [], sim.now))
    sim.network.clear()
    sim.network.append(("producer", "decode0", register))
    sim.deliver(1)
    message = sim.network[0][2]
    assert isinstance(message, Failed) and message.reason == "bad_blocks"
    assert "layout" in message.detail


def test_more_destinations_than_sources_fails_cleanly():
    sim = Sim()
    sim.ready("t1", blocks=2)
    sim.expect("t1", blocks=4)
    sim.settle()
    assert sim.c.failed == {"t1": "bad_blocks"}
    assert sim.released == {"t1": "bad_blocks"}
    sim.check()


def test_retry_with_a_new_transfer_id_never_gets_old_bytes():
    sim = Sim(consumers=2)
    sim.expect("old", consumer="decode0")
    sim.deliver()
    sim.abort_consumer("old", consumer="decode0")
    sim.expect("new", consumer="decode1")
    sim.ready("old")
    sim.ready("new")
    sim.settle()
    assert sim.consumers["decode1"].delivered == ["new"]
    assert sim.consumers["decode0"].failed == {"old": "aborted"}
    for block in sim.consumers["decode1"].expected["new"]:
        assert sim.consumers["decode1"].memory[(block, 0)][0] == "new"
    sim.check()


def test_messages_for_unknown_transfers_are_counted_not_acted_on():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim._run_consumer(sim.c, sim.c.machine.on_message(PRODUCER, Complete("zz", b"", 0, 0.0), 0))
    sim._run_consumer(sim.c, sim.c.machine.on_message("elsewhere:1", Failed("t1", "aborted"), 0))
    assert sim.c.failed == {}
    assert [c.labels["why"] for c in sim.counted] == ["unknown_transfer", "unknown_transfer"]


def test_duplicate_expect_is_an_engine_error():
    sim = Sim()
    sim.expect("t1")
    with pytest.raises(ProtocolError, match="already expected"):
        sim.c.machine.expect("t1", [Source(PRODUCER)], [9], sim.now)


# -- layer by layer ------------------------------------------------------------------


def test_layers_are_written_as_they_become_ready():
    sim = Sim(layers=4)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1", layers=1)
    _, first = sim.writes["t1"]
    assert first.layers == (0, 1) and first.notif == b""  # no notification mid-way
    sim.ready("t1", layers=3)  # two more layers while the first WRITE is in flight
    sim.finish_writes()
    _, second = sim.writes["t1"]
    assert second.layers == (1, 3)
    sim.finish_writes()
    assert not sim.writes  # layer 3 is not computed yet
    assert sim.c.delivered == []
    sim.ready("t1")  # the last layer: the producer is done
    _, last = sim.writes["t1"]
    assert last.layers == (3, 4) and last.notif
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_registration_after_some_layers_writes_them_at_once():
    sim = Sim(layers=4)
    sim.ready("t1", layers=2)
    sim.expect("t1")
    sim.deliver()
    _, post = sim.writes["t1"]
    assert post.layers == (0, 2)
    sim.ready("t1")
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_cancel_between_layer_writes_stops_the_rest():
    sim = Sim(layers=4)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1", layers=2)
    sim.abort_consumer("t1")
    sim.deliver()  # the cancel reaches the producer while layers 0-1 are in flight
    sim.finish_writes()
    sim.deliver()
    assert sim.c.failed == {"t1": "aborted"}
    sim.ready("t1")  # the engine finishes computing: nothing more is written
    assert not sim.writes
    sim.settle()
    sim.check()


def test_a_failed_layer_write_fails_the_transfer():
    sim = Sim(layers=3)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1", layers=1)
    for _ in range(sim.config.write_retries):
        sim.finish_writes(ok=False)
        sim.advance(sim.config.heartbeat_s)  # posted again, the same layer
        assert sim.writes["t1"][1].layers == (0, 1)
    sim.finish_writes(ok=False)
    sim.deliver()
    assert sim.c.failed == {"t1": "write_failed"}
    sim.ready("t1")
    sim.settle()
    assert sim.released == {"t1": "write_failed"}
    sim.check()


# -- progressive: chunk by chunk -------------------------------------------------------


def test_each_chunks_complete_blocks_are_written_before_the_last_step():
    sim = Sim(layers=2)
    sim.expect("t1", blocks=6)
    sim.deliver()
    ids = sim.progress("t1", blocks=2, full=2)  # chunk 1: blocks 0-1 complete
    _, first = sim.writes["t1"]
    assert first.src_blocks == ids[:2] and first.layers == (0, 2) and first.notif == b""
    sim.finish_writes()
    ids = sim.progress("t1", blocks=4, full=3)  # chunk 2 ends inside block 3
    _, second = sim.writes["t1"]
    assert second.src_blocks == ids[2:3]  # the split block waits for the next chunk
    sim.finish_writes()
    assert sim.chunks_sent == ["t1", "t1"]
    assert sim.c.delivered == []  # never on a partial prefix
    ids = sim.ready("t1", blocks=6, layers=1)  # the last step, layer by layer
    _, last = sim.writes["t1"]
    assert last.src_blocks == ids[3:6] and last.layers == (0, 1) and not last.notif
    sim.finish_writes()
    sim.ready("t1")
    _, last = sim.writes["t1"]
    assert last.src_blocks == ids[3:6] and last.layers == (1, 2) and last.notif
    sim.settle()
    assert sim.c.delivered == ["t1"]  # and the sim checked every block's source
    sim.check()


def test_a_late_registration_gets_every_completed_chunk_at_once():
    sim = Sim()
    sim.progress("t1", blocks=2, full=1)
    sim.progress("t1", blocks=4, full=3)
    sim.expect("t1", blocks=5)
    sim.deliver()
    _, post = sim.writes["t1"]
    assert len(post.src_blocks) == 3
    sim.finish_writes()
    sim.ready("t1", blocks=5)
    _, post = sim.writes["t1"]
    assert len(post.src_blocks) == 2 and post.notif
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_the_last_step_waits_for_a_chunk_write_in_flight():
    sim = Sim()
    sim.expect("t1", blocks=4)
    sim.deliver()
    sim.progress("t1", blocks=2, full=2)
    sim.ready("t1", blocks=4)  # the last step ends while chunk 1's WRITE is out
    _, post = sim.writes["t1"]
    assert len(post.src_blocks) == 2 and not post.notif
    sim.finish_writes()
    _, post = sim.writes["t1"]
    assert len(post.src_blocks) == 2 and post.notif
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_chunks_skip_the_blocks_decode_has_cached():
    sim = Sim()
    sim.expect("t1", blocks=3, skip=2)  # decode holds the first two blocks already
    sim.deliver()
    sim.progress("t1", blocks=2, full=2)
    assert not sim.writes  # nothing decode lacks is complete yet
    ids = sim.progress("t1", blocks=4, full=4)
    _, post = sim.writes["t1"]
    assert post.src_blocks == ids[2:4] and post.dst_blocks == sim.c.expected["t1"][:2]
    sim.finish_writes()
    sim.ready("t1", blocks=5)
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_the_chunk_that_fills_decodes_last_block_delivers_it():
    sim = Sim()
    sim.expect("t1", blocks=2, skip=1)  # decode lacks only blocks 1-2 of 4
    sim.deliver()
    sim.progress("t1", blocks=3, full=3)
    _, post = sim.writes["t1"]
    assert post.notif  # the whole claim, so decode may go
    sim.finish_writes()
    sim.poll_notifs()
    assert sim.c.delivered == ["t1"]
    sim.ready("t1", blocks=4)
    assert not sim.writes
    sim.settle()
    assert sim.released == {"t1": "sent"}
    sim.check()


def test_abort_between_chunks_releases_once_and_fails_decode():
    sim = Sim()
    sim.expect("t1", blocks=4)
    sim.deliver()
    sim.progress("t1", blocks=2, full=2)
    sim.abort_producer("t1")  # the client left mid-prompt, its chunk WRITE in flight
    assert "t1" not in sim.released  # not while the WRITE may read the blocks
    sim.finish_writes()
    sim.settle()
    assert sim.c.failed == {"t1": "aborted"}
    assert sim.released == {"t1": "aborted"}
    sim.check()


def test_decode_cancelling_between_chunks_ignores_the_rest_of_the_prompt():
    sim = Sim()
    sim.expect("t1", blocks=4)
    sim.deliver()
    sim.progress("t1", blocks=2, full=2)
    sim.finish_writes()
    sim.abort_consumer("t1")
    sim.deliver()
    assert sim.released == {"t1": "aborted"}
    sim.progress("t1", blocks=3, full=3)  # prefill computes on: nothing more moves
    sim.ready("t1", blocks=4)
    assert not sim.writes
    sim.settle()
    assert sim.c.failed == {"t1": "aborted"}
    sim.check()  # released once, whatever came after


# -- pull mode ----------------------------------------------------------------------


def test_pull_reads_after_the_producer_finishes():
    sim = Sim(mode="pull")
    sim.ready("t1")
    sim.expect("t1")
    sim.deliver()  # pull request -> grant
    sim.deliver()
    assert "t1" in sim.c.reads
    assert "t1" not in sim.released  # the producer holds its blocks for the read
    sim.settle()
    assert sim.c.delivered == ["t1"]
    assert sim.released == {"t1": "sent"}
    sim.check()


def test_pull_with_a_local_prefix_hit_reads_the_blocks_after_it():
    """Decode holds the first two blocks (a shared system prompt): the grant must name
    the producer's blocks 2.., not 0.., or decode fills its blocks with the wrong KV."""
    sim = Sim(mode="pull")
    sources = sim.ready("t1", blocks=5)
    sim.expect("t1", blocks=3, skip=2)
    sim.deliver()  # pull request -> grant
    sim.deliver()
    post = sim.c.reads["t1"]
    assert post.remote_blocks == sources[2:]
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_pull_asking_past_the_producers_blocks_is_refused():
    sim = Sim(mode="pull")
    sim.ready("t1", blocks=4)
    sim.expect("t1", blocks=3, skip=2)
    sim.settle()
    assert sim.c.failed == {"t1": "bad_blocks"}
    sim.check()


def test_pull_request_before_kv_is_granted_when_ready():
    sim = Sim(mode="pull")
    sim.expect("t1")
    sim.deliver()
    assert not sim.c.reads
    sim.ready("t1")
    sim.deliver()
    assert "t1" in sim.c.reads
    sim.settle()
    sim.check()


def test_pull_read_outliving_its_lease_is_not_trusted():
    sim = Sim(mode="pull")
    sim.ready("t1")
    sim.expect("t1")
    sim.deliver()
    sim.deliver()
    sim.now += sim.config.lease_s  # the READ is very slow
    sim.finish_reads()
    assert sim.c.failed == {"t1": "lease_expired"}
    sim.settle()
    sim.check()


def test_pull_grant_with_out_of_range_blocks_is_refused():
    sim = Sim(mode="pull", producer_blocks=64)
    sim.expect("t1", blocks=2)
    sim.deliver()
    grant = Grant("t1", [[3, 999]], 10.0)
    sim._run_consumer(sim.c, sim.c.machine.on_message(PRODUCER, grant, sim.now))
    assert sim.c.failed == {"t1": "bad_blocks"}
    assert not sim.c.reads


def test_pull_abort_during_read_waits_for_the_read():
    sim = Sim(mode="pull")
    sim.ready("t1")
    sim.expect("t1")
    sim.deliver()
    sim.deliver()
    sim.abort_consumer("t1")
    assert sim.c.failed == {}
    sim.finish_reads()
    assert sim.c.failed == {"t1": "aborted"}
    sim.settle()
    sim.check()


def test_push_and_pull_messages_are_refused_across_modes():
    sim = Sim(mode="pull")
    sim.expect("t1")
    sim.network.clear()
    sim._run_producer(sim.producer.on_message("decode0", Register("t1", [[0]], "x"), sim.now))
    message = sim.network[0][2]
    assert isinstance(message, Failed) and "pull mode" in message.detail


# -- configuration ---------------------------------------------------------------


def test_config_errors_name_the_setting():
    with pytest.raises(ConfigError, match="lease_s must be a positive number"):
        ProtocolConfig(lease_s=0)
    with pytest.raises(ConfigError, match=r"unknown protocol setting\(s\) \['leese_s'\]"):
        ProtocolConfig.from_mapping({"leese_s": 3})
    with pytest.raises(ConfigError, match="heartbeat_s"):
        ProtocolConfig(heartbeat_s=20, watchdog_s=30)
    with pytest.raises(ConfigError, match="mode"):
        ProtocolConfig(mode="shove")


def test_cancel_message_from_a_stranger_is_acked_harmlessly():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim._run_producer(sim.producer.on_message("decode0", Cancel("zz", "aborted"), sim.now))
    sim.settle()
    assert sim.c.delivered == ["t1"]
    sim.check()


def test_a_request_given_up_before_its_session_is_up_still_frees_the_producers_kv():
    """Decode declines a transfer (a follower, a full local prefix hit) while the side
    channel is still being set up: the Cancel must go out once it is up."""
    sim = Sim()
    consumer = Consumer(ProtocolConfig(), "digest")
    assert [type(a).__name__ for a in consumer.announce("t1", PRODUCER, 0.0)] == ["Connect"]
    assert consumer.abort("t1", 0.0) == []
    sends = consumer.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    assert [(s.peer, s.message) for s in sends] == [(PRODUCER, Cancel("t1", "aborted"))]
    assert (
        consumer.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.2) == []
    )  # only once


@pytest.mark.parametrize("stage", ["announced", "allocated", "kv_not_computed_yet"])
def test_a_request_given_up_while_its_session_comes_up_frees_the_producers_kv_at_once(stage):
    """The first request to a producer (or the first after a reconnect) ends while the
    side channel is still pairing: a client gone, a decode failing. No claim and no
    announcement reached the producer, so without the Cancel sent once the session is
    up it would keep the KV for its whole lease."""
    sim = Sim()
    sim.slow_handshakes = True
    if stage != "kv_not_computed_yet":
        sim.ready("t1")  # the prefill leg answered (the first token's path)
    sim.announce("t1")
    if stage != "announced":
        sim.expect("t1")
    sim.abort_consumer("t1")
    if stage != "announced":
        assert sim.c.failed == {"t1": "aborted"}  # nothing was claimed: blocks free at once
    sim.complete_handshakes()
    sim.deliver()
    if stage == "kv_not_computed_yet":
        assert not sim.released
        sim.ready("t1")  # prefill computes it after all: it goes back at once
    assert sim.released == {"t1": "decode_cancelled"}
    assert sim.now < sim.config.heartbeat_s  # not the lease, nor a timer
    sim.settle()
    sim.check()


def test_a_watchdog_that_fires_before_the_session_is_up_frees_the_producers_kv():
    sim = Sim()
    sim.slow_handshakes = True
    sim.ready("t1")
    sim.expect("t1")
    sim.advance(sim.config.watchdog_s + 0.5)
    assert sim.c.failed == {"t1": "watchdog_expired"}
    sim.complete_handshakes()
    sim.deliver()
    assert sim.released == {"t1": "decode_cancelled"}
    assert sim.now < sim.config.lease_s
    sim.check()


def test_the_routers_release_frees_held_kv_no_consumer_claimed_or_announced():
    """The decode leg never reached decode's engine (refused, unreachable, its client
    gone first): no consumer will ever name the transfer, and only the router knows.
    On its word the KV goes back at once, not at the end of the lease."""
    sim = Sim()
    sim.ready("t1")
    sim.router_release("t1")
    assert sim.released == {"t1": "router_released"} and not sim.kept
    sim.router_release("t1")  # again: nothing is held any more
    assert sim.kept == {"t1": "ended"} and sim.released == {"t1": "router_released"}
    sim.check()


def test_the_routers_release_of_kv_not_computed_yet_frees_it_the_moment_it_exists():
    sim = Sim()
    sim.pending("t1")
    sim.router_release("t1")
    assert not sim.released and not sim.kept
    sim.ready("t1")
    assert sim.released == {"t1": "router_released"}
    sim.check()


@pytest.mark.parametrize("consumer_stage", ["announced", "claimed", "writing"])
def test_the_routers_release_keeps_kv_a_consumer_announced_or_claimed(consumer_stage):
    """The router may be wrong: its leg reached decode after all. Decode's word wins,
    and the transfer goes on as if nothing was asked."""
    sim = Sim()
    sim.announce("t1")
    if consumer_stage != "announced":
        sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    if consumer_stage == "writing":
        assert "t1" in sim.writes
    sim.router_release("t1")
    assert sim.kept == {"t1": "announced" if consumer_stage == "announced" else "claimed"}
    assert not sim.released
    if consumer_stage == "announced":
        sim.expect("t1")
    sim.deliver()
    sim.settle()
    assert sim.c.delivered == ["t1"] and sim.released == {"t1": "sent"}
    sim.check()


def test_the_routers_release_of_kv_whose_announcers_were_lost_frees_it():
    """Every consumer that announced the transfer is gone: no claim is coming, as
    when it was never announced."""
    sim = Sim()
    sim.announce("t1")
    sim.deliver()
    sim.ready("t1")
    sim.kill_link()
    sim.router_release("t1")
    assert sim.released == {"t1": "router_released"}
    sim.check()


def test_the_routers_release_of_a_transfer_never_here_changes_nothing():
    sim = Sim()
    sim.router_release("nobody")
    assert sim.kept == {"nobody": "unknown"} and not sim.released
    sim.check()


def test_a_consumers_cancel_frees_only_kv_nobody_claimed():
    """A Cancel (authenticated: a forged or replayed one never reaches the machine)
    ends an unclaimed transfer, as "decode_cancelled"; one for a transfer another
    consumer claimed is only acked, and that claim goes on."""
    sim = Sim(consumers=2)
    sim._handshake(sim.consumers["decode1"])  # paired, as any holder of the secret can
    sim.ready("held")
    sim._run_producer(sim.producer.on_message("decode1", Cancel("held", "aborted"), sim.now))
    assert sim.released == {"held": "decode_cancelled"}
    sim._run_producer(sim.producer.on_message("decode1", Cancel("later", "aborted"), sim.now))
    sim.ready("later")  # the KV came after the Cancel: back at once
    assert sim.released["later"] == "decode_cancelled"
    sim.expect("theirs", consumer="decode0")
    sim.deliver()
    sim.ready("theirs")
    sim.network.clear()  # the acks
    sim._run_producer(sim.producer.on_message("decode1", Cancel("theirs", "aborted"), sim.now))
    assert [m for to, _, m in sim.network if to == "decode1"] == [CancelAck("theirs")]
    sim.settle()
    assert sim.consumers["decode0"].delivered == ["theirs"]
    assert sim.released["theirs"] == "sent"
    sim.check()


def test_the_last_layer_reported_twice_releases_once():
    """The layer hook and the end of the step both report the last layer."""
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.settle()
    assert sim.released == {"t1": "sent"}
    sim.ready("t1")  # the end-of-step report, after the transfer completed
    sim.settle()
    sim.check()  # a second ReleaseBlocks is an error there


@pytest.mark.parametrize("message", ["failed", "cancel_ack"])
def test_a_write_given_up_on_holds_the_blocks_until_it_cannot_land(message):
    sim = Sim()
    consumer = sim.c.machine
    sim.expect("t1")
    sim.deliver()
    if message == "failed":
        reply = Failed("t1", "write_failed", "timed out", may_land=True)
    else:
        consumer.abort("t1", sim.now)
        reply = CancelAck("t1", may_land=True)
    assert consumer.on_message(PRODUCER, reply, sim.now) == []  # not freed yet
    assert consumer.state_of("t1") == "cancelling"
    later = consumer.tick(sim.now + consumer._landing_bound() + 0.01)
    assert [type(a).__name__ for a in later] == ["TransferFailed"]


def test_a_producer_that_is_not_the_engine_the_decode_leg_names_gets_no_claim():
    """A stale route: the address now serves another engine (a restart, another
    deployment). Its KV is not this prompt's, so nothing is registered with it."""
    sim = Sim()
    consumer = Consumer(ProtocolConfig(), "digest")
    consumer.expect("t1", [Source(PRODUCER)], [1, 2], 0.0, engine="prefill-that-was")
    actions = consumer.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    (failed,) = actions
    assert type(failed).__name__ == "TransferFailed" and failed.reason == "handshake_failed"
    assert "prefill-that-was" in failed.detail
    assert sim.producer_hello.identity.engine_id in failed.detail
    ok = Consumer(ProtocolConfig(), "digest")
    ok.expect("t2", [Source(PRODUCER)], [1, 2], 0.0, engine=sim.producer_hello.identity.engine_id)
    sends = ok.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    assert [type(s.message).__name__ for s in sends] == ["Register"]


def test_a_producer_that_restarted_since_the_decode_leg_was_made_gets_no_claim():
    """Same engine id (set by its operator), new boot: the KV the leg names died with
    the old one."""
    sim = Sim()
    ident = sim.producer_hello.identity
    consumer = Consumer(ProtocolConfig(), "digest")
    consumer.expect("t1", [Source(PRODUCER, "boot-before")], [1, 2], 0.0, engine=ident.engine_id)
    (failed,) = consumer.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    assert failed.reason == "handshake_failed" and "restarted" in failed.detail
    assert "boot-before" in failed.detail and repr(ident.epoch) in failed.detail
    ok = Consumer(ProtocolConfig(), "digest")
    ok.expect("t2", [Source(PRODUCER, ident.epoch)], [1, 2], 0.0, engine=ident.engine_id)
    assert [
        type(s.message).__name__
        for s in ok.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    ] == ["Register"]


@pytest.mark.parametrize("machine", [consumer_machine, producer_machine])
def test_the_state_tables_in_the_docs_are_the_codes(machine):
    table = machine.TRANSITIONS
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    start = doc.index(f"<!-- {table.side}-transitions")
    shown = doc[doc.index("\n", start) + 1 : doc.index(f"<!-- end {table.side}-transitions")]
    assert shown.strip() == table.markdown(), f"paste {table.side}'s TRANSITIONS.markdown()"


EVENT_TABLES = {
    "consumer-events": consumer_moves.EVENTS,
    "producer-source-events": producer_moves.SOURCE,
    "producer-push-events": producer_moves.PUSH,
    "producer-pull-events": producer_moves.PULL,
}


@pytest.mark.parametrize("name", sorted(EVENT_TABLES))
def test_the_event_tables_in_the_docs_are_the_codes(name):
    """docs/protocol.md shows each (state, event) table as the code has it."""
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    start = doc.index(f"<!-- {name}: rendered from ")
    shown = doc[doc.index("\n", start) + 1 : doc.index(f"<!-- end {name} -->")]
    assert shown.strip() == EVENT_TABLES[name].markdown(), f"paste {name}'s markdown()"


def test_an_event_a_state_has_no_row_for_is_refused_naming_state_and_event():
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    source = sim.producer.books.sources["t1"]
    (claim,) = source.claims.values()
    assert (producer_moves.State.WRITING, producer_moves.Event.GRANT) not in claim.TABLE
    with pytest.raises(ProtocolError, match="cannot go from writing on grant"):
        claim.fire(producer_moves.Event.GRANT)
    assert claim.state == producer_moves.State.WRITING


def test_a_move_the_table_does_not_allow_is_refused_as_a_bug():
    consumer = Consumer(ProtocolConfig(), "digest")
    consumer.announce("t1", PRODUCER, 0.0)
    assert State.LANDING not in TRANSITIONS[State.ANNOUNCED]
    with pytest.raises(ProtocolError, match="cannot go from announced to landing"):
        TRANSITIONS.move(consumer._transfers[("t1", PRODUCER)], State.LANDING)


def test_the_producer_refuses_to_end_a_transfer_while_its_write_is_in_flight():
    """Ending a transfer mid-WRITE would release blocks the WRITE still reads, and a
    Failed would let the consumer free blocks it may still land in."""
    sim = Sim()
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    assert sim.producer.state_of("t1") == producer_machine.State.WRITING
    with pytest.raises(ProtocolError, match="producer: transfer 't1' cannot go from writing"):
        sim.producer.abandon("t1", "decode0", "write_failed", "staging failed", sim.now)


def test_a_failed_that_says_a_write_may_land_before_any_register_just_fails():
    """No WRITE can target blocks never registered: holding them would only leak time,
    and an announced transfer must stay free to be expected."""
    sim = Sim()
    consumer = Consumer(ProtocolConfig(), "digest")
    consumer.announce("t1", PRODUCER, 0.0)
    consumer.on_ready(PRODUCER, sim.producer_hello, sim.producer_layout, 0.1)
    consumer.on_message(PRODUCER, Failed("t1", "aborted", may_land=True), 0.2)
    assert consumer.state_of("t1") is None
    consumer.expect("t1", [Source(PRODUCER)], [1, 2], 0.3)  # a new claim, not "already expected"
    assert consumer.state_of("t1") == State.REGISTERED


def test_a_write_in_flight_when_the_consumer_is_lost_is_the_last_one():
    """Told its producer is gone, the consumer frees the blocks once a WRITE posted
    before then can no longer land: a later layer's WRITE could land after that."""
    sim = Sim(layers=2)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1", layers=1)
    assert "t1" in sim.writes
    sim.kill_link()
    sim.ready("t1")  # the last layer is computed while the first one crosses
    sim.finish_writes()
    assert "t1" not in sim.writes
    assert sim.released == {"t1": "peer_lost"}
    sim.settle()
    sim.check()


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_second_pull_request_for_a_granted_transfer_grants_nothing_more(cancelled):
    """One claim per transfer: a repeated PullRequest must neither expose the blocks
    again and restart the lease, nor revive a grant the consumer cancelled."""
    sim = Sim(mode="pull")
    sim.ready("t1")
    sim.expect("t1")
    sim.deliver(1)  # the PullRequest: the producer grants
    consumer = sim.c.name
    if cancelled:
        sim.producer.on_message(consumer, Cancel("t1", "aborted"), sim.now)
    again = sim.producer.on_message(consumer, PullRequest("t1", 4), sim.now)
    assert [type(a).__name__ for a in again] == ["Counted"]
    assert again[0].name == "duplicate_pull_requests"


def test_a_grant_cancelled_in_flight_is_released_as_cancelled_and_told_once():
    """The consumer aborted while its Grant was on the way: the producer acks the
    Cancel and keeps the blocks while a READ could copy them, then lets go for the
    reason the transfer really ended, without a second word to the consumer."""
    sim = Sim(mode="pull")
    sim.ready("t1")
    sim.expect("t1")
    sim.deliver(1)  # the PullRequest: the Grant is on its way
    sim.abort_consumer("t1")
    sim.deliver()  # the Cancel crosses the Grant; the CancelAck goes back
    assert sim.producer.state_of("t1") == "abandoned"
    sim.now += sim.config.lease_s + 1
    actions = sim.producer.tick(sim.now)
    assert [type(a).__name__ for a in actions] == ["ReleaseBlocks"]
    sim._run_producer(actions)
    assert sim.released == {"t1": "aborted"}
    sim.settle()
    sim.check()


def test_decode_calls_into_nixl_often_only_from_writing_until_the_transfer_ends():
    """A decode holding blocks for a prefill that has not started need not poll NIXL
    at full rate (for every waiting request, for nothing); from the producer's Writing
    until the transfer ends it must, since over UCX's TCP transport a WRITE's bytes
    move only while the target calls in. Writing comes once, before the first WRITE."""
    sim = Sim(layers=2)
    sim.expect("t1", blocks=6)
    sim.deliver()
    consumer = sim.c.machine
    assert not consumer.awaiting_writes()
    sim.progress("t1", blocks=2, full=2)  # the first chunk's WRITE is posted
    assert [type(message) for *_, message in sim.network] == [Writing]
    assert not consumer.awaiting_writes()  # not told yet
    sim.deliver()
    assert consumer.awaiting_writes()
    sim.finish_writes()
    sim.progress("t1", blocks=4, full=3)
    sim.finish_writes()
    sim.ready("t1", blocks=6)
    assert Writing not in [type(message) for *_, message in sim.network]
    sim.settle()
    assert sim.c.delivered == ["t1"]
    assert not consumer.awaiting_writes()
    sim.check()


def test_a_stray_writing_message_is_counted_not_acted_on():
    sim = Sim()
    sim._run_consumer(sim.c, sim.c.machine.on_message(PRODUCER, Writing("nobody"), sim.now))
    assert sim.counted[-1].labels == {"why": "unknown_transfer"}
    assert not sim.c.machine.awaiting_writes()


def test_a_write_whose_posting_raises_ends_failed_and_frees_both_sides(monkeypatch):
    """A bug below the interpreter (NIXL, a backend) raising while WRITEs are posted:
    none may stay WRITING, which neither lease nor TTL would ever end."""
    sim = Sim()
    ports = sim.producer_interpreter.data

    def broken(writes):
        raise RuntimeError("agent.make_transfer blew up")

    monkeypatch.setattr(ports, "post_writes", broken)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    assert sim.writes == {}  # nothing was posted
    sim.settle()
    assert sim.c.failed == {"t1": "write_failed"}
    assert sim.released == {"t1": "write_failed"}
    sim.check()


def test_a_staging_copy_that_fails_at_delivery_fails_the_decode_request(monkeypatch):
    """Staged backends copy the landed KV onto the device at delivery: if that copy
    fails, the engine must hear of it, or its request waits forever."""
    sim = Sim()

    def broken(transfer_id):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(sim.c.interpreter.data, "landed", broken)
    sim.expect("t1")
    sim.deliver()
    sim.ready("t1")
    sim.settle()
    assert sim.c.failed == {"t1": "stage_failed"} and not sim.c.delivered
    sim.check()


def test_each_machine_counts_its_transfers_by_state():
    """What /kvpush/state?detail=1 shows: which state holds a transfer."""
    sim = Sim()
    sim.pending("t1")
    sim.ready("t2")
    assert sim.producer.counts() == {"computing": 1, "held": 1}
    sim.expect("t2")
    assert sim.c.machine.counts() == {"registered": 1}
    sim.deliver()
    assert sim.producer.counts() == {"computing": 1, "writing": 1}
    sim.abort_producer("t1")
    sim.settle()
    assert sim.producer.counts() == {} and sim.c.machine.counts() == {}
