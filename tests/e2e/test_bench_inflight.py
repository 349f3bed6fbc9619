"""`kvpush bench inflight` on two real vLLM instances sharing a core: it measures what
it says it does (whether the figures favour a --queue-tokens value is not judged)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_bench_inflight_times_a_prompt_beside_requests_decoding_on_each_instance(tmp_path):
    command = [
        sys.executable, "-m", "kvpush", "bench", "inflight", "--json", "--lengths", "128",
        "--in-flight", "2", "--context", "256", "--reps", "3", "--cpus", "1",
        "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # The bench checks each try's premise itself (two requests running where it
    # wants them, none on the other instance) and fails where it does not hold.
    assert [(r["prompt_len"], r["in_flight"], r["place"]) for r in rows] == [
        (128, 2, "same"), (128, 2, "beside"),
    ]  # fmt: skip
    for row in rows:
        assert 0 < row["alone_ms"] < 5000 and 0 < row["with_ms"] < 5000, row
        assert row["ms_per_token"] > 0
        added = (row["with_ms"] - row["alone_ms"]) / row["in_flight"]
        assert row["added_ms_per_request"] == pytest.approx(added, abs=0.02)
        tokens = row["added_ms_per_request"] / row["ms_per_token"]
        assert row["tokens_per_request"] == pytest.approx(tokens, abs=0.6)
    table = (tmp_path / "table.md").read_text()
    assert "| 128 | 2 | beside |" in table and "prompt token's compute" in table
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
