"""A landing rung on the doorbell is taken into vLLM's scheduler before it plans the
next step (kvpush.vllm.landings), and the workers' later report of it is dropped."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from test_vllm_scheduler import BLOCK, _blocks, _decode_params, _request, _step
from vllm.v1.request import RequestStatus

from kvpush.engine.decode import DecodeLegs
from kvpush.engine.steps import Announce
from kvpush.vllm import hooks
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.wake import LandingNote, Ringer


class VllmScheduler:
    """What of vLLM's Scheduler the hook reaches: it makes the connector in __init__."""

    def __init__(self, world: int = 1, idle_wait_s: float = 0.0, sync: bool = False) -> None:
        self.kv_cache_config = object()
        config = ConnectorConfig.from_extra({"idle_wait_s": idle_wait_s})
        self.side = SchedulerSide(config, EngineShape("e", BLOCK, world))
        self.attached = self.side.landings.attach(synchronous=sync)
        self.requests: dict = {}
        self.finished_recving_kv_req_ids: set[str] = set()
        self.plans = 0

    def schedule(self, *args):
        self.plans += 1
        return _step()

    def update_from_output(self, *args):
        return None

    def waiting_decode(self, request_id: str = "d1") -> str:
        """A decode leg whose blocks are claimed: its transfer id."""
        request = _request(request_id, 300, _decode_params())
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[request_id] = request
        self.side.on_new_request(request)
        self.side.get_num_new_matched_tokens(request, 0)
        self.side.update_state_after_alloc(request, _blocks([1, 2, 3]), 300)
        (expect,) = self.side.build_connector_meta(_step()).expects
        return expect.transfer_id


@pytest.fixture
def rung():
    """A worker's ringer on a scheduler's doorbell, with that doorbell's key."""
    ringers = []

    def ring(scheduler: VllmScheduler, note: LandingNote, key: str | None = None) -> None:
        ringer = Ringer(scheduler.side.doorbell.port)
        ringers.append(ringer)
        doorbell = scheduler.side.doorbell
        ringer.ring(note.encode(doorbell.key if key is None else key))
        time.sleep(0.02)  # loopback: delivered well within this

    yield ring
    for ringer in ringers:
        ringer.close()


def test_a_landing_note_says_rank_transfer_and_times_and_only_with_the_key():
    note = LandingNote(3, "cmpl-abc-0", 1700000000.123456, 1699999999.5)
    assert LandingNote.decode(note.encode("k1"), "k1") == note
    assert LandingNote.decode(note.encode("k1"), "k2") is None  # not our workers'
    assert LandingNote.decode(b"!", "k1") is None  # a plain ring
    assert LandingNote.decode(b"L k1 x cmpl 1 2", "k1") is None  # a rank that is no number


def test_a_transfer_is_landed_once_every_rank_says_so_and_only_while_it_loads():
    legs = DecodeLegs(BLOCK)
    legs.announced("d1", "t1", Announce("t1", "engine-p", ("10.0.0.5:7100",), ("e0",)))
    assert legs.rank_landed("t1", 0, 2) is None  # not claimed yet
    assert legs.allocated("d1", [[1, 2, 3]], 300)
    assert legs.rank_landed("t1", 0, 2) is None  # rank 1 has not landed yet
    assert legs.rank_landed("t1", 0, 2) is None  # the same rank twice is one rank
    assert legs.rank_landed("t1", 1, 2) == "d1"
    assert legs.rank_landed("nope", 0, 1) is None
    legs.loaded("d1", failed=False)
    assert legs.rank_landed("t1", 1, 2) is None  # settled: a late ring changes nothing


def test_the_schedule_after_a_landing_runs_it_and_the_workers_report_is_dropped(rung):
    vllm = VllmScheduler(world=2)
    assert vllm.attached and hooks.RECORD.snapshot()["landings_before_schedule"] == "attached"
    transfer_id = vllm.waiting_decode()
    rung(vllm, LandingNote(0, transfer_id, time.time(), 0.0))
    vllm.schedule()
    assert vllm.finished_recving_kv_req_ids == set()  # rank 1's share is still on its way
    rung(vllm, LandingNote(1, transfer_id, time.time(), time.time() - 0.01))
    vllm.schedule()
    assert vllm.finished_recving_kv_req_ids == {"d1"} and vllm.side.landings.taken == 1
    assert vllm.side.ledger.decode.legs["d1"].state == "landed"
    # The step that computes it reports the landing too: vLLM must not see it twice.
    output = SimpleNamespace(finished_sending=None, finished_recving={"d1", "d2"})
    vllm.side.update_connector_output(output)
    assert output.finished_recving == {"d2"}
    again = SimpleNamespace(finished_sending=None, finished_recving={"d1"})
    vllm.side.update_connector_output(again)  # a report not taken here passes untouched
    assert again.finished_recving == {"d1"}
    # d2, and d1 a second time: what a step reported, not what was taken here.
    assert vllm.side.state_detail()["landings"] == {"before_schedule": 1, "by_step_report": 2}
    vllm.side.close()


def test_a_note_without_the_key_or_for_a_request_vllm_no_longer_waits_for_is_ignored(rung):
    vllm = VllmScheduler()
    transfer_id = vllm.waiting_decode()
    rung(vllm, LandingNote(0, transfer_id, time.time(), 0.0), key="guessed")
    vllm.schedule()
    assert vllm.finished_recving_kv_req_ids == set()  # a forged claim loads nothing
    vllm.requests["d1"].status = RequestStatus.FINISHED_ABORTED
    rung(vllm, LandingNote(0, transfer_id, time.time(), 0.0))
    vllm.schedule()
    assert vllm.finished_recving_kv_req_ids == set() and vllm.side.landings.taken == 0
    assert vllm.side.ledger.decode.legs["d1"].state == "loading"  # the workers' report decides
    vllm.side.close()


def test_an_idle_engine_waits_at_the_start_of_schedule_and_plans_with_the_landing():
    """Two quiet steps: the next schedule() sleeps on the doorbell, and the ring that
    ends the wait brings the landing that very call plans with."""
    vllm = VllmScheduler(idle_wait_s=1.0)
    transfer_id = vllm.waiting_decode()
    vllm.side.build_connector_meta(_step())
    vllm.side.build_connector_meta(_step())  # quiet twice: no wait here, the next plan's
    assert vllm.side.idle_waits == 0
    ringer = Ringer(vllm.side.doorbell.port)
    note = LandingNote(0, transfer_id, time.time(), 0.0).encode(vllm.side.doorbell.key)
    timer = threading.Timer(0.2, ringer.ring, [note])
    timer.start()
    started = time.monotonic()
    vllm.schedule()
    assert 0.15 < time.monotonic() - started < 0.9 and vllm.side.idle_waits == 1
    assert vllm.finished_recving_kv_req_ids == {"d1"}
    ringer.close()
    vllm.side.close()


def test_without_a_vllm_scheduler_on_the_stack_the_workers_report_does_it(caplog):
    hooks.RECORD.states.pop("landings_before_schedule", None)
    side = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("e", BLOCK, 1))
    assert side.landings.attach() is False and not side.idle.wait_before_schedule
    assert hooks.RECORD.snapshot()["landings_before_schedule"].startswith("off: no vLLM")
    assert "one more step" in caplog.text  # the cost, named
    side.close()


def test_news_between_steps_cancels_the_held_wait():
    """The wait held over to the next schedule() is the last step's verdict; a request
    that arrived since, or a step's report of a transfer's end, overrules it."""
    vllm = VllmScheduler(idle_wait_s=1.0)
    vllm.waiting_decode()
    for news in (
        lambda: vllm.side.on_new_request(_request("r2", 10, {})),
        lambda: vllm.side.update_connector_output(
            SimpleNamespace(finished_sending={"p9"}, finished_recving=None)
        ),
    ):
        vllm.side.build_connector_meta(_step())
        vllm.side.build_connector_meta(_step())  # quiet twice: the next plan would wait
        news()
        started = time.monotonic()
        vllm.schedule()
        assert time.monotonic() - started < 0.5 and vllm.side.idle_waits == 0
    vllm.side.close()


def test_a_plain_ring_taken_between_waits_still_ends_the_next_wait():
    """schedule() takes every ring to read the landing notes; a plain one (a request in
    vLLM's queue, not yet in the scheduler) must still end the wait that follows."""
    vllm = VllmScheduler(idle_wait_s=1.0)
    vllm.waiting_decode()
    ringer = Ringer(vllm.side.doorbell.port)
    ringer.ring()
    time.sleep(0.02)
    vllm.schedule()  # takes the ring, with nothing due
    vllm.side.build_connector_meta(_step())
    vllm.side.build_connector_meta(_step())
    started = time.monotonic()
    vllm.schedule()
    assert time.monotonic() - started < 0.5 and vllm.side.idle_waits == 1
    started = time.monotonic()
    vllm.side.build_connector_meta(_step())
    vllm.schedule()  # no ring since: this one waits out its bound
    assert time.monotonic() - started > 0.9
    ringer.close()
    vllm.side.close()


def test_a_synchronous_engine_waits_right_after_the_step_that_claims():
    """Without async scheduling nothing computes between two plans: the schedule()
    after the step carrying the claims may wait, with no empty round trip to the
    workers for a landing to fall into. Asynchronous engines keep two quiet steps."""
    for sync, empty_steps in ((True, 0), (False, 2)):
        vllm = VllmScheduler(idle_wait_s=0.05, sync=sync)
        vllm.waiting_decode()  # the step that claims
        for _ in range(empty_steps):
            vllm.schedule()
            assert vllm.side.idle_waits == 0
            vllm.side.build_connector_meta(_step())
        started = time.monotonic()
        vllm.schedule()
        assert vllm.side.idle_waits == 1 and time.monotonic() - started > 0.04
        vllm.side.close()
