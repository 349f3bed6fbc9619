"""How `kvpush bench serve` turns request outcomes into a cell and a table row."""

from __future__ import annotations

from kvpush.bench import serve
from kvpush.bench.load import Outcome

SETTINGS = serve.Settings(configs=("plain", "push"), slo_ttft_ms=100.0, slo_tpot_ms=10.0)


def _ok(ttft: float, tokens: list[int]) -> Outcome:
    times = [ttft + 0.005 * i for i in range(len(tokens))]
    return Outcome(True, ttft=ttft, token_times=times, token_ids=tokens)


def test_a_cell_counts_failures_mismatches_and_goodput_against_the_slo():
    outcomes = [_ok(0.05, [1, 2]), _ok(0.5, [1, 2]), _ok(0.05, [9, 9]), Outcome(False, error="x")]
    expected = [[1, 2], [1, 2], [1, 2], [1, 2]]
    cell = serve.summarize("push", "pinned", 64, 1.0, outcomes, expected, 2.0, SETTINGS, {}, {})
    assert (cell.requests, cell.failures, cell.mismatches) == (4, 1, 1)
    assert cell.goodput_rps == 1.0  # two of three answered within the TTFT SLO, over 2 s
    assert cell.ttft_p50_ms == 50.0 and cell.errors == ["x"]


def test_a_configuration_that_cannot_serve_is_a_row_of_failures_not_a_hang():
    outcomes = [Outcome(False, error="warm-up at 3072 tokens failed: timeout")] * 3
    cell = serve.summarize("upstream-push", "colocated", 3072, 8.0, outcomes, None, 0.0,
                           SETTINGS, {}, {})  # fmt: skip
    assert cell.failures == 3 and cell.ttft_p50_ms is None and cell.goodput_rps == 0.0
    row = serve.markdown([cell]).splitlines()[-1]
    assert "| upstream-push |" in row and "| 3 |" in row
