"""`kvpush bench transfer` runs end to end and reports what it promises.

Speed is the benchmark's business, not the tests': this checks the report is whole
and honest (bytes verified, numbers present and positive), not how fast it was.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import netns
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
        timeout=280,  # under pytest's 300 s, so the bench (and its children) are killed
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # Each size at equal TP, then mixed (a TP 2 rank's blocks into TP 1's), same bytes.
    assert [(row["size_mib"], row["tp"]) for row in rows] == [
        (1, "1->1"), (1, "2->1"), (4, "1->1"), (4, "2->1")
    ]  # fmt: skip
    for equal, mixed in (rows[0:2], rows[2:4]):
        assert equal["vs_equal"] is None
        assert mixed["vs_equal"] == pytest.approx(mixed["nixl_gbps"] / equal["nixl_gbps"], rel=0.01)
        # Heads split K and V apart in the receiver's blocks: twice the descriptors.
        assert mixed["descriptors"] == 2 * equal["descriptors"]
    for row in rows:
        assert row["verified"] is True
        assert 16 <= row["block_kib"] <= 2048
        for key in ("nixl_gbps", "memcpy_gbps", "ratio", "prepare_us", "post_us"):
            assert row[key] > 0, key
        assert row["ratio"] == pytest.approx(row["nixl_gbps"] / row["memcpy_gbps"], rel=0.01)
        assert 0 <= row["receiver_idle_cpu_pct"] < 100


def test_bench_transfer_across_namespaces_moves_its_bytes_over_the_link():
    """Small (1 MiB, 2 runs): the row's shape, and the link's transmit counter rose by
    at least the bytes the WRITEs moved, so UCX used the link, not shared memory."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    argv = ["--across-namespaces", "--json", "--sizes", "1", "--runs", "2", "--link-rate", "2gbit"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvpush", "bench", "transfer", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = bench.communicate(timeout=240)
    finally:
        if bench.poll() is None:  # Ctrl-C: the bench removes its namespaces and children
            bench.send_signal(signal.SIGINT)
            bench.wait(40)
    assert bench.returncode == 0, stderr[-2000:]
    (row,) = [json.loads(line) for line in stdout.splitlines()]
    assert (row["size_mib"], row["runs"], row["link_rate"]) == (1, 2, "2 Gbit/s")
    assert row["verified"] is True
    assert row["moved_bytes"] == 3 * (1 << 20)  # two runs and the warm-up
    assert row["link_bytes"] >= row["moved_bytes"], "the KV did not cross the link"
    for key in ("nixl_gbps", "tcp_gbps", "first_transfer_ms"):
        assert row[key] > 0, key
    assert row["ratio"] == pytest.approx(row["nixl_gbps"] / row["tcp_gbps"], rel=0.01)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"kvpush-{bench.pid % 100000}x" not in names, "it left a namespace behind"
