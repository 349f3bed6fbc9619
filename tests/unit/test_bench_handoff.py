"""The hand-off bench's arithmetic: what it reads from the traces and how it reports."""

from __future__ import annotations

import pytest

from kvpush.bench import handoff, load
from kvpush.demo.tinymodel import KV_HEAVY, SHAPE, kv_bytes_per_token
from kvpush.errors import KVPushError


def _decode(arrived: float, kv_ready: float | None, landed: float | None) -> dict:
    marks = {"arrived": arrived}
    if kv_ready is not None:
        marks["kv_ready"] = kv_ready
    if landed is not None:
        marks["landed"] = landed
    return {"role": "decode", "marks": marks}


def test_the_residual_is_landing_minus_the_end_of_prefills_last_step_for_this_run_only():
    trace = [
        _decode(1.0, 1.5, 1.6),  # before `since`: another run's
        _decode(10.0, 10.2, 10.25),
        _decode(11.0, 11.4, 11.39),  # two clocks on one host: never negative
        _decode(12.0, None, 12.3),  # no notification time (nothing left to move)
        _decode(13.0, 13.1, None),  # failed: never landed
    ]
    assert handoff.residuals(trace, since=5.0) == pytest.approx([0.05, 0.0])


def test_early_chunks_count_only_chunks_that_crossed_before_the_last_step():
    def prefill(arrived, **marks):
        return {"marks": {"arrived": arrived, **marks}}

    trace = [
        prefill(1.0, chunk_sent=1.1, last_step=1.2),  # before `since`
        prefill(10.0, chunk_sent=10.1, last_step=10.3),
        prefill(11.0, last_step=11.1),  # one step: nothing early
        prefill(12.0, chunk_sent=12.1),  # aborted between chunks: still crossed early
    ]
    assert handoff.early_chunks(trace, since=5.0) == 2


def test_the_table_gives_each_granularitys_residual_against_requests():
    rows = [
        handoff.summarize(g, 8192, [load.Outcome(True, ttft=0.5)], [r], early)
        for g, r, early in (("request", 0.1, 0), ("layer", 0.05, 0), ("chunk", 0.01, 1))
    ]
    table = handoff.markdown(rows)
    assert "| 8192 | chunk | 10 | 0.10 |" in table
    assert "| 8192 | layer | 50 | 0.50 |" in table
    assert "1/1" in table


def test_settings_refuse_an_unknown_granularity():
    with pytest.raises(KVPushError, match="unknown granularity"):
        handoff.Settings(granularities=("token",))


def test_the_kv_heavy_model_has_16_kib_of_kv_per_token():
    assert kv_bytes_per_token(KV_HEAVY) == 16 * 1024
    assert kv_bytes_per_token(SHAPE) == 1024
