"""Span accounting: where a request's time went on one instance."""

from __future__ import annotations

import itertools

import pytest

from kvpush.vllm.metadata import KVPushWorkerMeta
from kvpush.vllm.spans import MILESTONES, PHASES, Spans


def _clock(*times: float):
    ticks = iter(times)
    return lambda: next(ticks)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_every_phase_is_present_non_negative_and_they_sum_to_the_requests_time(role):
    times = [10.0, 10.5, 12.25, 12.251, 13.0][: len(MILESTONES[role])]
    spans = Spans(clock=_clock(*times))
    spans.begin("r1", role, "xfer-1")
    for milestone in MILESTONES[role][1:]:
        spans.mark("r1", milestone)
    (trace,) = spans.trace()
    assert trace["transfer_id"] == "xfer-1" and trace["role"] == role
    phases = trace["spans_ms"]
    assert list(phases) == list(PHASES[role])
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx((times[-1] - times[0]) * 1e3)
    summary = spans.summary()
    assert set(summary) == {f"{role}.{p}" for p in PHASES[role]}  # no events, no parts
    assert all(s["count"] == 1 for s in summary.values())


def test_a_milestone_counts_the_first_time_and_a_worker_stamp_is_taken_as_is():
    spans = Spans(clock=_clock(1.0, 2.0, 3.0, 9.0, 10.0))
    spans.begin("r1", "decode", "t")
    spans.mark("r1", "allocated")
    spans.mark("r1", "landed", at=2.5)  # stamped by the worker process
    spans.mark("r1", "landed")  # seen again at finished_recving: ignored
    spans.mark("r1", "scheduled")
    spans.mark("r1", "finished")
    assert spans.trace()[0]["spans_ms"] == {
        "queued": 1000.0, "kv_wait": 500.0, "to_step": 500.0, "generate": 6000.0,
    }  # fmt: skip


def test_a_request_off_the_path_is_traced_but_not_counted():
    counter = itertools.count()
    spans = Spans(clock=lambda: float(next(counter)))
    spans.begin("r1", "decode", "t")
    spans.mark("r1", "allocated")
    spans.drop("r1")  # its transfer failed; it recomputed
    assert spans.trace()[0]["spans_ms"] == {"queued": 1000.0}
    assert spans.summary() == {}
    with pytest.raises(ValueError, match="not a prefill milestone"):
        spans.begin("r2", "prefill", "t")
        spans.mark("r2", "landed")


def test_a_summary_can_start_the_count_afresh():
    counter = itertools.count()
    spans = Spans(clock=lambda: float(next(counter)))
    spans.begin("r1", "prefill", "t")
    for milestone in ("computing", "computed", "released"):
        spans.mark("r1", milestone)
    assert spans.summary(reset=True)["prefill.send"]["count"] == 1
    assert spans.summary() == {}
    assert len(spans.trace()) == 1  # the trace keeps its requests


def test_the_hand_off_is_split_into_its_parts_in_the_summary():
    """landing -> scheduled is the step that reports the landing, then vLLM's next
    schedule; kv_ready -> landed is what is left of the WRITE after prefill's last
    step. Each is summed up beside the phases, from the moments both present."""
    spans = Spans(clock=_clock(1.0, 2.0, 2.9, 3.0, 5.0))
    spans.begin("r1", "decode", "t")  # arrived 1.0
    spans.mark("r1", "allocated")  # 2.0
    spans.mark("r1", "kv_ready", at=2.4)  # prefill's last step ended (its clock)
    spans.mark("r1", "landed", at=2.5)
    spans.mark("r1", "reported")  # 2.9
    spans.mark("r1", "scheduled")  # 3.0
    spans.mark("r1", "finished")  # 5.0
    summary = spans.summary()
    parts = {k: summary[f"decode.{k}"]["p50_ms"] for k in ("handoff", "report", "resume")}
    assert parts == pytest.approx({"handoff": 100.0, "report": 400.0, "resume": 100.0})
    assert summary["decode.to_step"]["p50_ms"] == pytest.approx(500.0)  # report + resume
    assert spans.trace()[0]["spans_ms"].keys() == set(PHASES["decode"])  # phases only


def test_a_failed_request_keeps_the_first_reason_in_its_trace():
    spans = Spans()
    spans.begin("r1", "decode", "xfer-1")
    spans.fail("r1", "peer_lost: prefill went away")
    spans.fail("r1", "later: not this one")
    spans.begin("r2", "decode", "xfer-2")
    spans.drop("r2")  # vLLM finished it before the reason reached the scheduler
    spans.fail("r2", "write_failed: boom")
    spans.fail("r9", "nobody: never traced")  # nothing to say it of: no new record
    spans.drop("r1")
    second, first = spans.trace()
    assert (first["transfer_id"], first["error"]) == ("xfer-1", "peer_lost: prefill went away")
    assert (second["transfer_id"], second["error"]) == ("xfer-2", "write_failed: boom")
    spans.begin("r3", "decode", "xfer-3")
    spans.drop("r3")
    assert "error" not in spans.trace()[-1] and len(spans.trace()) == 3


def test_worker_failure_reasons_survive_aggregation_over_ranks():
    one, other = KVPushWorkerMeta(failed={"r1": "peer_lost: x"}), KVPushWorkerMeta()
    other.landed["r2"] = 1.0
    assert not one.is_empty()
    merged = other.aggregate(one)
    assert merged.failed == {"r1": "peer_lost: x"} and merged.landed == {"r2": 1.0}


def test_a_timeline_is_read_off_the_ledgers_moves():
    """Spans keeps no account of its own: a decode leg's milestones come from the
    ledger's moves, the worker's stamp of its landing, and the step that ran it."""
    from kvpush.engine.ledger import Ledger
    from kvpush.engine.steps import Announce

    clock = iter(float(t) for t in range(1, 100))
    spans = Spans(clock=lambda: next(clock))
    ledger = Ledger(16)
    ledger.announced("d1", "t1", Announce("t1", ("10.0.0.5:7100",)), "", "router-t1")
    spans.read(ledger.take_moves())  # arrived: 1
    ledger.matched("d1", 40, 0)
    ledger.allocated("d1", [[5, 6, 7]], 40)
    spans.read(ledger.take_moves())  # allocated: 2
    spans.noted("d1", {"landed": 2.5})  # the worker's stamp wins over the report's time
    ledger.loaded("d1", failed=False)
    spans.read(ledger.take_moves())  # reported: 3
    spans.scheduled({"other": 1, "d1": 1})  # scheduled: 4
    ledger.finished("d1")
    spans.read(ledger.take_moves())  # finished: 5
    (trace,) = spans.trace()
    assert trace["transfer_id"] == "router-t1"
    assert trace["marks"] == {"arrived": 1.0, "allocated": 2.0, "landed": 2.5,
                              "reported": 3.0, "scheduled": 4.0, "finished": 5.0}  # fmt: skip
    assert spans.summary()["decode.kv_wait"]["count"] == 1
