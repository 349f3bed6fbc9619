"""What a benchmark prints: its progress on stderr, then JSON lines or a table."""

from __future__ import annotations

import functools
import json
import os
import sys
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
        self._json_out = _own_stdout() if as_json else None

    def step(self, label: str) -> None:
        """Say what runs now."""
        self.progress.show(label)

    def add(self, result: Any) -> None:
        self.results.append(result)
        self.progress.advance()
        if self._json_out is not None:
            print(json.dumps(asdict(result)), file=self._json_out, flush=True)

    def finish(self, print_table: Callable[[list[Any]], None]) -> list[Any]:
        """Close the progress bar; print the table unless JSON went out already."""
        self.progress.close()
        if not self.as_json:
            print_table(self.results)
        return self.results


@functools.cache
def _own_stdout() -> Any:
    """Standard output for the JSON lines alone: a copy of its descriptor, with the
    descriptor itself pointed at stderr. UCX and other native libraries write their
    log lines to descriptor 1 (UCX's "failed to get interface index" while a network
    namespace goes away, say), which would break a reader's JSON. Once a process:
    a second call would copy the descriptor already pointed at stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out
