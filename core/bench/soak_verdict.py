"""What one soak came to, from what it saw (pure): each request's record and each
instance's after the run, which failures a fault explains, which answers equal the
plain instance's, and the summary with the targets each true or false
(`kvpush bench soak`, kvpush.bench.soak)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpush.bench import faults as faultlib

OK, FAILED, HUNG, DISCONNECTED = "ok", "failed", "hung", "disconnected"
RESOURCE_TOLERANCE = 0.10  # RSS and open files after the run: within 10 % of settled


@dataclass
class Record:
    """One request as the client saw it (times in seconds since the run started)."""

    index: int
    request: dict[str, Any]  # Shape.describe()
    sent_s: float
    ended_s: float
    outcome: str
    status: int = 0
    error: str = ""
    openai_error: bool = False  # the error came as {"error": {"message": ...}}
    answer: list[str] = field(default_factory=list)  # each choice's text, by index
    match: bool | None = None  # equal to the plain instance's (deterministic, ok only)
    fault: int | None = None  # the fault whose window explains a failure
    cause_named: bool | None = None  # a failure's error names what failed

    def as_json(self) -> str:
        return json.dumps({"type": "request", **asdict(self)})


@dataclass
class Instance:
    """One kvpush server after the run, against its level once settled (a restarted
    instance: the level its first incarnation settled at)."""

    name: str
    role: str
    restarts: int
    state: dict[str, Any]  # /kvpush/state after quiescence
    rss_mib: tuple[float, float]  # settled after warm-up, after the run
    fds: tuple[int, int]

    @property
    def quiet(self) -> bool:
        return set(self.state) == {"sending", "producing", "receiving"} and not any(
            self.state.values()
        )

    @property
    def within_tolerance(self) -> bool:
        (rss0, rss1), (fds0, fds1) = self.rss_mib, self.fds
        limit = 1 + RESOURCE_TOLERANCE
        return rss1 <= rss0 * limit and fds1 <= fds0 * limit


def explain(records: list[Record], faults: list[faultlib.Fault], grace_s: float) -> None:
    """Give each failed or hung request the fault whose window it was in flight in,
    and say whether its error names the cause."""
    for record in records:
        if record.outcome not in (FAILED, HUNG):
            continue
        fault = faultlib.attribute(record.sent_s, record.ended_s, faults, grace_s)
        record.fault = None if fault is None else fault.id
        record.cause_named = record.openai_error and faultlib.names_cause(record.error)


def spread(items: list, most: int | None) -> list:
    """At most `most` of `items`, evenly spaced (all where None)."""
    if most is None or len(items) <= most:
        return items
    return [items[i * len(items) // most] for i in range(most)]


def compare(records: list[Record], reference: dict[int, list[str] | None]) -> None:
    """Mark each answered deterministic request equal or not to the plain instance's
    answer (`reference`, by request index; None where the plain instance failed)."""
    for record in records:
        if record.index in reference and record.outcome == OK:
            want = reference[record.index]
            record.match = None if want is None else record.answer == want


def summarize(
    records: list[Record], faults: list[faultlib.Fault], instances: list[Instance],
    seconds: float, rate: float,
) -> dict[str, Any]:  # fmt: skip
    """The run in one object: counts, the issue's targets each true or false, and
    examples of whatever broke one."""
    outcomes = Counter(r.outcome for r in records)
    failed = [r for r in records if r.outcome == FAILED]
    wrong = [r for r in records if r.match is False]
    unexplained = [r for r in failed if r.fault is None]
    unnamed = [r for r in failed if not r.cause_named]
    targets = {
        "no_hung_requests": outcomes[HUNG] == 0,
        "no_wrong_answers": not wrong,
        "every_failure_in_a_fault_window": not unexplained,
        "every_failure_names_its_cause": not unnamed,
        "nothing_in_flight_or_held": all(i.quiet for i in instances),
        "rss_and_fds_within_10pct": all(i.within_tolerance for i in instances),
        "membership_checks_held": all(f.held is not False for f in faults),
    }
    return {
        "type": "summary",
        "requests": len(records),
        "seconds": round(seconds, 1),
        "rate": round(rate, 3),
        "outcomes": {k: outcomes[k] for k in (OK, FAILED, DISCONNECTED, HUNG)},
        "compared": sum(r.match is not None for r in records),
        "wrong": len(wrong),
        "unexplained_failures": len(unexplained),
        "failures_not_naming_cause": len(unnamed),
        "failures_by_fault": dict(Counter(str(r.fault) for r in failed if r.fault is not None)),
        "faults": [f.as_dict() for f in faults],
        "instances": [
            {**asdict(i), "quiet": i.quiet, "within_tolerance": i.within_tolerance}
            for i in instances
        ],
        "targets": targets,
        "passed": all(targets.values()),
        "examples": {
            "hung": [_example(r) for r in records if r.outcome == HUNG][:10],
            "wrong": [_example(r) for r in wrong][:10],
            "unexplained": [_example(r) for r in unexplained][:10],
            "not_naming_cause": [_example(r) for r in unnamed][:10],
        },
    }


def _example(record: Record) -> dict[str, Any]:
    """A request that broke a target, in short: enough to find it in the logs."""
    keep = ("endpoint", "stream", "n", "prompt_lens")
    return {
        "index": record.index, "sent_s": record.sent_s, "ended_s": record.ended_s,
        "status": record.status, "error": record.error, "fault": record.fault,
        **{k: record.request[k] for k in keep if k in record.request},
    }  # fmt: skip
