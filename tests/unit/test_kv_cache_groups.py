"""Hybrid models' KV cache groups (full attention and sliding window under vLLM's
hybrid manager) through the layout, the machines and the request ledger: one block
list a transfer, position i's id of each group in turn; a pair with the null block
on either side moves nothing; a position is never shifted by another group's."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from protocol_sim import hello, layout

from kvpush.engine.ledger import Ledger
from kvpush.engine.steps import Announce, state_positions
from kvpush.errors import RegionError
from kvpush.layout import Shard, interleave, moving_pairs, plan
from kvpush.protocol import actions as act
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer, Source
from kvpush.protocol.messages import Failed, Grant, PullRequest, Register
from kvpush.protocol.producer import Producer

CONFIG = ProtocolConfig(lease_s=10, registration_ttl_s=10, watchdog_s=8, heartbeat_s=1,
                        write_grace_s=2, landing_s=3, tombstone_s=60, max_wait_s=40)  # fmt: skip
NULL = 0


def _layout(groups: int = 2, tokens: int = 16):
    return msgspec.structs.replace(
        layout(16, 0x9000), groups=groups, null_block=NULL, tokens_per_block=tokens
    )


def _producer(mode: str = "push") -> Producer:
    config = dataclasses.replace(CONFIG, mode=mode)
    producer = Producer(config, block_tokens=16, null_block=NULL)
    peer_hello = msgspec.structs.replace(
        hello("consumer", mode, 16, "d", 0x9000, config), layout_digest=_layout().digest()
    )
    producer.on_ready("d", peer_hello, _layout(), 0.0)
    return producer


def _consumer(mode: str) -> Consumer:
    config = dataclasses.replace(CONFIG, mode=mode)
    consumer = Consumer(config, _layout().digest(), block_tokens=16, null_block=NULL)
    peer_hello = msgspec.structs.replace(
        hello("producer", mode, 16, "p", 0x9000, config), layout_digest=_layout().digest()
    )
    consumer.on_ready("p", peer_hello, _layout(), 0.0)
    return consumer


def _writes(actions) -> list[act.PostWrite]:
    return [a for a in actions if isinstance(a, act.PostWrite)]


def _sent(actions, kind):
    return [a.message for a in actions if isinstance(a, act.Send) and isinstance(a.message, kind)]


# -- layout --------------------------------------------------------------------------


def test_interleave_puts_each_positions_ids_together_group_by_group():
    assert interleave([[1, 2, 3], [7, 0, 9]]) == [1, 7, 2, 0, 3, 9]
    assert interleave([[4, 5]]) == [4, 5]
    with pytest.raises(RegionError, match="different block counts"):
        interleave([[1, 2], [3]])


def test_moving_pairs_drops_a_pair_with_the_null_block_on_either_side():
    assert moving_pairs([5, 0, 6, 7], [8, 9, 0, 10], 0, 0) == ([5, 7], [8, 10])
    # Without a null block every id is a block, 0 included.
    assert moving_pairs([0, 1], [2, 0], -1, -1) == ([0, 1], [2, 0])


def test_layouts_of_different_group_counts_or_block_sizes_do_not_pair():
    with pytest.raises(RegionError, match="KV cache groups: the producer has 2, the consumer 1"):
        plan(_layout(2), _layout(1))
    with pytest.raises(RegionError, match="hybrid models pair at equal block sizes"):
        plan(_layout(2, tokens=16), _layout(2, tokens=32))
    src, dst = plan(_layout(2), _layout(2))
    assert len(src) == len(dst) > 0


# -- machines ------------------------------------------------------------------------


def test_a_push_writes_every_groups_pairs_and_skips_the_positions_a_window_left():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    # Decode: 3 positions; its sliding group (second) left position 0 (null).
    register = Register("t1", [interleave([[9, 10, 11], [0, 12, 13]])], _layout().digest())
    assert producer.on_message("d", register, 0.1) == []
    # Prefill freed nothing decode needs: its position 0 sliding block is real, but unwanted.
    (write,) = _writes(producer.kv_ready("t1", interleave([[1, 2, 3], [4, 5, 6]]), 0.2))
    assert (write.src_blocks, write.dst_blocks) == ([1, 2, 5, 3, 6], [9, 10, 12, 11, 13])


def test_a_progressive_chunk_of_only_window_left_positions_moves_nothing_and_the_rest_follow():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    register = Register("t1", [interleave([[9, 10, 11], [0, 0, 13]])], _layout().digest())
    assert producer.on_message("d", register, 0.1) == []
    # First chunk: position 0 of both groups complete (two entries of the list).
    chunk = interleave([[1, 2, 3], [4, 5, 6]])
    (write,) = _writes(producer.kv_progress("t1", chunk, 2, 0.2))
    assert (write.src_blocks, write.dst_blocks) == ([1], [9])  # the sliding pair is null
    producer.on_write_done("t1", "d", True, 0.3)
    (last,) = _writes(producer.kv_ready("t1", chunk, 0.4))
    assert (last.src_blocks, last.dst_blocks) == ([2, 3, 6], [10, 11, 13])
    assert last.notif


def test_a_chunk_of_only_window_left_positions_posts_no_write():
    config = dataclasses.replace(CONFIG, mode="push")
    producer = Producer(config, block_tokens=16, null_block=NULL)
    one = _layout(groups=1)
    peer_hello = msgspec.structs.replace(
        hello("consumer", "push", 16, "d", 0x9000, config), layout_digest=one.digest()
    )
    producer.on_ready("d", peer_hello, one, 0.0)
    producer.kv_pending("t1", 0.0)
    # A model of sliding-window layers only: one group, its first position left.
    producer.on_message("d", Register("t1", [[0, 9, 10]], one.digest()), 0.1)
    assert _writes(producer.kv_progress("t1", [1, 2, 3], 1, 0.2)) == []
    (last,) = _writes(producer.kv_ready("t1", [1, 2, 3], 0.3))
    assert (last.src_blocks, last.dst_blocks, bool(last.notif)) == ([2, 3], [9, 10], True)


def test_null_destinations_may_repeat_but_a_real_one_may_not():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    nulls = Register("t1", [interleave([[9, 10, 11], [0, 0, 12]])], _layout().digest())
    assert producer.on_message("d", nulls, 0.1) == []
    producer.kv_pending("t2", 0.0)
    twice = Register("t2", [interleave([[9, 9], [0, 0]])], _layout().digest())
    (failed,) = _sent(producer.on_message("d", twice, 0.1), Failed)
    assert failed.reason == "bad_blocks" and "appears twice" in failed.detail


def test_a_registration_or_grant_ending_in_the_null_block_is_refused():
    producer = _producer()
    producer.kv_pending("t1", 0.0)
    ends_null = Register("t1", [interleave([[9, 10], [11, 0]])], _layout().digest())
    (failed,) = _sent(producer.on_message("d", ends_null, 0.1), Failed)
    assert failed.reason == "bad_blocks" and "last destination is the null block" in failed.detail
    consumer = _consumer("pull")
    consumer.expect("t1", [Source("p", "", 1)], interleave([[9, 10], [11, 12]]), 0.0)
    grant = Grant("t1", [interleave([[1, 2], [3, 0]])], lease_s=10)
    actions = consumer.on_message("p", grant, 0.1)
    assert not [a for a in actions if isinstance(a, act.PostRead)]
    assert "the last granted block is the null block" in str(actions)


def test_a_pull_reads_every_groups_pairs_but_not_the_null_ones():
    consumer = _consumer("pull")
    consumer.expect("t1", [Source("p", "", 1)], interleave([[9, 10], [0, 12]]), 0.0)
    grant = Grant("t1", [interleave([[1, 2], [0, 5]])], lease_s=10)
    (read,) = [a for a in consumer.on_message("p", grant, 0.1) if isinstance(a, act.PostRead)]
    assert (read.local_blocks, read.remote_blocks) == ([9, 10, 12], [1, 2, 5])


def test_a_pull_producer_grants_the_interleaved_list_after_the_consumers_prefix():
    producer = _producer("pull")
    producer.kv_ready("t1", interleave([[1, 2, 3], [0, 5, 6]]), 0.0)
    actions = producer.on_message("d", PullRequest("t1", num_blocks=4, skip_blocks=2), 0.1)
    (grant,) = _sent(actions, Grant)
    assert grant.block_ids == [[2, 5, 3, 6]]


# -- the request ledger --------------------------------------------------------------


def test_decode_claims_each_groups_blocks_past_its_prefix_interleaved():
    ledger = Ledger(block_size=16)
    ledger.decode.announced("d1", "t1", Announce("t1", ("p:1",), "engine-p"))
    ledger.decode.matched("d1", prompt_len=64, computed=16)
    full, sliding = [31, 32, 33, 34], [0, 0, 43, 44]
    assert ledger.decode.allocated("d1", [full, sliding], external_tokens=47)
    (expect,) = ledger.take_plan().expects
    assert expect.block_ids == (32, 0, 33, 43, 34, 44)
    assert expect.skip_blocks == 2  # one position: an entry of each group


def test_a_prefill_legs_chunks_count_every_groups_entries():
    ledger = Ledger(block_size=16)
    ledger.prefill.arrived("p1", "xfer-1", "base", prompt_len=40, named_here=False)
    ledger.prefill.blocks_assigned("p1", [[1, 2], [5, 6]], resumed=False)
    ledger.prefill.step_scheduled({"p1": 32})
    (progress,) = ledger.take_plan().progress
    assert (progress.block_ids, progress.full_blocks) == ((1, 5, 2, 6), 4)
    ledger.prefill.blocks_assigned("p1", [[3], [7]], resumed=False)
    ledger.prefill.step_scheduled({"p1": 40})
    (produce,) = ledger.take_plan().produces
    assert produce.block_ids == (1, 5, 2, 6, 3, 7)


def test_a_sliding_window_decode_loads_all_but_the_last_token_and_computes_that_one():
    ledger = Ledger(block_size=16, windowed=True)
    ledger.decode.announced("d1", "t1", Announce("t1", ("p:1",), "engine-p"))
    match = ledger.decode.matched("d1", prompt_len=64, computed=16)
    assert match.tokens == 47  # 64 tokens, 16 cached here, the last one computed here
    full = Ledger(block_size=16)
    full.decode.announced("d1", "t1", Announce("t1", ("p:1",), "engine-p"))
    assert full.decode.matched("d1", prompt_len=64, computed=16).tokens == 48
    cached = Ledger(block_size=16, windowed=True)
    cached.decode.announced("d1", "t1", Announce("t1", ("p:1",), "engine-p"))
    assert cached.decode.matched("d1", prompt_len=64, computed=63).local  # nothing to load


# -- recurrent state (Mamba, gated DeltaNet) -------------------------------------------


def test_state_positions_keep_a_state_groups_running_state_at_the_last_position():
    full, state = [11, 12, 13], [0, 21, 22]  # vLLM's "align" mode: a checkpoint, then the state
    assert state_positions([full, state], (1,), NULL, 3) == [[11, 12, 13], [0, 0, 22]]
    assert state_positions([full, [22]], (1,), NULL, 3) == [[11, 12, 13], [0, 0, 22]]  # "none"
    assert state_positions([full, [0, 0]], (1,), NULL, 3) == [[11, 12, 13], [0, 0, 0]]
    assert state_positions([full, state], (1,), NULL, 2) == [[11, 12], [0, 22]]
    assert state_positions([[], state], (1,), NULL, 0) == [[], []]  # no positions yet


def test_a_recurrent_models_legs_pair_the_prefills_last_state_with_decodes():
    """Prefill computes 63 of a 64-token prompt (the decode leg computes the last one):
    its state after token 63 lands in the block decode reads it from."""
    prefill = Ledger(block_size=16, states=(1,), null=NULL)
    prefill.prefill.arrived("p1", "xfer-1", "base", prompt_len=64, named_here=False)
    prefill.prefill.left_last_token("p1")
    prefill.prefill.blocks_assigned("p1", [[1, 2], [0, 8]], resumed=False)
    prefill.prefill.step_scheduled({"p1": 32})
    (progress,) = prefill.take_plan().progress
    assert progress.block_ids == (1, 0, 2, 8)  # 8 is decode's null position: nothing moves
    prefill.prefill.blocks_assigned("p1", [[3, 4], [9, 0]], resumed=False)
    prefill.prefill.step_scheduled({"p1": 63})
    (produce,) = prefill.take_plan().produces
    assert produce.block_ids == (1, 0, 2, 0, 3, 0, 4, 9)

    decode = Ledger(block_size=16, states=(1,), null=NULL)
    decode.decode.announced("d1", "t1", Announce("t1", ("p:1",), "engine-p"))
    assert decode.decode.matched("d1", prompt_len=64, computed=16).tokens == 47
    assert decode.decode.allocated("d1", [[31, 32, 33, 34], [0, 0, 0, 44]], external_tokens=47)
    (expect,) = decode.take_plan().expects
    assert expect.block_ids == (32, 0, 33, 0, 34, 44)
    assert expect.skip_blocks == 2


def test_recurrent_state_pairs_at_equal_tp_and_equal_state_groups_only():
    states = msgspec.structs.replace(_layout(3), states=1)
    with pytest.raises(RegionError, match="recurrent-state groups: the producer has 1, the consum"):
        plan(states, _layout(3))
    wide = msgspec.structs.replace(states, shard=Shard(0, 2, 2))
    with pytest.raises(RegionError, match="producer runs TP 1 and the consumer TP 2 with recurr"):
        plan(states, wide)
    src, dst = plan(states, states)
    assert len(src) == len(dst) > 0
