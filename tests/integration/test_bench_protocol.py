"""`kvpush bench protocol` runs push and pull end to end and reports honestly.

Whether push beats pull is the benchmark's finding, not a test's: this checks the
run completes, every transferred byte was checked, and the report is whole.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl


def test_bench_protocol_json_reports_both_modes():
    result = subprocess.run(
        [sys.executable, "-m", "kvpush", "bench", "protocol", "--json", "--in-flight", "3",
         "--requests-per-stream", "2", "--prefill-ms-per-request", "5", "--idle-seconds", "0.3"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {row["mode"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"push", "pull"}
    for row in rows.values():
        assert row["in_flight"] == 3 and row["requests"] == 6
        assert row["verified"] is True and row["failed"] == 0
        assert 0 < row["done_to_ready_p50_ms"] <= row["done_to_ready_p90_ms"]
        assert row["kv_mib_per_request"] == 2.0
        assert 0 <= row["producer_idle_cpu_pct"] < 100
