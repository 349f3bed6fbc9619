"""What a benchmark prints: a progress line on a terminal, then JSON lines or a table."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any


class Report:
    """Collects a benchmark's results, printing each as JSON at once when asked to."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.progress = sys.stderr.isatty()
        self.results: list[Any] = []

    def step(self, label: str) -> None:
        """Say what runs now (terminals only: a pipe gets clean output)."""
        if self.progress:
            print(f"\r{label} ...".ljust(40), end="", file=sys.stderr, flush=True)

    def add(self, result: Any) -> None:
        self.results.append(result)
        if self.as_json:
            print(json.dumps(asdict(result)), flush=True)

    def finish(self, print_table: Callable[[list[Any]], None]) -> list[Any]:
        """Clear the progress line; print the table unless JSON went out already."""
        if self.progress:
            print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
        if not self.as_json:
            print_table(self.results)
        return self.results
