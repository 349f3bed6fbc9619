"""What a benchmark prints: its progress on stderr, then JSON lines or a table."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvpush.bench.progress import Progress


class Report:
    """Collects a benchmark's results, printing each as JSON at once when asked to.

    Each result added is one step of `progress` done.
    """

    def __init__(self, as_json: bool, progress: Progress) -> None:
        self.as_json = as_json
        self.progress = progress
        self.results: list[Any] = []

    def step(self, label: str) -> None:
        """Say what runs now."""
        self.progress.show(label)

    def add(self, result: Any) -> None:
        self.results.append(result)
        self.progress.advance()
        if self.as_json:
            print(json.dumps(asdict(result)), flush=True)

    def finish(self, print_table: Callable[[list[Any]], None]) -> list[Any]:
        """Close the progress bar; print the table unless JSON went out already."""
        self.progress.close()
        if not self.as_json:
            print_table(self.results)
        return self.results
