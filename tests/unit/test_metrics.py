"""Metrics: a reader's cursor over a histogram's samples misses none and survives the cap."""

from __future__ import annotations

from kvpush.metrics import MAX_SAMPLES, Metrics


def test_samples_since_hands_each_sample_to_a_reader_once():
    metrics = Metrics()
    assert metrics.samples_since("wait", 0) == ([], 0)
    for value in (1.0, 2.0):
        metrics.observe("wait", value)
    fresh, seen = metrics.samples_since("wait", 0)
    assert (fresh, seen) == ([1.0, 2.0], 2)
    metrics.observe("wait", 3.0)
    assert metrics.samples_since("wait", seen) == ([3.0], 3)
    assert metrics.samples_since("wait", 3) == ([], 3)


def test_samples_keep_flowing_past_the_kept_window():
    metrics = Metrics()
    for i in range(MAX_SAMPLES + 5):
        metrics.observe("wait", float(i))
    _, seen = metrics.samples_since("wait", 0)
    metrics.observe("wait", -1.0)
    assert metrics.samples_since("wait", seen) == ([-1.0], MAX_SAMPLES + 6)
    # A reader that fell further behind than the window gets what is kept, no more.
    fresh, _ = metrics.samples_since("wait", 0)
    assert len(fresh) == MAX_SAMPLES and fresh[-1] == -1.0
