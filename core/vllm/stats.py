"""kvpush numbers in vLLM's connector stats and Prometheus metrics.

Each worker reports what happened since its last report; vLLM sums the workers'
reports (aggregate), logs a summary (reduce) and feeds Prometheus (observe).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpush.metrics import Metrics

COUNTS = ("delivered", "failed", "released", "bytes", "rejected_messages", "handshakes_refused",
          "reconnects")  # fmt: skip
SAMPLES = ("done_to_ready_s",)
# Per reason: decode prompts computed locally (the scheduler's), transfers whose other
# leg never came (prefill: KV nobody announced; decode: a leg without params), refused
# decode legs, and prefill legs' prefix-cache tokens (queried, hit).
BY_REASON = ("recomputed", "orphaned", "refused", "prefill_leg_prefix")


def node_totals(metrics: Metrics) -> dict[str, float]:
    """The counts of COUNTS that a worker's Node keeps (kvpush.metrics), by the key
    they are reported under: totals so far, which the worker turns into increments."""
    return {
        "rejected_messages": metrics.counter("rejected_messages"),
        "handshakes_refused": metrics.counter("handshakes", result="refused"),
        "reconnects": metrics.counter("reconnects"),
    }


@dataclass
class KVPushStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key in COUNTS:
            self.data.setdefault(key, 0)
        for key in SAMPLES:
            self.data.setdefault(key, [])
        for key in BY_REASON:
            self.data.setdefault(key, {})

    def count(self, key: str, reason: str, value: int = 1) -> None:
        """Count `value` under `reason` of the per-reason count `key`."""
        counts = self.data[key]
        counts[reason] = counts.get(reason, 0) + value

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        for key in COUNTS:
            self.data[key] += other.data.get(key, 0)
        for key in SAMPLES:
            self.data[key] = self.data[key] + list(other.data.get(key, []))
        for key in BY_REASON:
            self.data[key] = dict(Counter(self.data[key]) + Counter(other.data.get(key) or {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {key: self.data[key] for key in COUNTS}
        samples = self.data["done_to_ready_s"]
        if samples:
            summary["done_to_ready_p50_ms"] = round(1e3 * statistics.median(samples), 3)
        for key in BY_REASON:
            for reason, count in sorted(self.data[key].items()):
                summary[f"{key}_{reason}"] = count
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTS + SAMPLES + BY_REASON)


class KVPushPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvpush_{key}_total",
                    documentation=_DOCS[key],
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for key in COUNTS
        }
        self.done_to_ready = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvpush_done_to_ready_seconds",
                documentation="Prefill KV ready to decode KV usable, per transfer",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        # Labelled by reason too, so children are made as reasons appear.
        self.by_reason = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "reason"])
            for key, (name, doc) in _BY_REASON_METRICS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in COUNTS:
            value = transfer_stats_data.get(key, 0)
            if value:
                self.counters[key][engine_idx].inc(value)
        for sample in transfer_stats_data.get("done_to_ready_s", []):
            self.done_to_ready[engine_idx].observe(sample)
        engine = self.per_engine_labelvalues[engine_idx]
        for key, counter in self.by_reason.items():
            for reason, count in (transfer_stats_data.get(key) or {}).items():
                counter.labels(*engine, reason).inc(count)


# BY_REASON's counters: their Prometheus names and help.
_BY_REASON_METRICS = {
    "recomputed": (
        "vllm:kvpush_local_recomputes_total",
        "Decode prompts computed locally because no transfer served them, by reason "
        "(kv_load_failure_policy recompute, or no kv_transfer_params)",
    ),
    "orphaned": (
        "vllm:kvpush_orphaned_total",
        "Transfers whose other leg never came, by reason: prefill KV no decode announced "
        "within orphan_grace_s (no_decode_announced), a decode cancelled before claiming "
        "it (decode_cancelled) or the router said never reached decode (router_released), "
        "or a decode leg whose orchestrator dropped the prefill answer's kv_transfer_params",
    ),
    "prefill_leg_prefix": (
        "vllm:kvpush_prefill_leg_prefix_tokens_total",
        "Prompt tokens of prefill legs (requests whose KV goes to a decode instance) "
        "looked up in this instance's prefix cache (reason queried) and found there "
        "(reason hit), counted as vllm:prefix_cache_queries/hits count them: those less "
        "these are the requests this instance decodes",
    ),
    "refused": (
        "vllm:kvpush_refused_legs_total",
        "Decode legs whose kv_transfer_params were refused before any transfer "
        "(malformed, a producer not allowed, a bootstrap server that could not answer), "
        "by reason",
    ),
}

_DOCS = {
    "delivered": "kvpush transfers whose KV arrived (decode)",
    "failed": "kvpush transfers that ended without KV (decode)",
    "released": "kvpush transfers whose source blocks were freed (prefill)",
    "bytes": "Bytes kvpush moved with NIXL",
    "rejected_messages": "Side-channel messages refused (bad signature, malformed, stray)",
    "handshakes_refused": "Pairings refused (mode, secret, ranks, layout, metadata)",
    "reconnects": "NIXL peers loaded again after a transfer to or from them failed outright",
}
