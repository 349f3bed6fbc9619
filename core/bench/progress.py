"""How far a long benchmark has got, on stderr: a progress bar (tqdm) on a terminal,
and elsewhere (tee, nohup, CI) one line per step a log keeps:

    kvpush bench serve: cell 3/16, push colocated 1024 tok 8/s, elapsed 2m05s, ETA 8m20s

The ETA is the mean time of the steps done so far times the steps left: it includes
the servers each configuration starts, so it settles once a few steps have run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def duration(seconds: float) -> str:
    """1h02m, 2m05s, 45s."""
    whole = int(max(0.0, seconds) + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_line(
    command: str, unit: str, at: int, total: int, what: str, elapsed: float, eta: float | None
) -> str:
    """One step as a log line; `eta` None while nothing is done to estimate from."""
    left = "unknown" if eta is None else duration(eta)
    return f"{command}: {unit} {at}/{total}, {what}, elapsed {duration(elapsed)}, ETA {left}"


class Progress:
    """Steps of a long command: `show` says what runs now, `advance` that a step ended.

    `unit` names a step ("cell"); the number shown is the step running (done + 1),
    or with `counting_done` the steps done (a soak's requests ended). `bar` None
    chooses: a bar where `stream` is a terminal and tqdm is installed, lines elsewhere.
    """

    def __init__(
        self,
        command: str,
        unit: str,
        total: int,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        bar: bool | None = None,
        counting_done: bool = False,
    ) -> None:
        self.command, self.unit, self.total = command, unit, total
        self.stream = stream or sys.stderr
        self.clock = clock
        self.counting_done = counting_done
        self.done = 0
        self.started = clock()
        self._bar = (
            _tqdm_bar(command, unit, total, self.stream) if _wants_bar(bar, self.stream) else None
        )

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    def show(self, what: str, done: int | None = None) -> None:
        """Say what runs now; `done`, where given, is how many steps have ended."""
        if done is not None:
            self._move_to(done)
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=True)
            return
        at = self.done if self.counting_done else min(self.done + 1, self.total)
        line = progress_line(self.command, self.unit, at, self.total, what, *self._times())
        print(line, file=self.stream, flush=True)

    def advance(self, steps: int = 1) -> None:
        self._move_to(self.done + steps)

    def drop(self, steps: int) -> None:
        """Steps that will not run after all (an attached server has no placement to pin)."""
        self.total = max(self.done, self.total - steps)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _move_to(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self.done)
        self.done = done

    def _times(self) -> tuple[float, float | None]:
        elapsed = self.clock() - self.started
        if not self.done:
            return elapsed, None
        return elapsed, elapsed / self.done * max(0, self.total - self.done)


def _wants_bar(bar: bool | None, stream: TextIO) -> bool:
    if bar is not None:
        return bar
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and _tqdm() is not None


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings it; without it, lines on a terminal too
        return None
    return tqdm


def _tqdm_bar(command: str, unit: str, total: int, stream: TextIO) -> Any:
    return _tqdm()(total=total, desc=command, unit=unit, file=stream, dynamic_ncols=True)
