"""The machines between peers of different block sizes: block ids on the wire are
pages of the smaller size, a larger block's last page past the prompt is no error,
and KV a consumer expects but the producer lacks still is."""

from __future__ import annotations

import dataclasses

import msgspec
from protocol_sim import hello, layout

from kvpush.protocol import actions as act
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer, Source
from kvpush.protocol.messages import Failed, Grant, PullRequest, Register
from kvpush.protocol.producer import Producer

CONFIG = ProtocolConfig(lease_s=10, registration_ttl_s=10, watchdog_s=8, heartbeat_s=1,
                        write_grace_s=2, landing_s=3, tombstone_s=60, max_wait_s=40)  # fmt: skip


def _layout(tokens: int):
    return msgspec.structs.replace(layout(16, 0x9000), tokens_per_block=tokens)


def _producer(own: int, consumer: int, mode: str = "push") -> Producer:
    config = dataclasses.replace(CONFIG, mode=mode)
    producer = Producer(config, block_tokens=own)
    peer_hello = msgspec.structs.replace(
        hello("consumer", mode, 16, "d", 0x9000, config), layout_digest=_layout(consumer).digest()
    )
    producer.on_ready("d", peer_hello, _layout(consumer), 0.0)
    return producer


def _writes(actions) -> list[act.PostWrite]:
    return [a for a in actions if isinstance(a, act.PostWrite)]


def _failed(actions) -> list[Failed]:
    return [a.message for a in actions if isinstance(a, act.Send) and isinstance(a.message, Failed)]


def test_a_producer_of_larger_blocks_writes_their_pages_after_the_consumers_prefix():
    producer = _producer(32, 16)  # a prefill block is two of decode's
    producer.kv_pending("t1", 0.0)
    # 40 prompt tokens: decode holds its first block (16) and wants 3 more pages.
    register = Register("t1", [[3, 4]], _layout(16).digest(), skip_blocks=1)
    assert producer.on_message("d", register, 0.1) == []
    (write,) = _writes(producer.kv_ready("t1", [7, 8], 0.2))
    # Prefill block 7 is pages 14 and 15; page 14 is decode's cached prefix.
    assert (write.src_blocks, write.dst_blocks) == ([15, 16], [3, 4])


def test_a_consumer_of_larger_blocks_may_reach_past_the_prompt_by_less_than_a_block():
    producer = _producer(16, 32)  # a decode block is two of prefill's
    producer.kv_pending("t1", 0.0)
    # 40 tokens: prefill holds 3 blocks; decode 2 blocks, 4 pages, the last past the prompt.
    producer.on_message("d", Register("t1", [[6, 7, 8, 9]], _layout(32).digest()), 0.1)
    (write,) = _writes(producer.kv_ready("t1", [7, 8, 9], 0.2))
    assert (write.src_blocks, write.dst_blocks) == ([7, 8, 9], [6, 7, 8])


def test_a_consumer_that_wants_a_block_more_than_the_producer_holds_is_refused():
    producer = _producer(16, 32)
    producer.kv_pending("t1", 0.0)
    producer.on_message("d", Register("t1", [[6, 7, 8, 9, 10, 11]], _layout(32).digest()), 0.1)
    actions = producer.kv_ready("t1", [7, 8, 9], 0.2)
    assert _writes(actions) == []
    assert [f.reason for f in _failed(actions)] == ["bad_blocks"]


def test_page_ids_past_the_consumers_cache_are_refused_naming_pages():
    producer = _producer(16, 32)  # the consumer's 16 blocks are 32 pages
    producer.kv_pending("t1", 0.0)
    actions = producer.on_message("d", Register("t1", [[31, 32]], _layout(32).digest()), 0.1)
    (failed,) = _failed(actions)
    assert failed.reason == "bad_blocks" and "page (2 a block) ids [32]" in failed.detail


def test_a_pull_producer_grants_pages_and_exposes_the_blocks_that_hold_them():
    producer = _producer(32, 16, "pull")
    producer.kv_ready("t1", [7, 8], 0.0)
    actions = producer.on_message("d", PullRequest("t1", num_blocks=3, skip_blocks=1), 0.1)
    (grant,) = _sent(actions, Grant)
    (expose,) = [a for a in actions if isinstance(a, act.ExposeBlocks)]
    assert (grant.block_ids, expose.block_ids) == ([[15, 16, 17]], [7, 8])


def _consumer(own: int, producer: int, mode: str = "push") -> Consumer:
    config = dataclasses.replace(CONFIG, mode=mode)
    consumer = Consumer(config, _layout(own).digest(), block_tokens=own)
    peer_hello = msgspec.structs.replace(
        hello("producer", mode, 16, "p", 0x9000, config), layout_digest=_layout(producer).digest()
    )
    consumer.on_ready("p", peer_hello, _layout(producer), 0.0)
    return consumer


def _sent(actions, kind):
    return [a.message for a in actions if isinstance(a, act.Send) and isinstance(a.message, kind)]


def test_a_consumer_of_larger_blocks_registers_their_pages():
    consumer = _consumer(32, 16)
    actions = consumer.expect("t1", [Source("p", "", 1)], [3, 4], 0.0, skip_blocks=1)
    (register,) = _sent(actions, Register)
    assert (register.block_ids, register.skip_blocks) == ([[6, 7, 8, 9]], 2)


def test_a_pull_grant_short_of_the_consumers_last_block_reads_only_what_exists():
    consumer = _consumer(32, 16, "pull")
    (ask,) = _sent(consumer.expect("t1", [Source("p", "", 1)], [3, 4], 0.0), PullRequest)
    assert (ask.num_blocks, ask.skip_blocks) == (4, 0)
    (read,) = [a for a in consumer.on_message("p", Grant("t1", [[7, 8, 9]], 10), 0.1)
               if isinstance(a, act.PostRead)]  # fmt: skip
    assert (read.local_blocks, read.remote_blocks) == ([6, 7, 8], [7, 8, 9])


def test_a_pull_grant_a_whole_block_short_fails_the_transfer():
    consumer = _consumer(32, 16, "pull")
    consumer.expect("t1", [Source("p", "", 1)], [3, 4], 0.0)
    actions = consumer.on_message("p", Grant("t1", [[7, 8]], 10), 0.1)
    assert not [a for a in actions if isinstance(a, act.PostRead)]
    (failed,) = [a for a in actions if isinstance(a, act.TransferFailed)]
    assert failed.reason == "bad_blocks"
