"""What a `kvpush bench serve` run keeps beside its table, to explain an outlier
after the servers are gone: each cell's traces with every request as the client saw
it, and every server's and router's log."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kvpush.bench.load import Outcome


def write_traces(
    path: Path, traces: dict[str, Any], outcomes: list[Outcome], send_at: list[float],
    wall_start: float,
) -> None:  # fmt: skip
    """`traces` (each kvpush instance's and router's, by name) and the client's view of
    each request: its send time (`wall_start` + `at_s`) finds it in the router's trace
    by `received_unix`."""
    client = [
        {"at_s": round(at, 4), "ok": o.ok, "ttft_ms": round(o.ttft * 1e3, 3), "error": o.error}
        for o, at in zip(outcomes, send_at, strict=True)
    ]
    traces = {**traces, "client": {"started_unix": round(wall_start, 4), "requests": client}}
    path.write_text(json.dumps(traces))


def keep_logs(workdir: Path, out: Path) -> None:
    """Every `*.log` under `workdir`, copied to `out`/logs at the same relative path."""
    for log in workdir.rglob("*.log"):
        kept = out / "logs" / log.relative_to(workdir)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, kept)
