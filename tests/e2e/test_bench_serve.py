"""`kvpush bench serve` on a tiny grid: its output is right (speed is not judged here)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kvpush.bench.cpu import tree

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def _bench(out, *args: str) -> list[dict]:
    command = [
        sys.executable, "-m", "kvpush", "bench", "serve", "--json", "--requests", "4",
        "--output-tokens", "4", "--rates", "4", "--idle-seconds", "0.5", "--out", str(out),
        *args,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _sane(cell: dict) -> None:
    assert cell["failures"] == 0 and cell["mismatches"] == 0, cell
    assert cell["requests"] == 4
    for metric in ("ttft", "t2t", "tpot", "itl"):
        p50, p90, p99 = (cell[f"{metric}_p{q}_ms"] for q in (50, 90, 99))
        # Tokens that reach the client in one read share a time: TPOT may be 0.
        low = 0 if metric == "ttft" else -1e-9
        assert low < p50 <= p90 <= p99, (metric, cell)
    assert cell["goodput_rps"] >= 0
    # Every request's second token comes after its first.
    assert cell["t2t_p50_ms"] >= cell["ttft_p50_ms"] and len(cell["ttfts_ms"]) == 4


def test_bench_serve_attached_to_running_servers(cluster, router, tmp_path):
    single = cluster.servers["single"].url
    cells = _bench(
        tmp_path, "--lengths", "64,200", "--configs", "plain,push", "--placements", "colocated",
        "--attach", f"plain={single}", "--attach", f"push={router}",
    )  # fmt: skip
    assert sorted((c["config"], c["prompt_len"]) for c in cells) == [
        ("plain", 64), ("plain", 200), ("push", 64), ("push", 200),
    ]  # fmt: skip
    for cell in cells:
        _sane(cell)
    table = (tmp_path / "table.md").read_text()
    assert table.count("| colocated |") == 4
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == cells
    assert (tmp_path / "ttft-colocated.png").stat().st_size > 1000
    assert (tmp_path / "tpot-colocated.png").stat().st_size > 1000
    assert (tmp_path / "where-colocated.png").stat().st_size > 1000
    assert (tmp_path / "ttft-cdf-colocated.png").stat().st_size > 1000


def test_bench_serve_starts_servers_pins_them_and_counts_their_cpu(tmp_path):
    # prefill-alone: a kvpush prefill instance asked directly answers as plain does.
    cells = _bench(
        tmp_path, "--lengths", "32", "--configs", "plain,prefill-alone",
        "--placements", "colocated,pinned", "--prefill-cpus", "1",
    )  # fmt: skip
    assert [(c["config"], c["placement"]) for c in cells] == [
        (config, placement)
        for config in ("plain", "prefill-alone") for placement in ("colocated", "pinned")
    ]  # fmt: skip
    for cell in cells:
        _sane(cell)
        server = "plain" if cell["config"] == "plain" else "prefill"
        assert set(cell["cpu_load_cores"]) == {server}
        assert cell["cpu_load_cores"][server] > 0  # it computed
        assert 0 <= cell["cpu_idle_cores"][server] < 0.5


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_bench_serve_stopped_by_sigterm_stops_the_servers_it_started(tmp_path):
    # The servers run in sessions of their own: a SIGTERM to the bench reaches them
    # only through the bench's clean-up.
    command = [
        sys.executable, "-m", "kvpush", "bench", "serve", "--configs", "plain",
        "--placements", "colocated", "--lengths", "32", "--rates", "1", "--requests", "100000",
        "--out", str(tmp_path),
    ]  # fmt: skip
    log = tmp_path / "bench.log"
    with log.open("w") as out:
        bench = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        # Until the server has started its engine core: its whole tree must go.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert bench.poll() is None, log.read_text()
            if len(servers := tree(bench.pid)[1:]) >= 2:
                break
            time.sleep(0.5)
        assert len(servers) >= 2, f"the bench started no server with an engine: {servers}"
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(timeout=120)
        assert not [p.pid for p in servers if _alive(p)], "servers outlived the bench"
        assert code == 128 + signal.SIGTERM, log.read_text()
    finally:
        if bench.poll() is None:
            bench.kill()
