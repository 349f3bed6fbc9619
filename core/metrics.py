"""Counters, gauges and histograms for a kvpush worker or the router, readable as a dict
or Prometheus text.

Thread-safe: the loop thread records, any thread reads.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import defaultdict, deque
from collections.abc import Iterable

# Seconds: from tens of microseconds (a notification) to minutes (a lease).
MAX_SAMPLES = 100_000  # kept per histogram for quantiles and readers
TIME_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

HELP = {
    "transfers_started": "Transfers this worker took part in, by role",
    "transfers_delivered": "Consumer transfers whose KV arrived",
    "transfers_failed": "Consumer transfers that ended without KV, by reason",
    "blocks_released": "Producer transfers whose source blocks were freed, by outcome",
    "chunk_writes": "Producer WRITEs of earlier prompt chunks' KV (progressive push)",
    "bytes_moved": "Bytes moved by NIXL, by operation",
    "rejected_messages": "Side-channel messages refused or ignored, by why",
    "rejected_notifs": "NIXL notifications ignored, by why",
    "handshakes": "Side-channel handshakes, by result",
    "write_retries": "Failed producer WRITEs posted again into the same blocks",
    "reconnects": "NIXL peers loaded again after a WRITE to or READ from them failed outright",
    "paired_consumers": "Consumers paired, by the order WRITEs to them take",
    "silent_consumers": "Consumer links dropped for silence while blocks were registered",
    "post_seconds": "Time to prepare and post one NIXL transfer",
    "transfer_seconds": "Time from posting a NIXL transfer to its completion",
    "done_to_ready_seconds": "Producer KV ready to consumer KV usable (wall clocks)",
    "consumer_wait_seconds": "Consumer blocks allocated to KV usable",
}


class Histogram:
    def __init__(self, buckets: Iterable[float] = TIME_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0
        self.samples: deque[float] = deque(maxlen=MAX_SAMPLES)  # the most recent

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1
        self.samples.append(value)

    def quantile(self, q: float) -> float | None:
        return quantile(self.samples, q)


def quantile(samples: Iterable[float], q: float) -> float | None:
    """The sample at rank q (0-1) of the sorted samples; None for none."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Series = dict[tuple[tuple[str, str], ...], float]  # a metric's value by label set


class Metrics:
    """Named counters and gauges (with label sets) and histograms. A counter only
    rises; a gauge is a value now (requests in flight, an instance up), which
    Prometheus must not read as a rate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, Series] = defaultdict(dict)
        self._gauges: dict[str, Series] = defaultdict(dict)
        self._histograms: dict[str, Histogram] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        """Gauge `name` is `value` now."""
        with self._lock:
            self._gauges[name][tuple(sorted(labels.items()))] = value

    def add(self, name: str, value: float, **labels: str) -> None:
        """Gauge `name` moves by `value` (either way)."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._gauges[name]
            series[key] = series.get(key, 0.0) + value

    def gauge(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._gauges.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            histogram = self._histograms.get(name)
            if histogram is None:
                histogram = self._histograms[name] = Histogram()
            histogram.observe(seconds)

    def counter(self, name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            if labels:
                return self._counters.get(name, {}).get(key, 0.0)
            return sum(self._counters.get(name, {}).values())

    def samples_since(self, name: str, seen: int) -> tuple[list[float], int]:
        """Samples observed after the first `seen` (as many as are kept), and the new
        count to pass next time: a reader's cursor that no concurrent observe can skip."""
        with self._lock:
            histogram = self._histograms.get(name)
            if histogram is None:
                return [], seen
            fresh = min(histogram.count - seen, len(histogram.samples))
            kept = list(histogram.samples)
            return kept[len(kept) - fresh :] if fresh > 0 else [], histogram.count

    def histogram(self, name: str) -> Histogram:
        with self._lock:
            return self._histograms.setdefault(name, Histogram())

    def snapshot(self) -> dict:
        """Counters by label string, histograms as count, sum and quantiles."""
        with self._lock:
            counters = {
                name: {_label_text(key) or "total": value for key, value in series.items()}
                for name, series in self._counters.items()
            }
            gauges = {
                name: {_label_text(key) or "value": value for key, value in series.items()}
                for name, series in self._gauges.items()
            }
            histograms = {name: h for name, h in self._histograms.items()}
        return {
            "counters": counters,
            "gauges": gauges,
            "histograms": {
                name: {
                    "count": h.count,
                    "sum": h.total,
                    "p50": h.quantile(0.5),
                    "p90": h.quantile(0.9),
                    "p99": h.quantile(0.99),
                }
                for name, h in histograms.items()
            },
        }

    def prometheus(
        self, prefix: str = "kvpush_", extra_labels: dict[str, str] | None = None
    ) -> str:
        """The Prometheus text exposition of everything recorded."""
        extra = tuple(sorted((extra_labels or {}).items()))
        lines: list[str] = []
        with self._lock:
            for kind, suffix, families in (
                ("counter", "_total", self._counters),
                ("gauge", "", self._gauges),
            ):
                for name, series in sorted(families.items()):
                    full = f"{prefix}{name}{suffix}"
                    lines.append(f"# HELP {full} {HELP.get(name, name)}")
                    lines.append(f"# TYPE {full} {kind}")
                    for key, value in sorted(series.items()):
                        lines.append(f"{full}{_labels(extra + key)} {value:g}")
            for name, h in sorted(self._histograms.items()):
                full = f"{prefix}{name}"
                lines.append(f"# HELP {full} {HELP.get(name, name)}")
                lines.append(f"# TYPE {full} histogram")
                running = 0
                for bound, count in zip(h.buckets, h.counts, strict=False):
                    running += count
                    le = (("le", f"{bound:g}"),)
                    lines.append(f"{full}_bucket{_labels(extra + le)} {running}")
                lines.append(f"{full}_bucket{_labels(extra + (('le', '+Inf'),))} {h.count}")
                lines.append(f"{full}_sum{_labels(extra)} {h.total:g}")
                lines.append(f"{full}_count{_labels(extra)} {h.count}")
        return "\n".join(lines) + "\n"


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label_text(key: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{k}={v}" for k, v in key)


def samples(text: str, name: str) -> list[tuple[str, float]]:
    """Each sample of metric `name` (a counter's `_total` optional) in a Prometheus
    text page, as (its labels, its value)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)$", re.M)
    return [(labels or "", float(value)) for labels, value in pattern.findall(text)]
