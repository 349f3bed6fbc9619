"""`kvpush bench soak`: a kvpush deployment on real vLLM under load and faults.

It starts prefill and decode instances behind `kvpush router`, and beside them a
plain vLLM instance (no connector) that idles through the run and answers every
deterministic request afterwards: the reference. A warm-up measures what the
deployment serves flat out, then serves the mix at the run's rate until every
instance's memory has levelled off (the baseline); then `--requests` requests of a
seeded mix (kvpush.bench.mix) arrive as a Poisson process at `--rate`, or at `--load`
times the flat-out rate, while faults
(kvpush.bench.faults) are injected every `--fault-interval` seconds. Each request
ends one of four ways:

  ok            answered; deterministic requests must equal the plain instance's answer
  failed        an error (HTTP status, an error event, a cut stream) before its deadline;
                it must fall in a fault's window and name its cause
  disconnected  its client went away on purpose before the answer was complete
  hung          no answer by `--deadline`: the worst outcome, never acceptable

After the last request the instances go quiet, and each one's transfers in flight
and blocks held (`/kvpush/state`), and its process tree's RSS and open files against
their settled level, are read.

Out (in `--out`): requests.jsonl (a line per request, then a summary line),
table.md, faults.log, logs/ (every server's and the router's log); a progress line
on stderr while it runs.

One module: the run's phases (warm-up, settling, load with faults,
quiescence, the verdict) read in the order they run. Faults are bench/faults.py's and
membership_faults.py's, the load load.py's, the records and the verdict
soak_verdict.py's, the table soak_table.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvpush.bench import faults as faultlib
from kvpush.bench import load, membership_faults, mix
from kvpush.bench.cpu import tree_footprint
from kvpush.bench.progress import Progress
from kvpush.bench.soak_table import markdown
from kvpush.bench.soak_verdict import (
    DISCONNECTED,
    FAILED,
    HUNG,
    OK,
    Instance,
    Record,
    compare,
    explain,
    spread,
    summarize,
)
from kvpush.errors import KVPushError
from kvpush.protocol.config import ProtocolConfig

# Short protocol timers, so that a stopped process outlives them within a fault
# interval (the defaults are 30 s to 10 minutes).
SOAK_TIMERS = {"watchdog_s": 6.0, "heartbeat_s": 1.0, "write_grace_s": 2.0,
               "lease_s": 10.0, "registration_ttl_s": 10.0}  # fmt: skip
# Settled: no instance's RSS grew more than LEVEL_GROWTH over the last LEVEL_WINDOW_S.
# A leak keeps growing through the run whatever it did here; growth that stops is the
# allocators reaching the high-water mark of the mix (the first minutes of it, here).
LEVEL_GROWTH = 0.01
LEVEL_WINDOW_S = 30.0
SAMPLE_S = 10.0
WARM_UP_CONCURRENCY = 8
PLAIN = "plain"
# With --max-faults, the load goes on past --requests until the last fault is over:
# for at most this many times --requests more.
OVERRUN = 3


@dataclass(frozen=True)
class Settings:
    requests: int = 1000
    rate: float | None = None  # requests a second; None: `load` times the warm-up's
    load: float = 0.5  # fraction of the throughput measured flat out in warm-up
    prefill: int = 1
    decode: int = 1
    faults: tuple[str, ...] = faultlib.DEFAULT_FAULTS
    fault_interval_s: float = 120.0  # from the end of one fault to the next; 0: none
    max_faults: int | None = None
    stop_s: float | None = None  # SIGSTOP this long; None: past the decode watchdog
    grace_s: float = 20.0  # a fault's window lasts this much longer than the fault
    disconnect_share: float = 0.05
    deadline_s: float = 120.0  # a request without an answer by then hung
    router_timeout_s: float = 30.0  # the router's idle timeout per leg
    max_model_len: int = 2048
    policy: str = "fail"  # kv_load_failure_policy of decode
    kv_extra: dict[str, Any] = field(default_factory=dict)  # more connector settings
    insecure: bool = False  # no shared secret (the instances run with 'insecure')
    model: Path | None = None  # None: the tiny model, built on the spot
    kv_blocks: int | None = None  # each instance's KV cache blocks; None: what 1 GiB holds
    # Once the last fault is over, this many more requests at the same rate: whether the
    # deployment serves again, however long its restarts took.
    recovery: int = 0
    compare: int | None = None  # the most answers asked of the plain instance; None: all
    warm_up: int = 64  # flat out, eight at a time: the deployment's throughput
    settle_max_s: float = 300.0  # then the mix at the run's rate, until RSS levels off
    quiesce_s: float = 60.0  # the longest to wait for every instance to go quiet
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.prefill < 1 or self.decode < 1:
            raise KVPushError("a soak needs at least one request, prefill and decode")
        if (self.rate is not None and self.rate <= 0) or self.load <= 0:
            raise KVPushError("--rate and --load must be positive")
        if self.fault_interval_s > 0 and not self.faults:
            raise KVPushError("faults every --fault-interval, but no --faults kinds")

    @property
    def connector(self) -> dict[str, Any]:
        """The kvpush connector settings of every instance: short timers, then yours."""
        return {**SOAK_TIMERS, **self.kv_extra}

    @property
    def stop_seconds(self) -> float:
        """Past the protocol's timers: the longest a side waits for its peer, and a
        WRITE's grace after it."""
        if self.stop_s is not None:
            return self.stop_s
        c = {**asdict(ProtocolConfig()), **self.connector}
        longest = max(c["watchdog_s"], c["lease_s"], c["registration_ttl_s"])
        return longest + c["write_grace_s"] + 2.0


# -- one request ----------------------------------------------------------------------


async def exchange(
    session: aiohttp.ClientSession, url: str, shape: mix.Shape
) -> tuple[str, int, str, bool, list[str]]:
    """Send one request and read its answer to the end: outcome, HTTP status, error,
    whether the error was OpenAI-shaped, and each choice's text."""
    texts: dict[int, str] = {}
    try:
        async with session.post(url + shape.path, json=shape.body) as response:
            if response.status != 200:
                error, shaped = _error_of(await response.text())
                return FAILED, response.status, error, shaped, []
            if shape.stream:
                async for chunk in load.sse_chunks(response):
                    if "error" in chunk:
                        error, shaped = _error_of(json.dumps(chunk))
                        return FAILED, response.status, error, shaped, []
                    for choice in chunk.get("choices", ()):
                        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
            else:
                for choice in json.loads(await response.text())["choices"]:
                    text = choice.get("text")
                    texts[choice["index"]] = text if text is not None else _content(choice)
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        return FAILED, 0, f"{type(exc).__name__}: {exc}", False, []
    return OK, 200, "", False, [texts[i] for i in sorted(texts)]


def _all_answered(records: list[Record], phase: str) -> None:
    """Before the faults every request must be answered: a deployment that cannot
    serve is no soak."""
    broken = [r for r in records if r.outcome != OK]
    if broken:
        raise KVPushError(f"{phase} failed, no soak: {broken[0].outcome} {broken[0].error}")


def _content(choice: dict[str, Any]) -> str:
    return (choice.get("message") or {}).get("content") or ""


def _error_of(text: str) -> tuple[str, bool]:
    """An error body's message, and whether it was OpenAI's shape."""
    try:
        error = json.loads(text)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
        return str(message)[:500], isinstance(error, dict) and bool(message)
    except (ValueError, KeyError, TypeError):
        return text[:500], False


async def send(
    session: aiohttp.ClientSession, url: str, shape: mix.Shape, deadline_s: float,
    clock: Any,
) -> Record:  # fmt: skip
    """One request of the soak, with its client's deadline and, for a client that
    goes away, its disconnect."""
    sent = clock()
    leave = shape.disconnect_after_s
    wait = deadline_s if leave is None else min(leave, deadline_s)
    try:
        outcome, status, error, shaped, answer = await asyncio.wait_for(
            exchange(session, url, shape), wait
        )
    except asyncio.TimeoutError:
        if leave is not None and leave < deadline_s:
            outcome, status, error, shaped, answer = DISCONNECTED, 0, "", False, []
        else:
            outcome, status, shaped, answer = HUNG, 0, False, []
            error = f"no answer within the {deadline_s:g}s deadline"
    return Record(
        shape.index, shape.describe(), round(sent, 3), round(clock(), 3), outcome, status,
        error, shaped, answer,
    )  # fmt: skip


# -- settled (pure) ---------------------------------------------------------------------


def levelled(samples: list[dict[str, Any]], names: list[str]) -> bool:
    """Whether no instance's RSS grew more than LEVEL_GROWTH between the newest sample
    and the newest one at least LEVEL_WINDOW_S older (samples: footprints, oldest
    first, each {"t": seconds, name: (RSS MiB, open files), ...})."""
    newest = samples[-1]
    older = [sample for sample in samples if sample["t"] <= newest["t"] - LEVEL_WINDOW_S]
    if not older:
        return False
    return all(newest[n][0] <= older[-1][n][0] * (1 + LEVEL_GROWTH) for n in names)


# -- the run ----------------------------------------------------------------------------


class Soak:
    """One soak: its deployment, load, faults and report, written to `out`."""

    def __init__(self, settings: Settings, out: Path) -> None:
        self.settings = settings
        self.out = out
        self.records: list[Record] = []
        self.faults: list[faultlib.Fault] = []
        self.fault_log: list[str] = []
        self._started = time.monotonic()
        self._sent = 0
        self._now_fault = ""
        self._baseline: dict[str, tuple[float, int]] = {}  # name -> (RSS MiB, open files)
        self.footprints: list[dict[str, Any]] = []  # every instance's RSS and files over time

    def clock(self) -> float:
        return time.monotonic() - self._started

    def run(self) -> dict[str, Any]:
        from kvpush.demo.cluster import Cluster
        from kvpush.demo.tinymodel import cached_tiny_model

        self.out.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="kvpush-soak-"))
        model = self.settings.model or cached_tiny_model()
        self.cluster = Cluster(
            workdir, model, insecure=self.settings.insecure, kv_blocks=self.settings.kv_blocks
        )
        self.hosts: Any = None  # kvpush.netns.TwoHosts, when the servers run in namespaces
        try:
            self._say("starting the servers")
            self.router = self._deploy()
            summary = asyncio.run(self._soak(self.router))
        finally:
            self.cluster.stop()
            if self.hosts is not None:
                self.hosts.close()
            self._keep_logs(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
        self._write(summary)
        return summary

    def _deploy(self) -> str:
        s, cluster = self.settings, self.cluster
        self.prefill = [f"prefill{i}" for i in range(s.prefill)]
        self.decode = [f"decode{i}" for i in range(s.decode)]
        if "partition" in s.faults and s.fault_interval_s > 0:
            self._on_two_hosts()
        for role, names in (("prefill", self.prefill), ("decode", self.decode)):
            for name in names:
                self._configure(name, role)
        cluster.add_server(PLAIN, None, core=0).spec.max_model_len = s.max_model_len
        cluster.start()
        return cluster.start_router(self.prefill, self.decode, timeout_s=s.router_timeout_s)

    def _configure(self, name: str, role: str) -> None:
        """Set kvpush instance `name` up as every one of its role, an added one too:
        prefill on core 0 and decode on core 1, as the e2e tests place them (the
        reference idles through the run on core 0), on its role's host if there are two."""
        s = self.settings
        if role == "prefill":
            server = self.cluster.add_server(name, "kv_producer", core=0, **s.connector)
        else:
            server = self.cluster.add_server(
                name, "kv_consumer", core=1, policy=s.policy, **s.connector
            )
        server.spec.max_model_len = s.max_model_len
        if self.hosts is not None:
            host = self.hosts.a if role == "prefill" else self.hosts.b
            server.spec.host, server.spec.launcher = host.address, host.command([])
            server.spec.env["UCX_TLS"] = "tcp,self"

    def _on_two_hosts(self) -> None:
        """Prefill instances on one simulated host, decode on another (network
        namespaces, kvpush.netns), the router and the plain instance outside reaching
        both: a partition cuts the link between the hosts. UCX is held to TCP, or it
        would move the KV through shared memory and the link would carry none of it.
        Where namespaces cannot be made, the servers stay put and each partition is
        skipped, saying why."""
        try:
            from kvpush.netns import TwoHosts, unavailable
        except ImportError as exc:  # a build without the namespaces helper
            self._say(f"no network namespaces ({exc}): partitions will be skipped")
            return
        why = unavailable()
        if why:
            self._say(f"no network namespaces ({why}): partitions will be skipped")
            return
        self.hosts = TwoHosts(reachable=True).start()

    async def _soak(self, router: str) -> dict[str, Any]:
        s = self.settings
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as session:
            self._say("warming up")
            flat_out = await self._warm_up(session, router)
            rate = s.rate or s.load * flat_out
            self._say(f"settling at {rate:.2f} requests a second")
            await self._settle(session, router, rate)
            await asyncio.to_thread(self._quiesce)
            self._baseline = {name: self._footprint(name) for name in self.prefill + self.decode}
            most = s.requests * (1 + OVERRUN if s.max_faults else 1)
            shapes = mix.mix(most + s.recovery, s.seed, s.max_model_len, s.disconnect_share)
            started = self.clock()
            sent = await self._load(session, router, shapes[:most], rate, least=s.requests)
            if s.recovery:
                recovery = shapes[sent : sent + s.recovery]
                await self._load(session, router, recovery, rate, faults=False)
            seconds = self.clock() - started
            states = await asyncio.to_thread(self._quiesce)
            await asyncio.sleep(2.0)  # let freed memory and closed sockets settle
            instances = [self._instance(name, states) for name in states]
            self._say("asking the plain instance")
            reference = await self._reference(session, shapes)
        compare(self.records, reference)
        explain(self.records, self.faults, s.grace_s)
        return summarize(self.records, self.faults, instances, seconds, rate)

    async def _warm_up(self, session: aiohttp.ClientSession, router: str) -> float:
        """Send the warm-up mix eight at a time: requests a second, flat out. Every
        warm-up request must succeed: a deployment that cannot serve is no soak."""
        s = self.settings
        shapes = mix.mix(s.warm_up, s.seed + 1, s.max_model_len, disconnect_share=0.0)
        gate = asyncio.Semaphore(WARM_UP_CONCURRENCY)

        async def one(shape: mix.Shape) -> Record:
            async with gate:
                return await send(session, router, shape, s.deadline_s, self.clock)

        started = time.monotonic()
        records = await asyncio.gather(*(one(shape) for shape in shapes))
        _all_answered(records, "warm-up")
        return len(records) / (time.monotonic() - started)

    async def _settle(self, session: aiohttp.ClientSession, router: str, rate: float) -> None:
        """Serve the mix at the run's rate, without faults, until every instance's RSS
        has levelled off or `settle_max_s` ran out: the level a leak is judged against.
        Every request must be answered."""
        s = self.settings
        if s.settle_max_s <= 0:
            return
        count = int(rate * s.settle_max_s * 1.5) + 8  # more than the longest settling needs
        shapes = mix.mix(count, s.seed + 2, s.max_model_len, disconnect_share=0.0)
        send_at = load.arrivals(count, rate, s.seed + 2)
        start, settled = time.monotonic(), asyncio.Event()

        async def one(shape: mix.Shape, at: float) -> Record | None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(settled.wait(), max(0.0, start + at - time.monotonic()))
            if settled.is_set():
                return None  # not sent: settling ended before its arrival time
            return await send(session, router, shape, s.deadline_s, self.clock)

        pairs = zip(shapes, send_at, strict=True)
        sending = [asyncio.ensure_future(one(shape, at)) for shape, at in pairs]
        while time.monotonic() - start < s.settle_max_s:
            await self._sample("settle")  # the only footprints so far
            if levelled(self.footprints, self.prefill + self.decode):
                break
            await asyncio.sleep(SAMPLE_S)
        settled.set()
        records = await asyncio.gather(*sending)
        _all_answered([r for r in records if r is not None], "settling")

    async def _load(
        self,
        session: aiohttp.ClientSession,
        router: str,
        shapes: list[mix.Shape],
        rate: float,
        faults: bool = True,
        least: int | None = None,
    ) -> int:
        """Requests at their arrival times, faults meanwhile (unless not `faults`). The
        first `least` (all by default) are sent whatever happens; past them the load
        ends once the faults are over, so each of --max-faults comes under load however
        long the restarts before it took. Back once every request sent has ended and
        the fault in progress (if any) is over; how many were sent."""
        s = self.settings
        done = asyncio.Event()  # the load is over: no fault begins after it
        faults_over = asyncio.Event()
        injecting = asyncio.ensure_future(self._inject(done) if faults else asyncio.sleep(0))
        injecting.add_done_callback(lambda _: faults_over.set())
        showing = asyncio.ensure_future(self._progress(s.requests + s.recovery))
        sampling = asyncio.ensure_future(self._sample_footprints())

        async def one(index: int) -> None:
            self._sent += 1
            answer = send(session, router, shapes[index], s.deadline_s, self.clock)
            self.records.append(await answer)

        try:
            least = len(shapes) if least is None else least
            sent = await load.paced(len(shapes), rate, s.seed, one, least, faults_over)
        finally:
            done.set()
            await injecting
            showing.cancel()
            sampling.cancel()
        self.records.sort(key=lambda r: r.index)
        return sent

    async def _sample_footprints(self) -> None:
        """Each instance's RSS and open files every SAMPLE_S through the run: whether
        growth levels off (allocators reaching their high-water mark) or keeps climbing
        (a leak)."""
        while True:
            await self._sample("run")
            await asyncio.sleep(SAMPLE_S)

    async def _sample(self, phase: str) -> dict[str, Any]:
        """Every instance's RSS (MiB) and open files now, kept for footprints.jsonl."""
        names = self.prefill + self.decode
        sample = {name: await asyncio.to_thread(self._footprint, name) for name in names}
        self.footprints.append({"t": round(self.clock(), 1), "phase": phase, **sample})
        return self.footprints[-1]

    async def _inject(self, done: asyncio.Event) -> None:
        s = self.settings
        if s.fault_interval_s <= 0:
            return
        injector = faultlib.Injector(self.cluster, s.stop_seconds, self.clock)
        members = membership_faults.Injector(
            self.cluster, self.router, {"prefill": self.prefill, "decode": self.decode},
            self._configure, self.clock, lambda: self._sent, s.stop_seconds, s.router_timeout_s,
        )  # fmt: skip
        pick = faultlib.schedule(s.faults, self.prefill, self.decode, s.seed)
        while s.max_faults is None or len(self.faults) < s.max_faults:
            try:
                await asyncio.wait_for(done.wait(), s.fault_interval_s)
                return  # the load is over
            except asyncio.TimeoutError:
                pass
            kind, target = pick(len(self.faults))
            fault = faultlib.Fault(len(self.faults) + 1, kind, target, self.clock())
            self.faults.append(fault)
            self._now_fault = f"{kind} {target}"
            await (members if membership_faults.handles(kind) else injector).inject(fault)
            self._now_fault = ""
            self._log_fault(fault)

    def _log_fault(self, fault: faultlib.Fault) -> None:
        line = fault.line()
        self.fault_log.append(line)
        if fault.skipped:  # loudly: a soak that could not inject a fault proved less
            print(f"kvpush bench soak: FAULT SKIPPED {line}", file=sys.stderr)

    async def _progress(self, total: int) -> None:
        steps = Progress("kvpush bench soak", "requests ended", total, counting_done=True)
        try:
            while True:
                # A bar redraws in place; a log gets a line every 15 s.
                await asyncio.sleep(1.0 if steps.is_bar else 15.0)
                counts = Counter(r.outcome for r in self.records)
                what = (
                    f"sent {self._sent} (ok {counts[OK]}, failed {counts[FAILED]}, "
                    f"disconnected {counts[DISCONNECTED]}, hung {counts[HUNG]}), "
                    f"faults {len(self.faults)}"
                    + (f", now: {self._now_fault}" if self._now_fault else "")
                )
                steps.show(what, done=len(self.records))
        finally:
            steps.close()

    def _say(self, text: str) -> None:
        print(f"kvpush bench soak: {text}", file=sys.stderr, flush=True)

    def _quiesce(self) -> dict[str, dict[str, Any]]:
        """Each kvpush instance's /kvpush/state once all are quiet, or as they are when
        `quiesce_s` runs out."""
        names = self.prefill + self.decode
        deadline = time.monotonic() + self.settings.quiesce_s
        while True:
            states = {name: faultlib.instance_state(self.cluster, name) for name in names}
            quiet = all("error" not in st and not any(st.values()) for st in states.values())
            if quiet or time.monotonic() > deadline:
                return states
            time.sleep(0.5)

    def _footprint(self, name: str) -> tuple[float, int]:
        process = self.cluster.servers[name].process
        if process is None:
            return 0.0, 0
        rss, fds = tree_footprint(process.pid)
        return round(rss / 2**20, 1), fds

    def _instance(self, name: str, states: dict[str, dict]) -> Instance:
        role, peers = ("prefill", self.prefill) if name in self.prefill else ("decode", self.decode)
        # One added during the run is held to the highest level its role settled at.
        settled = self._baseline.get(name) or max(
            self._baseline[n] for n in peers if n in self._baseline
        )
        (rss0, fds0), (rss1, fds1) = settled, self._footprint(name)
        restarts = sum(1 for f in self.faults if f.target == name and f.kind.startswith("kill"))
        return Instance(name, role, restarts, states[name], (rss0, rss1), (fds0, fds1))

    async def _reference(
        self, session: aiohttp.ClientSession, shapes: list[mix.Shape]
    ) -> dict[int, list[str] | None]:
        """The plain instance's answer to each deterministic request that was answered,
        eight at a time; None where it failed too."""
        url = self.cluster.servers[PLAIN].url
        answered = {r.index for r in self.records if r.outcome == OK}
        wanted = spread([s for s in shapes if s.deterministic and s.index in answered],
                        self.settings.compare)  # fmt: skip
        # Greedy requests eight at a time, then seeded ones alone: vLLM's CPU build
        # dies on a seeded prompt that a step budget shared with other requests splits
        # into chunks ("CPU Generator does not use offset"); alone, a prompt up to the
        # context limit fits one step.
        answers: dict[int, list[str] | None] = {}
        for seeded, at_once in ((False, 8), (True, 1)):
            gate = asyncio.Semaphore(at_once)

            async def one(shape: mix.Shape, gate: asyncio.Semaphore = gate) -> None:
                async with gate:
                    outcome, _, _, _, answer = await exchange(session, url, shape)
                    answers[shape.index] = answer if outcome == OK else None

            chosen = [s for s in wanted if ("seed" in s.body) == seeded]
            await asyncio.gather(*(one(shape) for shape in chosen))
        return answers

    def _keep_logs(self, workdir: Path) -> None:
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        for path in workdir.glob("*.log"):
            shutil.copy(path, logs / path.name)
        for path in workdir.glob("*/server.log"):
            shutil.copy(path, logs / f"{path.parent.name}.log")

    def _write(self, summary: dict[str, Any]) -> None:
        with (self.out / "requests.jsonl").open("w") as lines:
            for record in self.records:
                lines.write(record.as_json() + "\n")
            lines.write(json.dumps(summary) + "\n")
        (self.out / "table.md").write_text(markdown(summary))
        (self.out / "faults.log").write_text("\n".join(self.fault_log) + "\n")
        with (self.out / "footprints.jsonl").open("w") as lines:
            for sample in self.footprints:
                lines.write(json.dumps(sample) + "\n")


def main(settings: Settings, out: Path) -> int:
    summary = Soak(settings, out).run()
    print(markdown(summary))
    print(f"kvpush bench soak: results in {out}", file=sys.stderr)
    return 0 if summary["passed"] else 1
