"""The push protocol between two OS processes over real NIXL, with the bytes checked.

Each side is a kvpush Node (loop thread, side channel, NIXL agent) in its own
process; the producer's and consumer's KV live in separate address spaces.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.nixl

FAST = {"write_grace_s": 1.0, "watchdog_s": 20.0, "heartbeat_s": 0.5}


@pytest.fixture
def spawn(request):
    from conftest import RemotePeer

    peers = []

    def start(role: str, engine_id: str, **kwargs):
        peer = RemotePeer()
        peers.append(peer)
        hello = peer.call("init", kind="node", role=role, engine_id=engine_id, **{**FAST, **kwargs})
        peer.address = hello["address"]
        return peer

    yield start
    for peer in peers:
        peer.kill()


def _one(peer, seconds=15.0):
    outcomes = peer.call("results", count=1, seconds=seconds, timeout=seconds + 30)["outcomes"]
    assert outcomes, "no outcome arrived"
    return outcomes[0]


def _until(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.02)


def _registered(producer, count: int = 1) -> None:
    """Wait until `count` registrations have reached the producer. Pairing two TP
    ranks (side channel, handshake, NIXL metadata) can take seconds on a loaded
    machine; a registration that never comes still fails."""
    _until(lambda: producer.call("registered")["count"] >= count, "registration", 30.0)


def _unlinked(peer) -> None:
    """Wait until the peer has seen its side-channel links close."""
    _until(lambda: peer.call("stats")["links"] == [], "the link closing")


def _quiet(peer):
    stats = peer.call("stats")
    assert stats["producer_holding"] == [] and stats["consumer_waiting"] == [], stats
    assert stats["writes_in_flight"] == 0 and stats["reads_in_flight"] == 0, stats
    return stats


def _values(peer):
    return peer.call("values")["values"]


@pytest.mark.parametrize("order", ["registration_first", "kv_first"])
def test_push_moves_the_bytes_into_the_registered_blocks(spawn, order):
    producer = spawn("producer", "prefill")
    consumer = spawn("consumer", "decode")
    if order == "kv_first":
        producer.call("kv_ready", tid="t1", blocks=[0, 1, 2], value=0x42)
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[3, 5, 7])
    if order == "registration_first":
        _registered(producer)
        producer.call("kv_ready", tid="t1", blocks=[0, 1, 2], value=0x42)
    assert _one(consumer)["kind"] == "delivered"
    released = _one(producer)
    assert (released["kind"], released["reason"]) == ("released", "sent")
    for layer in _values(consumer):
        for block, values in enumerate(layer):
            assert values == ([0x42] if block in (3, 5, 7) else [0]), block
    _quiet(producer)
    _quiet(consumer)


def test_earlier_chunks_cross_before_the_last_step_runs(spawn):
    producer = spawn("producer", "prefill", layers=2)
    consumer = spawn("consumer", "decode", layers=2)
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[8, 9, 10])
    _registered(producer)
    producer.call("kv_progress", tid="t1", blocks=[0, 1], full=1, value=0x61)
    _until(lambda: _values(consumer)[1][8] == [0x61], "the first chunk's block landing")
    assert _one(producer)["kind"] == "chunk_sent"
    assert [layer[9] for layer in _values(consumer)] == [[0], [0]]  # split: not yet
    assert consumer.call("results", count=1, seconds=0.3)["outcomes"] == []  # not whole
    producer.call("kv_ready", tid="t1", blocks=[0, 1, 2], value=0x62)
    delivered = _one(consumer)
    assert (delivered["kind"], delivered["nbytes"]) == ("delivered", 2 * 3 * 4096)
    for layer in _values(consumer):  # the chunk's block was not sent again
        assert (layer[8], layer[9], layer[10]) == ([0x61], [0x62], [0x62])
    released = _one(producer)
    assert (released["reason"], released["nbytes"]) == ("sent", 2 * 3 * 4096)
    assert producer.call("stats")["metrics"]["chunk_writes"] == {"total": 1}


def test_layers_cross_as_they_are_computed(spawn):
    producer = spawn("producer", "prefill", layers=4)
    consumer = spawn("consumer", "decode", layers=4)
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[8, 9])
    _registered(producer)
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x51, layers=[0])
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x51, layers=[1, 2])
    _until(lambda: _values(consumer)[2][8] == [0x51], "the third layer landing")
    # Three layers have crossed already; the transfer is not complete without the last.
    assert consumer.call("results", count=1, seconds=0.3)["outcomes"] == []
    partial = _values(consumer)
    assert [layer[8] for layer in partial] == [[0x51], [0x51], [0x51], [0]]
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x51, layers=[3])
    delivered = _one(consumer)
    assert (delivered["kind"], delivered["nbytes"]) == ("delivered", 4 * 2 * 4096)
    for layer in _values(consumer):
        assert layer[8] == [0x51] and layer[9] == [0x51]
    released = _one(producer)
    assert (released["reason"], released["nbytes"]) == ("sent", 4 * 2 * 4096)
    metrics = producer.call("stats")["metrics"]
    assert metrics["bytes_moved"]["op=WRITE"] == 4 * 2 * 4096


def test_a_batch_ready_together_goes_in_one_nixl_write_and_each_lands(spawn):
    producer = spawn("producer", "prefill", layers=3)
    consumer = spawn("consumer", "decode", layers=3)
    batch = {"t1": ([0, 1], [9, 4], 0x11), "t2": ([2], [7], 0x22), "t3": ([3, 5], [1, 2], 0x33)}
    for tid, (_, destinations, _) in batch.items():
        consumer.call("expect", tid=tid, producer=producer.address, blocks=destinations)
    _registered(producer, len(batch))
    items = [[tid, sources, value] for tid, (sources, _, value) in batch.items()]
    producer.call("kv_ready_batch", items=items)
    delivered = consumer.call("results", count=3, seconds=15, timeout=45)["outcomes"]
    assert sorted((o["kind"], o["transfer_id"]) for o in delivered) == [
        ("delivered", tid) for tid in batch
    ]
    released = producer.call("results", count=3, seconds=15, timeout=45)["outcomes"]
    assert sorted(o["reason"] for o in released) == ["sent"] * 3
    # One post carried all three; its notification ended each transfer.
    assert producer.call("stats")["nixl_posts"] == 1
    expected = {block: value for _, destinations, value in batch.values() for block in destinations}
    for layer in _values(consumer):
        for block, values in enumerate(layer):
            assert values == [expected.get(block, 0)], block
    _quiet(producer)
    _quiet(consumer)


def test_a_write_whose_nixl_peer_went_is_posted_again_on_a_fresh_one_and_lands(spawn):
    # The consumer's NIXL agent vanishes from under the producer (as its UCX endpoint
    # does when a short cut takes the route): the WRITE fails, the data path loads
    # the consumer's metadata again, and the retry a heartbeat later lands.
    producer = spawn("producer", "prefill")
    consumer = spawn("consumer", "decode")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1, 2])
    _registered(producer)
    producer.call("forget_peers")
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x42)
    delivered = _one(consumer)
    assert (delivered["kind"], delivered["transfer_id"]) == ("delivered", "t1")
    assert _one(producer)["reason"] == "sent"
    layer_values = _values(consumer)
    for layer in layer_values:
        assert [layer[block] for block in (1, 2)] == [[0x42], [0x42]], layer_values
    counters = _quiet(producer)["metrics"]
    assert _total(counters, "write_retries") >= 1 and _total(counters, "reconnects") >= 1
    _quiet(consumer)


def _total(counters: dict, name: str) -> float:
    """A counter's sum over its labels, from a peer's metrics snapshot."""
    return sum(counters.get(name, {}).values())


def test_write_that_fails_to_post_fails_the_consumer_at_once_without_retries(spawn):
    producer = spawn("producer", "prefill", write_retries=0)
    consumer = spawn("consumer", "decode")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1, 2])
    _registered(producer)
    producer.call("forget_peers")
    started = time.monotonic()
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x42)
    failed = _one(consumer)
    assert (failed["kind"], failed["reason"]) == ("failed", "write_failed")
    assert time.monotonic() - started < 5  # a message, not the 20 s watchdog
    assert _one(producer)["reason"] == "write_failed"
    assert all(values == [0] for layer in _values(consumer) for values in layer)
    _quiet(consumer)


def test_producer_death_fails_the_consumer_after_the_write_grace(spawn):
    producer = spawn("producer", "prefill")
    consumer = spawn("consumer", "decode")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1, 2])
    _registered(producer)
    producer.kill()
    started = time.monotonic()
    failed = _one(consumer)
    assert (failed["kind"], failed["reason"]) == ("failed", "peer_lost")
    assert 0.8 <= time.monotonic() - started < 6
    _quiet(consumer)


def test_consumer_death_releases_the_producer_blocks(spawn):
    producer = spawn("producer", "prefill")
    consumer = spawn("consumer", "decode")
    producer.call("kv_pending", tid="t1")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1, 2])
    _registered(producer)
    consumer.kill()
    _unlinked(producer)
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x42)
    released = _one(producer)
    assert (released["kind"], released["reason"]) == ("released", "peer_lost")
    _quiet(producer)


def test_consumer_abort_mid_transfer_holds_blocks_until_settled(spawn):
    producer = spawn("producer", "prefill", device="gated")
    consumer = spawn("consumer", "decode")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[2, 4])
    _registered(producer)
    producer.call("hold_fence")
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=0x77)  # stuck at the fence
    assert producer.call("wait_at_fence")["held"]
    consumer.call("abort", tid="t1")
    early = consumer.call("results", count=1, seconds=1.0)["outcomes"]
    assert early == []  # the blocks stay held while the WRITE may still come
    producer.call("release_fence")
    failed = _one(consumer)
    assert (failed["kind"], failed["reason"]) == ("failed", "aborted")
    # The WRITE did land, in blocks the consumer still held: nobody else's bytes moved.
    for layer in _values(consumer):
        assert layer[2] == [0x77] and layer[4] == [0x77]
        assert all(layer[b] == [0] for b in range(len(layer)) if b not in (2, 4))
    assert _one(producer)["kind"] == "released"
    _quiet(producer)
    _quiet(consumer)


def test_pull_mode_reads_after_the_producer_finishes(spawn):
    producer = spawn("producer", "prefill", mode="pull")
    consumer = spawn("consumer", "decode", mode="pull")
    producer.call("kv_ready", tid="t1", blocks=[4, 6], value=0x33)
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[0, 9])
    assert _one(consumer)["kind"] == "delivered"
    assert _one(producer)["reason"] == "sent"
    for layer in _values(consumer):
        assert layer[0] == [0x33] and layer[9] == [0x33]
        assert all(layer[b] == [0] for b in range(len(layer)) if b not in (0, 9))
    _quiet(producer)
    _quiet(consumer)


def test_a_read_whose_nixl_peer_went_fails_and_the_next_read_goes_on_a_fresh_one(spawn):
    # The producer's NIXL agent vanishes from under the consumer (as its UCX endpoint
    # does when a short cut takes the route): that READ fails, and the data path loads
    # the producer's metadata again, or every later READ from it would fail the same.
    producer = spawn("producer", "prefill", mode="pull")
    consumer = spawn("consumer", "decode", mode="pull")
    producer.call("kv_ready", tid="t0", blocks=[2], value=0x22)
    consumer.call("expect", tid="t0", producer=producer.address, blocks=[5])
    assert _one(consumer)["kind"] == "delivered"
    assert _one(producer)["reason"] == "sent"
    consumer.call("forget_peers")
    producer.call("kv_ready", tid="t1", blocks=[4], value=0x33)
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[0])
    failed = _one(consumer)
    assert (failed["kind"], failed["reason"]) == ("failed", "read_failed"), failed
    assert _one(producer)["kind"] == "released"
    producer.call("kv_ready", tid="t2", blocks=[6], value=0x44)
    consumer.call("expect", tid="t2", producer=producer.address, blocks=[9])
    assert _one(consumer)["kind"] == "delivered"
    assert _one(producer)["reason"] == "sent"
    for layer in _values(consumer):
        assert (layer[5], layer[9], layer[0]) == ([0x22], [0x44], [0])
    assert _total(_quiet(consumer)["metrics"], "reconnects") == 1
    _quiet(producer)


def test_push_and_pull_peers_refuse_to_pair_with_a_clear_reason(spawn):
    producer = spawn("producer", "prefill", mode="push")
    consumer = spawn("consumer", "decode", mode="pull")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1])
    failed = _one(consumer)
    assert (failed["kind"], failed["reason"]) == ("failed", "handshake_failed")
    assert "pull mode" in failed["detail"] and "push mode" in failed["detail"]


def test_wrong_secret_is_refused(spawn):
    producer = spawn("producer", "prefill", secret="right")
    consumer = spawn("consumer", "decode", secret="wrong")
    consumer.call("expect", tid="t1", producer=producer.address, blocks=[1])
    failed = _one(consumer)
    assert failed["reason"] == "handshake_failed"
    assert "secret" in failed["detail"]
    metrics = producer.call("stats")["metrics"]
    assert metrics["rejected_messages"]["why=auth"] >= 1


def test_equal_tensor_parallel_ranks_pair_rank_by_rank(spawn):
    producers = [spawn("producer", "prefill", rank=r, world=2) for r in range(2)]
    consumers = [spawn("consumer", "decode", rank=r, world=2) for r in range(2)]
    for rank in range(2):
        consumers[rank].call("expect", tid="t1", producer=producers[rank].address, blocks=[rank])
        producers[rank].call("kv_ready", tid="t1", blocks=[5], value=0x10 + rank)
    for rank in range(2):
        assert _one(consumers[rank])["kind"] == "delivered"
        assert all(layer[rank] == [0x10 + rank] for layer in _values(consumers[rank]))
    # A consumer rank reaching the wrong producer rank is refused.
    consumers[1].call("expect", tid="t2", producer=producers[0].address, blocks=[3])
    failed = _one(consumers[1])
    assert failed["reason"] == "handshake_failed" and "rank" in failed["detail"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_tp1_fills_two_decode_ranks_each_with_its_own_head(spawn, mode):
    producer = spawn("producer", "prefill", heads=2, mode=mode)  # TP 1: both heads
    consumers = [spawn("consumer", "decode", rank=r, world=2, heads=2, mode=mode) for r in range(2)]
    for consumer in consumers:  # each takes its head from the one producer rank
        consumer.call("expect", tid="t1", producer=[[producer.address, 2]], blocks=[3])
    _registered(producer, 2)
    producer.call("kv_ready_heads", tid="t1", blocks=[5], base=0x10)
    for rank, consumer in enumerate(consumers):
        assert _one(consumer)["kind"] == "delivered"
        assert consumer.call("head_values", block=3)["values"] == [[[0x10 + rank]]] * 2
    released = _one(producer)
    assert (released["kind"], released["reason"]) == ("released", "sent")  # once, for both
    _quiet(producer)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_tp1_takes_its_two_heads_from_two_prefill_ranks(spawn, mode):
    producers = [
        spawn("producer", "prefill", rank=r, world=2, heads=2, mode=mode) for r in range(2)
    ]
    consumer = spawn("consumer", "decode", heads=2, mode=mode)  # TP 1: both heads
    sources = [[p.address, 1] for p in producers]
    consumer.call("expect", tid="t1", producer=sources, blocks=[3])
    for rank, producer in enumerate(producers):
        _registered(producer)
        producer.call("kv_ready_heads", tid="t1", blocks=[5 + rank], base=0x20)
    (delivered,) = consumer.call("results", count=2, seconds=15, timeout=45)["outcomes"]
    assert delivered["kind"] == "delivered"  # one outcome, once both heads landed
    assert consumer.call("head_values", block=3)["values"] == [[[0x20], [0x21]]] * 2
    for producer in producers:
        assert _one(producer)["reason"] == "sent"


def test_layer_reports_after_a_transfer_ended_hold_no_fences_and_release_once(spawn):
    """The router cancelled the prefill leg before its KV existed; the engine still
    reports each layer (with a fence) and then the whole step, twice over."""
    producer = spawn("producer", "prefill")
    producer.call("abort", tid="t1")
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=1, layers=[0])
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=1)  # the last layer's hook
    producer.call("kv_ready", tid="t1", blocks=[0, 1], value=1)  # the end of the step
    outcomes = producer.call("results", count=2, seconds=2.0, timeout=40)["outcomes"]
    assert [(o["kind"], o["transfer_id"]) for o in outcomes] == [("released", "t1")]
    assert producer.call("stats")["fences_held"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("prefill_tokens", "decode_tokens"), [(8, 4), (4, 8)])
def test_blocks_of_different_sizes_move_page_by_page(spawn, mode, prefill_tokens, decode_tokens):
    """22 prompt tokens, two heads: decode's blocks are half or twice prefill's. Every
    token lands where decode's block table puts it, and decode's prefix (its first
    block, cached) is left as it was."""
    producer = spawn("producer", "prefill", heads=2, tokens=prefill_tokens, mode=mode)
    consumer = spawn("consumer", "decode", heads=2, tokens=decode_tokens, mode=mode)
    count, source, destination = 22, [9, 2, 11, 4, 0, 7], [3, 12, 5, 8, 1, 14]
    source = source[: -(-count // prefill_tokens)]
    destination = destination[: -(-count // decode_tokens)]
    # Decode's first block is its prefix cache's: it expects KV only for the rest.
    consumer.call("expect", tid="t1", producer=producer.address, blocks=destination[1:], skip=1)
    _registered(producer) if mode == "push" else None
    producer.call("kv_ready_tokens", tid="t1", blocks=source, count=count, base=0x30)
    outcome = _one(consumer)
    assert outcome["kind"] == "delivered", outcome
    landed = consumer.call("token_values", blocks=destination, count=count)["values"]
    for layer, heads in enumerate(landed):
        for head, tokens in enumerate(heads):
            for t, values in enumerate(tokens):
                held = [0] if t < decode_tokens else [(0x30 + 64 * layer + 16 * head + t) % 256]
                assert values == held, (layer, head, t)
    assert _one(producer)["reason"] == "sent"
