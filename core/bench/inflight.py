"""`kvpush bench inflight`: what one request in flight costs a new prompt's time to
first token, counted in prompt tokens: the unit prefix placement weighs queues in
(`kvpush router --queue-tokens`).

Two kvpush decode instances on real vLLM share one set of CPUs (--cpus), as instances
a router names with one `device=` do; a request without KV to receive runs on one
as on a plain instance. On the otherwise idle pair the bench measures:
- the TTFT of a fresh prompt at two lengths, alone: their difference over the
  tokens between them is the compute of one prompt token;
- for each prompt length and each K, the prompt's TTFT alone, and while K requests
  decode on the same instance or on the other one, beside it; tries alone and with
  the K take turns.
One request in flight costs (TTFT with K - TTFT alone) / K, and in tokens that over
one token's compute. The K requests have their first token (their prompts are
computed) before the prompt is sent, and are cut off once it has its own; each
figure is the median of --reps tries. Every prompt is fresh: no prefix is cached.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvpush.bench import load
from kvpush.bench.cpu import parse_cpus, pin_tree
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.errors import KVPushError
from kvpush.metrics import samples

PLACES = ("same", "beside")  # where the K requests decode: the prompt's instance, the other
RUNNING = "vllm:num_requests_running"
DECODE_TOKENS = 1024  # what a request in flight may decode; it is cut off sooner


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (256, 512)  # the new prompt's
    in_flight: tuple[int, ...] = (1, 2, 4)  # K
    context: int = 2048  # the prompt of each request in flight
    slope: tuple[int, int] = (512, 2048)  # the lengths one token's compute is read from
    reps: int = 9
    cpus: str = "0"
    model: Path | None = None  # None: the bench's tiny model
    seed: int = 0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.lengths or not self.in_flight or min(self.in_flight) < 1 or self.reps < 1:
            raise KVPushError("the inflight bench needs a length, K >= 1 and one try at least")
        if not 0 < self.slope[0] < self.slope[1]:
            raise KVPushError(f"the slope's two lengths must rise, not {list(self.slope)}")


@dataclass
class Row:
    prompt_len: int
    in_flight: int
    place: str  # "same" or "beside"
    alone_ms: float
    with_ms: float
    ms_per_token: float  # one prompt token's compute, from the slope
    added_ms_per_request: float
    tokens_per_request: float


class Pair:
    """The two instances, the first the one every measured prompt goes to."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], settings: Settings) -> None:
        self.session = session
        self.urls = urls
        self.settings = settings
        self.rng = random.Random(settings.seed)

    async def ttft(self, url: str, length: int, first: asyncio.Event | None = None,
                   max_tokens: int = 1) -> float:  # fmt: skip
        """Seconds to the first token of a fresh prompt of `length` tokens. `first`
        is set then; the request goes on until it is done or cancelled."""
        tokens = [self.rng.randrange(6, 2046) for _ in range(length)]
        body = {"model": load.MODEL, "prompt": tokens, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        sent, took = time.monotonic(), None
        async with self.session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise KVPushError(f"{url} answered {response.status}: {await response.text()}")
            async for _ in load.sse_chunks(response):
                if took is None:
                    took = time.monotonic() - sent
                    if first is not None:
                        first.set()
        if took is None:
            raise KVPushError(f"{url} streamed no token")
        return took

    async def with_in_flight(self, length: int, k: int, busy: str) -> float:
        """The prompt's TTFT on the first instance while `k` requests decode on `busy`."""
        started = [asyncio.Event() for _ in range(k)]
        running = [asyncio.create_task(self.ttft(busy, self.settings.context, event,
                                                 DECODE_TOKENS)) for event in started]  # fmt: skip
        try:
            waiting = asyncio.gather(*(event.wait() for event in started))
            await asyncio.wait_for(waiting, self.settings.request_timeout_s)
            await self.expect_running(busy, k)
            return await self.ttft(self.urls[0], length)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def running(self, url: str) -> float:
        async with self.session.get(url + "/metrics") as response:
            return sum(v for _, v in samples(await response.text(), RUNNING))

    async def expect_running(self, url: str, k: int) -> None:
        """The premise of a try: `k` requests decode on `url`, none on the other."""
        for each in self.urls:
            running, wanted = await self.running(each), k if each == url else 0
            if running != wanted:
                raise KVPushError(f"{each} runs {running:g} requests; the try wants {wanted}")

    async def settle(self) -> None:
        """Until the last try's cut-off requests are gone from both instances."""
        deadline = time.monotonic() + 10.0
        while [await self.running(url) for url in self.urls] != [0, 0]:
            if time.monotonic() > deadline:
                raise KVPushError("the requests cut off 10 s ago still run")
            await asyncio.sleep(0.02)

    async def alone_ms(self, length: int) -> float:
        tries = []
        for _ in range(self.settings.reps):
            await self.settle()
            tries.append(await self.ttft(self.urls[0], length))
        return statistics.median(tries) * 1000

    async def alone_and_with_ms(self, length: int, k: int, place: str) -> tuple[float, float]:
        """Median TTFTs alone and with `k` in flight at `place`, the tries taking
        turns: whatever the host does meanwhile falls on both alike."""
        busy = self.urls[PLACES.index(place)]
        alone, with_k = [], []
        for _ in range(self.settings.reps):
            await self.settle()
            alone.append(await self.ttft(self.urls[0], length))
            await self.settle()
            with_k.append(await self.with_in_flight(length, k, busy))
        return statistics.median(alone) * 1000, statistics.median(with_k) * 1000


async def measure(urls: list[str], settings: Settings, report: Report) -> list[Row]:
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        pair = Pair(session, urls, settings)
        for url in urls:  # each engine's first steps are slow
            for _ in range(3):
                await pair.ttft(url, settings.slope[0])
        short, long = settings.slope
        report.step(f"one token's compute: {short} and {long} tokens alone")
        ms_per_token = (await pair.alone_ms(long) - await pair.alone_ms(short)) / (long - short)
        if ms_per_token <= 0:
            raise KVPushError(f"a {long}-token prompt was no slower than a {short}-token one")
        rows = []
        for length in settings.lengths:
            for k in settings.in_flight:
                for place in PLACES:
                    report.step(f"{length} tokens, {k} in flight {place}")
                    alone, busy = await pair.alone_and_with_ms(length, k, place)
                    added = (busy - alone) / k
                    row = Row(length, k, place, round(alone, 2), round(busy, 2),
                              round(ms_per_token, 5), round(added, 2),
                              round(added / ms_per_token, 1))  # fmt: skip
                    report.add(row)
                    rows.append(row)
        return rows


def run(settings: Settings, out: Path, report: Report) -> list[Row]:
    from kvpush.demo.cluster import Cluster
    from kvpush.demo.tinymodel import cached_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvpush-bench-inflight-"))
    cluster = Cluster(workdir, settings.model or cached_tiny_model())
    longest = max(settings.context + DECODE_TOKENS, settings.slope[1], *settings.lengths) + 1
    try:
        for name in ("measured", "beside"):
            # kvpush decode instances, as a router's are: vLLM's own readers spin a
            # core for 1 s after each step, and a neighbour's spin would be measured.
            server = cluster.add_server(name, "kv_consumer", core=settings.cpus)
            server.spec.max_model_len = -(-longest // 1024) * 1024
        report.step("starting two instances")
        cluster.start()
        for server in cluster.servers.values():
            pin_tree(server.process.pid, parse_cpus(settings.cpus))
        urls = [server.url for server in cluster.servers.values()]
        rows = asyncio.run(measure(urls, settings, report))
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    (out / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| prompt | in flight | where | alone ms | with ms | added ms a request "
             "| prompt tokens a request |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.prompt_len} | {r.in_flight} | {r.place} | {r.alone_ms:.1f} "
                     f"| {r.with_ms:.1f} | {r.added_ms_per_request:.1f} "
                     f"| {r.tokens_per_request:.0f} |")  # fmt: skip
    if rows:
        lines.append(f"\nOne prompt token's compute: {rows[0].ms_per_token:.4f} ms.")
    return "\n".join(lines) + "\n"


def main(settings: Settings, out: Path, as_json: bool) -> int:
    steps = len(settings.lengths) * len(settings.in_flight) * len(PLACES)
    report = Report(as_json, Progress("kvpush bench inflight", "row", steps))
    rows = run(settings, out, report)
    table = markdown(rows)
    (out / "table.md").write_text(table)
    report.finish(lambda _: print(table))
    print(f"kvpush bench inflight: results in {out}", file=sys.stderr)
    return 0
