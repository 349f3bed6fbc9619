"""Where a disaggregated request's time goes on one instance, phase by phase.

Each request's milestones are read off the request ledger's moves
(kvpush.engine.moves: `read`), off the workers' notes of when KV landed or was
sent (`noted`), and off the steps vLLM schedules (`scheduled`); the phases
between consecutive milestones are the spans. They are kept per request for the
last few hundred requests (GET /kvpush/trace on the identity port) and summed up
per phase (GET /kvpush/spans). Milestones come with wall-clock times: a worker's
landing is stamped in the worker process, on the same host's clock.

decode   arrived -> allocated -> landed -> scheduled -> finished
         queued      kv_wait     to_step    generate
prefill  arrived -> computing -> computed -> released
         queued      compute     send

Every phase of a request that reached its last milestone is present and
non-negative, and the phases add up to its time on this instance.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.engine.moves import Moved
from kvpush.metrics import quantile

MILESTONES = {
    "decode": ("arrived", "allocated", "landed", "scheduled", "finished"),
    "prefill": ("arrived", "computing", "computed", "released"),
}
# Moments noted beside the milestones, in no phase. Decode: kv_ready, when prefill's
# last prompt step ended (landed - kv_ready is the hand-off's residual); reported,
# when the scheduler heard of the landing from a step's output (landed -> reported
# -> scheduled splits to_step into the step that carried the news and the wait for
# the next schedule). Prefill:
# last_step, when the step computing the last prompt token was scheduled; chunk_sent,
# when the first WRITE of an earlier chunk's KV ended (progressive push).
EVENTS = {"decode": ("kv_ready", "reported"), "prefill": ("last_step", "chunk_sent")}
PHASES = {
    "decode": ("queued", "kv_wait", "to_step", "generate"),
    "prefill": ("queued", "compute", "send"),
}
# Parts of the hand-off, from the events, summed up beside the phases: prefill's last
# step ended -> the KV landed (the WRITE's residual; prefill's clock, so across hosts
# only as good as their clocks agree); landed -> a step's output told the scheduler;
# told -> the step that uses the KV was scheduled.
PARTS = {
    "decode": {
        "handoff": ("kv_ready", "landed"),
        "report": ("landed", "reported"),
        "resume": ("reported", "scheduled"),
    },
    "prefill": {},
}
_RECENT = 512
_SAMPLES = 4096
# The milestones a ledger move reaches, by its leg and the state it reached
# (kvpush.engine.decode, kvpush.engine.prefill); _reached has the moves whose
# milestones depend on the state they left too.
_BEGINS = {"decode": ("announced", "rejected"), "prefill": ("admitted",)}
_REACHES = {
    "decode": {"loading": ("allocated",), "landed": ("landed", "reported"),
               "failed": ("reported",)},
    "prefill": {"computing": ("computing",), "sending": ("last_step",)},
}  # fmt: skip


# A prefill leg held or released reaches its milestone only from the state before it
# on the path: held from sending (its KV computed and echoed), released from held.
_ON_PATH = {("held", "sending"): "computed", ("released", "held"): "released"}


def _reached(moved: Moved) -> tuple[tuple[str, ...], bool]:
    """The milestones a ledger move reaches, and whether the request's timeline ends
    with it off the path (kept as far as it got)."""
    if moved.after is None:  # the engine finished a decode leg
        return ("finished",), True
    if moved.leg == "prefill" and moved.after in ("held", "released"):
        milestone = _ON_PATH.get((moved.after, moved.before))
        return ((milestone,), False) if milestone else ((), True)
    return _REACHES[moved.leg].get(moved.after, ()), False


@dataclass
class _Timeline:
    role: str
    transfer_id: str
    marks: dict[str, float] = field(default_factory=dict)
    error: str = ""  # why kvpush failed the request, for whoever asks its trace

    def spans(self) -> dict[str, float]:
        """Phases between consecutive milestones (see _between)."""
        pairs = itertools.pairwise(MILESTONES[self.role])
        return self._between(dict(zip(PHASES[self.role], pairs, strict=True)))

    def parts(self) -> dict[str, float]:
        """The hand-off's parts (see _between)."""
        return self._between(PARTS[self.role])

    def _between(self, intervals: dict[str, tuple[str, str]]) -> dict[str, float]:
        """Each named (start, end) interval whose two marks are both present, clamped
        at zero (two clocks: the worker's and the scheduler's reads of one host's wall
        clock)."""
        return {
            name: max(0.0, self.marks[end] - self.marks[start])
            for name, (start, end) in intervals.items()
            if start in self.marks and end in self.marks
        }

    def complete(self) -> bool:
        return all(m in self.marks for m in MILESTONES[self.role])

    def as_dict(self) -> dict[str, Any]:
        answer = {
            "role": self.role,
            "transfer_id": self.transfer_id,
            "marks": dict(self.marks),
            "spans_ms": {k: round(v * 1e3, 3) for k, v in self.spans().items()},
        }
        if self.error:
            answer["error"] = self.error
        return answer


class Spans:
    """Marked by the engine's thread, read by the identity endpoint's: every method
    holds the lock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._open: dict[str, _Timeline] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        self._samples: dict[str, deque[float]] = {}

    def begin(self, request_id: str, role: str, transfer_id: str) -> None:
        with self._lock:
            self._begin(request_id, role, transfer_id)

    def _begin(self, request_id: str, role: str, transfer_id: str) -> None:
        if request_id not in self._open:
            self._open[request_id] = _Timeline(role, transfer_id, {"arrived": self._clock()})

    def read(self, moves: Iterable[Moved]) -> None:
        """The request ledger's moves (Ledger.take_moves), in order."""
        with self._lock:
            for moved in moves:
                if moved.before is None:
                    if moved.after in _BEGINS[moved.leg]:
                        self._begin(moved.request_id, moved.leg, moved.transfer_id)
                    continue
                milestones, off_path = _reached(moved)
                for milestone in milestones:
                    self._mark(moved.request_id, milestone, None)
                if off_path and moved.request_id in self._open:
                    self._close(moved.request_id)

    def noted(self, request_id: str, walls: Mapping[str, float]) -> None:
        """Moments a worker noted of a request, on its wall clock (it landed, its KV
        was ready, a chunk was sent): these come before the ledger hears of them."""
        with self._lock:
            for milestone, wall in walls.items():
                self._mark(request_id, milestone, wall)

    def fail(self, request_id: str, why: str) -> None:
        """kvpush failed the request: its trace says why (the first reason given). vLLM
        may have finished it already (its record closed): that record says so."""
        with self._lock:
            timeline = self._open.get(request_id)
            if timeline is not None:
                timeline.error = timeline.error or why
                return
            for record in reversed(self._recent):
                if record["request_id"] == request_id:
                    record.setdefault("error", why)
                    return

    def mark(self, request_id: str, milestone: str, at: float | None = None) -> None:
        """Record a milestone once (the first time it is seen counts)."""
        with self._lock:
            self._mark(request_id, milestone, at)

    def _mark(self, request_id: str, milestone: str, at: float | None) -> None:
        timeline = self._open.get(request_id)
        if timeline is None or milestone in timeline.marks:
            return
        if milestone not in MILESTONES[timeline.role] + EVENTS[timeline.role]:
            raise ValueError(f"{milestone!r} is not a {timeline.role} milestone")
        timeline.marks[milestone] = self._clock() if at is None else at
        if milestone == MILESTONES[timeline.role][-1]:
            self._close(request_id)

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """A step was scheduled: landed requests among `request_ids` reached theirs.
        Looks only at the step's requests, not every open one: it runs every step."""
        with self._lock:
            for request_id in request_ids:
                timeline = self._open.get(request_id)
                if timeline is not None and "landed" in timeline.marks:
                    self._mark(request_id, "scheduled", None)

    def drop(self, request_id: str) -> None:
        """The request ended off the path (aborted, recomputed): keep what it got to."""
        with self._lock:
            if request_id in self._open:
                self._close(request_id)

    def _close(self, request_id: str) -> None:
        timeline = self._open.pop(request_id)
        self._recent.append({"request_id": request_id, **timeline.as_dict()})
        if not timeline.complete():
            return
        for phase, seconds in (timeline.spans() | timeline.parts()).items():
            key = f"{timeline.role}.{phase}"
            self._samples.setdefault(key, deque(maxlen=_SAMPLES)).append(seconds)

    def trace(self, last: int = 100) -> list[dict[str, Any]]:
        """The last `last` finished requests' milestones and spans, oldest first."""
        with self._lock:
            return list(self._recent)[-last:]

    def summary(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Per phase (and hand-off part) over recent complete requests: count, mean,
        p50, p99 (ms); with `reset`, start counting afresh (a benchmark's next cell)."""
        with self._lock:
            return self._summary(reset)

    def _summary(self, reset: bool) -> dict[str, dict[str, float]]:
        out = {}
        for key, samples in sorted(self._samples.items()):
            out[key] = {
                "count": len(samples),
                "mean_ms": round(1e3 * sum(samples) / len(samples), 3),
                "p50_ms": round(1e3 * quantile(samples, 0.50), 3),
                "p99_ms": round(1e3 * quantile(samples, 0.99), 3),
            }
        if reset:
            self._samples.clear()
        return out
