"""`kvpush bench transfer` runs end to end and reports what it promises.

Speed is the benchmark's business, not the tests': this checks the report is whole
and honest (bytes verified, numbers present and positive), not how fast it was.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl


def test_bench_transfer_json_reports_each_size():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpush",
            "bench",
            "transfer",
            "--json",
            "--sizes",
            "1,4",
            "--runs",
            "3",
            "--idle-seconds",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["size_mib"] for row in rows] == [1, 4]
    for row in rows:
        assert row["verified"] is True
        assert 16 <= row["block_kib"] <= 2048
        for key in ("nixl_gbps", "memcpy_gbps", "ratio", "prepare_us", "post_us"):
            assert row[key] > 0, key
        assert row["ratio"] == pytest.approx(row["nixl_gbps"] / row["memcpy_gbps"], rel=0.01)
        assert 0 <= row["receiver_idle_cpu_pct"] < 100
