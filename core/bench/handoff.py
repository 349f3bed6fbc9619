"""`kvpush bench handoff`: what is left of the KV hand-off once prefill has computed.

The residual R of a request is the time from the end of prefill's last forward step
to decode holding all of its KV. Decode's trace (GET /kvpush/trace) notes both ends:
kv_ready, the producer's wall clock when that step ended (it travels with the last
WRITE's notification), and landed, when the last byte was in decode's memory (same
host, same clock). Whatever crossed earlier is not in R: that is the point of pushing
layer by layer (the last step's layers) and chunk by chunk (the earlier steps' blocks).

For each push granularity in turn (request, layer, chunk) this starts a kvpush 1P1D
pair on real vLLM, each server's process tree pinned to its own CPUs, with a small
step budget (--max-num-batched-tokens) so long prompts are computed in many chunks,
and sends prompts one at a time (no queueing in R). The model is the KV-heavy tiny
model (16 KiB of KV per token: transfer time is not lost next to compute; a real
Qwen3-32B has 256 KiB per token, and computes far more per byte on a GPU).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpush.bench import load, serve
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.errors import KVPushError
from kvpush.vllm.config import GRANULARITIES


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (512, 8192)
    granularities: tuple[str, ...] = GRANULARITIES
    requests: int = 6
    step_tokens: int = 1024  # vLLM's --max-num-batched-tokens: the chunk size
    output_tokens: int = 4
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    model: Path | None = None  # None: the KV-heavy tiny model, built on the spot
    seed: int = 0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.granularities) - set(GRANULARITIES))
        if unknown:
            raise KVPushError(f"unknown granularity {unknown}; known: {list(GRANULARITIES)}")
        if self.requests < 1 or not self.lengths:
            raise KVPushError("the handoff bench needs at least one length and one request")


@dataclass
class Row:
    granularity: str
    prompt_len: int
    requests: int
    failures: int
    residual_p50_ms: float | None
    residual_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    chunks_sent_before_last_step: int  # requests whose earlier chunks crossed first
    errors: list[str]


def residuals(decode_trace: list[dict], since: float) -> list[float]:
    """R (seconds) of each decode request that arrived after `since` and landed."""
    found = []
    for entry in decode_trace:
        marks = entry.get("marks", {})
        if marks.get("arrived", 0.0) >= since and "landed" in marks and "kv_ready" in marks:
            found.append(max(0.0, marks["landed"] - marks["kv_ready"]))
    return found


def early_chunks(prefill_trace: list[dict], since: float) -> int:
    """Prefill requests after `since` whose first chunk crossed before the last step."""
    count = 0
    for entry in prefill_trace:
        marks = entry.get("marks", {})
        if marks.get("arrived", 0.0) >= since and "chunk_sent" in marks:
            count += marks["chunk_sent"] < marks.get("last_step", float("inf"))
    return count


def summarize(
    granularity: str, length: int, outcomes: list[load.Outcome], r: list[float], early: int
) -> Row:
    ttfts = [o.ttft for o in outcomes if o.ok]
    return Row(
        granularity, length, len(outcomes), sum(not o.ok for o in outcomes),
        serve._ms(load.percentile(r, 50)), serve._ms(load.percentile(r, 99)),
        serve._ms(load.percentile(ttfts, 50)), serve._ms(load.percentile(ttfts, 99)),
        early, [o.error[:300] for o in outcomes if not o.ok][:3],
    )  # fmt: skip


class Handoff:
    def __init__(self, settings: Settings, out: Path, report: Report) -> None:
        self.settings = settings
        self.out = out
        self.report = report

    def run(self) -> list[Row]:
        from kvpush.demo.tinymodel import cached_kv_heavy_model

        self.out.mkdir(parents=True, exist_ok=True)
        model = self.settings.model or cached_kv_heavy_model()
        workdir = Path(tempfile.mkdtemp(prefix="kvpush-bench-handoff-"))
        try:
            with (self.out / "results.jsonl").open("w") as lines:
                for granularity in self.settings.granularities:
                    for row in self._granularity(granularity, workdir, model):
                        lines.write(json.dumps(asdict(row)) + "\n")
                        lines.flush()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return self.report.results

    def _granularity(self, granularity: str, workdir: Path, model: Path) -> list[Row]:
        s = self.settings
        pair = serve.Settings(
            lengths=s.lengths, configs=("push",), placements=("pinned",),
            prefill_cpus=s.prefill_cpus, decode_cpus=s.decode_cpus,
            vllm_args=("--max-num-batched-tokens", str(s.step_tokens)),
            kv_extra={"push_granularity": granularity}, request_timeout_s=s.request_timeout_s,
        )  # fmt: skip
        deployment = serve.Deployment("push", pair, workdir / granularity, model)
        rows = []
        try:
            self.report.step(f"{granularity}: starting")
            target = deployment.start()
            deployment.pin()
            self._one_by_one(target, load.prompts(1, min(s.lengths), s.seed + 999_999))
            for length in s.lengths:
                self.report.step(f"{granularity} {length} tok")
                since = time.time()
                batch = load.prompts(s.requests, length, s.seed + length)
                outcomes = self._one_by_one(target, batch)
                cluster = deployment.cluster
                r = residuals(_trace(cluster.identity_url("decode")), since)
                early = early_chunks(_trace(cluster.identity_url("prefill")), since)
                row = summarize(granularity, length, outcomes, r, early)
                self.report.add(row)
                rows.append(row)
        finally:
            deployment.stop()
        return rows

    def _one_by_one(self, target: load.Target, batch: list[list[int]]) -> list[load.Outcome]:
        s = self.settings
        return [
            asyncio.run(load.run(target, [tokens], [0.0], s.output_tokens, s.request_timeout_s))[0]
            for tokens in batch
        ]


def _trace(identity_url: str) -> list[dict]:
    with urllib.request.urlopen(identity_url + "/kvpush/trace?last=500", timeout=10) as response:
        return json.loads(response.read())


def markdown(rows: list[Row]) -> str:
    """R and TTFT per granularity and prompt length, R as a ratio to request's."""
    base = {r.prompt_len: r.residual_p50_ms for r in rows if r.granularity == "request"}
    lines = [
        "| prompt | granularity | R p50 ms | x request | R p99 ms | TTFT p50 ms | TTFT p99 ms "
        "| early chunks | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.prompt_len, GRANULARITIES.index(r.granularity))):
        ratio = base.get(r.prompt_len)
        ratio_text = f"{r.residual_p50_ms / ratio:.2f}" if ratio and r.residual_p50_ms else "—"
        lines.append(
            f"| {r.prompt_len} | {r.granularity} | {serve._f(r.residual_p50_ms)} | {ratio_text} "
            f"| {serve._f(r.residual_p99_ms)} | {serve._f(r.ttft_p50_ms)} "
            f"| {serve._f(r.ttft_p99_ms)} | {r.chunks_sent_before_last_step}/{r.requests} "
            f"| {r.failures} |"
        )
    return "\n".join(lines) + "\n"


def main(settings: Settings, out: Path, as_json: bool) -> int:
    rows_in_all = len(settings.granularities) * len(settings.lengths)
    report = Report(as_json, Progress("kvpush bench handoff", "row", rows_in_all))
    rows = Handoff(settings, out, report).run()
    table = markdown(rows)
    (out / "table.md").write_text(table)
    report.finish(lambda _: print(table))
    print(f"kvpush bench handoff: results in {out}", file=sys.stderr)
    return 1 if any(r.failures for r in rows) else 0
