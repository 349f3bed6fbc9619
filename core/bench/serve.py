"""`kvpush bench serve`: the end-to-end benchmark on real vLLM, the one to decide by.

Each configuration runs in turn on the same machine, model and seeded prompts:

  plain      one vLLM instance, no connector (the baseline every ratio is against)
  push       kvpush prefill + decode behind `kvpush router`, push mode
  pull       the same in pull mode
  push-decode-first
             push, the router run with --no-first-token: a streaming client's first
             token is decode's, not the prefill leg's (docs/routing.md, 3a)
  prefill-alone
             a kvpush prefill instance asked directly, no router, no decode, no
             transfer: the floor of push's TTFT (the prefill leg computes the first
             token), so a run shows what the router and the second instance add.
             Only when asked for by --configs
  upstream   vLLM's own NixlConnector prefill + decode, driven the way its toy proxy
             drives them (prefill first, then decode with the prefill's answer)
  upstream-push
             vLLM's own NixlPushConnector (where the installed vLLM has it), both
             legs at once: decode names prefill's engine and side channel up front,
             and both legs share an X-Request-Id, which is how its prefill pairs them

Each configuration is measured in each placement: "colocated" (servers share the
cores; only vLLM's compute threads are bound: prefill and plain to --prefill-cpus,
decode to --decode-cpus) and then "pinned" (every thread of each server's process
tree bound to its CPUs, as separate hosts would be). Each cell of the grid — prompt
length x request rate — sends Poisson arrivals of fresh greedy prompts and records
TTFT, TPOT and ITL percentiles, goodput under the SLO, failures, outputs that differ
from the plain instance's, and each server tree's CPU (and the router's) while idle
and under load.

Each cell also records the time to the second token (T2T) and every request's TTFT,
and, on kvpush instances, the spans of where the time went (kvpush.vllm.spans).

Results in --out: JSON lines (results.jsonl, and stdout with --json), each cell's
per-request traces (traces-*.json) and every server's log (logs/; bench/kept.py), a
Markdown table (table.md) and plots, per placement: ttft-, tpot- (by rate, or bars
for one rate), where- (mean TTFT split into its spans, a stacked bar per
configuration) and ttft-cdf-<placement>.png.

One module: each configuration's deployment (plain, kvpush push and
pull, upstream's two connectors), both placements, and the cells they fill read in
the order a run takes them; the load is bench/load.py's; the table, the plots and
the exit status bench/serve_report.py's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush.bench import chat, kept, load
from kvpush.bench.chat import WORKLOADS
from kvpush.bench.cpu import parse_cpus, pin_tree, tree_cpu_seconds
from kvpush.bench.report import Report
from kvpush.errors import KVPushError

CONFIGS = ("plain", "push", "pull", "upstream", "upstream-push", "push-decode-first",
           "prefill-alone")  # fmt: skip
# A diagnostic, not a way to serve: in the grid only when named.
ON_REQUEST = ("prefill-alone",)
# Where the client's first token is decode's: its TTFT includes the hand-off.
DECODE_FIRST = ("upstream", "upstream-push", "push-decode-first")
UPSTREAM = ("upstream", "upstream-push")
UPSTREAM_PREFILL_ENGINE = "bench-prefill"  # pinned, so decode legs can name it up front
IDLE_SETTLE_S = 2.0
PLACEMENTS = ("colocated", "pinned")


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (1024, 3072)
    rates: tuple[float, ...] = (1.0, 8.0)
    requests: int = 24
    output_tokens: int = 16
    configs: tuple[str, ...] = field(default_factory=lambda: default_configs())  # below
    placements: tuple[str, ...] = PLACEMENTS
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    model: Path | None = None  # None: the tiny model, built on the spot
    vllm_args: tuple[str, ...] = ()
    kv_extra: dict[str, Any] = field(default_factory=dict)  # more kvpush connector settings
    attach: dict[str, str] = field(default_factory=dict)  # config -> URL already serving
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    idle_seconds: float = 3.0
    seed: int = 0
    request_timeout_s: float = 120.0  # a request not answered by then failed (upstream hangs)
    workload: str = "fresh"  # "chat": kvpush.bench.chat's mix, its long prompts the length
    router_args: tuple[str, ...] = ()  # more `kvpush router` flags (push, pull)
    fleet: tuple[str, ...] = ()  # fleet shapes, e.g. "1p2d": bench/fleet.py's run instead
    rounds: int = 1  # with fleet: each cell's trace in this many parts, configurations taking turns

    def __post_init__(self) -> None:
        if self.fleet:  # its own configurations, checked there
            from kvpush.bench import fleet

            return fleet.check(self)
        if self.rounds != 1:
            raise KVPushError("--rounds interleaves the configurations of --fleet: give both")
        unknown = sorted(set(self.configs) - set(CONFIGS))
        if unknown:
            raise KVPushError(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
        unknown = sorted(set(self.placements) - set(PLACEMENTS))
        if unknown:
            raise KVPushError(f"unknown placement(s) {unknown}; known: {list(PLACEMENTS)}")
        if self.requests < 1 or not self.lengths or not self.rates:
            raise KVPushError("the grid needs at least one length, one rate and one request")
        if "upstream-push" in self.configs and not upstream_push_available():
            raise KVPushError(
                "upstream-push needs vLLM's NixlPushConnector, which the installed vLLM "
                "lacks; leave it out of --configs"
            )
        if self.workload not in WORKLOADS:
            raise KVPushError(f"unknown workload {self.workload!r}; known: {list(WORKLOADS)}")
        for config in self.attach:
            if config not in ("plain", "push", "pull"):
                raise KVPushError(f"--attach takes plain, push or pull, not {config!r}")


@dataclass
class Cell:
    config: str
    placement: str
    prompt_len: int
    rate: float
    requests: int
    failures: int
    mismatches: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    goodput_rps: float
    seconds: float
    cpu_idle_cores: dict[str, float]
    cpu_load_cores: dict[str, float]
    errors: list[str]
    # kvpush instances: where this cell's requests' time went on each (GET
    # /kvpush/spans, counted afresh every cell).
    spans: dict[str, dict] = field(default_factory=dict)
    # Time to the second token, as the streaming client saw it.
    t2t_p50_ms: float | None = None
    t2t_p90_ms: float | None = None
    t2t_p99_ms: float | None = None
    ttfts_ms: list[float] = field(default_factory=list)  # every answered request's, sorted


class Deployment:
    """One configuration's servers (and router), started or attached to."""

    def __init__(self, config: str, settings: Settings, workdir: Path, model: Path) -> None:
        from kvpush.demo.cluster import Cluster

        self.config = config
        self.settings = settings
        self.cluster = Cluster(workdir / config, model)
        self.target = load.Target("")

    def start(self) -> load.Target:
        attached = self.settings.attach.get(self.config)
        if attached:
            self.target = load.Target(attached.rstrip("/"))
            return self.target
        s = self.settings
        cluster = self.cluster
        if self.config == "plain":
            self._server("plain", None, s.prefill_cpus)
            cluster.start()
            self.target = load.Target(cluster.servers["plain"].url)
        elif self.config in ("push", "pull", "push-decode-first"):
            mode = "pull" if self.config == "pull" else "push"
            kv = {**s.kv_extra, "mode": mode}
            self._server("prefill", "kv_producer", s.prefill_cpus, **kv)
            self._server("decode", "kv_consumer", s.decode_cpus, **kv)
            cluster.start()
            flags = ("--no-first-token",) if self.config == "push-decode-first" else ()
            flags += s.router_args
            router = cluster.start_router(["prefill"], ["decode"], mode=mode, flags=flags)
            self.target = load.Target(router)
        elif self.config == "prefill-alone":
            # Requests without kv_transfer_params: vLLM serves them whole, locally,
            # with the connector loaded and idle.
            self._server("prefill", "kv_producer", s.prefill_cpus, **{**s.kv_extra, "mode": "push"})
            cluster.start()
            self.target = load.Target(cluster.servers["prefill"].url)
        elif self.config == "upstream":
            self._upstream("prefill", "kv_producer", s.prefill_cpus, "NixlConnector")
            self._upstream("decode", "kv_consumer", s.decode_cpus, "NixlConnector")
            cluster.start()
            servers = cluster.servers
            self.target = load.Target(
                servers["decode"].url, two_legs=True, prefill_url=servers["prefill"].url
            )
        else:
            side_port = self._upstream(
                "prefill", "kv_producer", s.prefill_cpus, "NixlPushConnector"
            )
            self._upstream("decode", "kv_consumer", s.decode_cpus, "NixlPushConnector")
            cluster.start()
            servers = cluster.servers
            decode_params = {
                "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
                "remote_engine_id": UPSTREAM_PREFILL_ENGINE, "remote_host": "127.0.0.1",
                "remote_port": side_port, "tp_size": 1, "remote_block_ids": [],
            }  # fmt: skip
            self.target = load.Target(
                servers["decode"].url,
                two_legs=True,
                prefill_url=servers["prefill"].url,
                concurrent_decode_params=decode_params,
            )
        return self.target

    def _server(self, name: str, role: str | None, cpus: str, **kv: Any) -> None:
        server = self.cluster.add_server(name, role, core=cpus, **kv)
        self._fit(server)

    def _upstream(self, name: str, role: str, cpus: str, connector: str) -> int:
        """An instance with one of vLLM's own NIXL connectors: its side-channel port."""
        from kvpush.ports import free_port

        server = self.cluster.add_server(name, None, core=cpus)
        server.spec.kv_transfer_config = {
            "kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
        }  # fmt: skip
        if role == "kv_producer":
            server.spec.kv_transfer_config["engine_id"] = UPSTREAM_PREFILL_ENGINE
        port = free_port()
        server.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        self._fit(server)
        return port

    def _fit(self, server) -> None:
        longest = max(self.settings.lengths) + self.settings.output_tokens
        server.spec.max_model_len = max(2048, -(-longest // 1024) * 1024)
        server.spec.extra_args = list(self.settings.vllm_args)

    def pids(self) -> dict[str, int]:
        """Server name -> the pid at the root of its process tree (none when attached)."""
        return {
            name: server.process.pid
            for name, server in self.cluster.servers.items()
            if server.process is not None
        }

    def pin(self) -> None:
        cpus = {"prefill": self.settings.prefill_cpus, "plain": self.settings.prefill_cpus,
                "decode": self.settings.decode_cpus}  # fmt: skip
        for name, pid in self.pids().items():
            pin_tree(pid, parse_cpus(cpus[name]))

    def spans(self) -> dict[str, dict]:
        """Each kvpush instance's per-phase summary, where it serves one."""
        return self._ask_each("/kvpush/spans?reset=1", routers=False)

    def traces(self, last: int) -> dict[str, Any]:
        """The last `last` requests' traces (milestones per request) of each kvpush
        instance and router: the cell's outliers, explained afterwards."""
        return self._ask_each(f"/kvpush/trace?last={last}", routers=True)

    def _ask_each(self, path: str, routers: bool) -> dict[str, Any]:
        """GET `path` of each kvpush instance's identity port (and each router's): the
        JSON answers by name, leaving out any that does not answer."""
        urls = {name: self.cluster.identity_url(name) for name in self.cluster.identity_ports}
        if routers:
            urls |= {name: url for name, (_, url) in self.cluster.routers.items()}
        answers = {name: load.get_json(url + path) for name, url in urls.items()}
        return {name: answer for name, answer in answers.items() if answer is not None}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each server's process tree and of each router's."""
        pids = self.pids() | {
            name: router.pid for name, (router, _) in self.cluster.routers.items()
        }
        return {name: tree_cpu_seconds(pid) for name, pid in pids.items()}

    def stop(self) -> None:
        self.cluster.stop()


def _cores(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {name: round((after[name] - before[name]) / seconds, 3) for name in after}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def summarize(
    config: str, placement: str, length: int, rate: float, outcomes: list[load.Outcome],
    expected: list[list[int]] | None, seconds: float, settings: Settings,
    idle: dict[str, float], busy: dict[str, float],
) -> Cell:  # fmt: skip
    """One cell from its requests' outcomes (and the plain instance's token ids)."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok]
    tpots = [t for o in ok if (t := o.tpot) is not None]
    itls = [gap for o in ok for gap in o.itls]
    t2ts = [t for o in ok if (t := o.t2t) is not None]
    mismatches = 0
    if expected is not None:
        mismatches = sum(
            1 for o, want in zip(outcomes, expected, strict=True) if o.ok and o.token_ids != want
        )
    good = sum(
        1
        for o in ok
        if o.ttft * 1e3 <= settings.slo_ttft_ms and (o.tpot or 0) * 1e3 <= settings.slo_tpot_ms
    )
    t2t_p50, t2t_p90, t2t_p99 = (_ms(load.percentile(t2ts, q)) for q in (50, 90, 99))
    return Cell(
        config, placement, length, rate, len(outcomes), len(outcomes) - len(ok), mismatches,
        *(_ms(load.percentile(ttfts, q)) for q in (50, 90, 99)),
        *(_ms(load.percentile(tpots, q)) for q in (50, 90, 99)),
        *(_ms(load.percentile(itls, q)) for q in (50, 90, 99)),
        round(good / seconds, 3) if seconds else 0.0, round(seconds, 2), idle, busy,
        [o.error[:300] for o in outcomes if not o.ok][:3],
        t2t_p50_ms=t2t_p50, t2t_p90_ms=t2t_p90, t2t_p99_ms=t2t_p99,
        ttfts_ms=sorted(round(t * 1e3, 1) for t in ttfts),
    )  # fmt: skip


# A disaggregated request's first token, from the client's send to its arrival, in
# the order its time passes: (label, the span whose mean it is). What the
# spans do not cover -- decode's first step, the router and HTTP both ways -- is the
# rest of the client's TTFT. Where the first token comes from the prefill leg, its
# time is prefill's and the router's only.
TIME_GOES = (
    ("prefill queue", "prefill.queued"),
    ("prefill compute", "prefill.compute"),
    ("hand-off", "decode.handoff"),
    ("report", "decode.report"),
    ("resume", "decode.resume"),
)
PREFILL_ONLY = 2  # the first two of TIME_GOES
REST = "decode step, router, HTTP"
REST_FROM_PREFILL = "router, HTTP"


def where_time_goes(cell: Cell) -> dict[str, float]:
    """The cell's mean TTFT (ms) split into the spans' means and the rest, in order.
    Means, not percentiles, so the parts add up; a configuration without kvpush's
    spans (plain, upstream) is one part. Empty when nothing was answered."""
    if not cell.ttfts_ms:
        return {}
    mean = sum(cell.ttfts_ms) / len(cell.ttfts_ms)
    spans = {key: phase for summary in cell.spans.values() for key, phase in summary.items()}
    decode_first = cell.config in DECODE_FIRST
    chain = TIME_GOES if decode_first else TIME_GOES[:PREFILL_ONLY]
    parts = {label: spans[key]["mean_ms"] for label, key in chain if key in spans}
    if not parts:
        return {cell.config: round(mean, 2)}
    # Span means cover requests that reached every milestone; the client's covers all
    # it got an answer for. On a machine this noisy they can disagree by a little.
    parts[REST if decode_first else REST_FROM_PREFILL] = max(0.0, mean - sum(parts.values()))
    return {label: round(ms, 2) for label, ms in parts.items()}


class Bench:
    """Runs the grid over every configuration and placement; results go to `out`."""

    def __init__(self, settings: Settings, out: Path, report: Report) -> None:
        self.settings = settings
        self.out = out
        self.report = report
        self.expected: dict[tuple[str, int, float], list[list[int]]] = {}

    def run(self) -> list[Cell]:
        from kvpush.demo.tinymodel import cached_tiny_model

        self.out.mkdir(parents=True, exist_ok=True)
        model = self.settings.model or cached_tiny_model()
        workdir = Path(tempfile.mkdtemp(prefix="kvpush-bench-serve-"))
        lines = (self.out / "results.jsonl").open("w")
        try:
            for config in self._runs():
                for cell in self._configuration(config, workdir, model):
                    lines.write(json.dumps(asdict(cell)) + "\n")
                    lines.flush()
        finally:
            lines.close()
            kept.keep_logs(workdir, self.out)
            shutil.rmtree(workdir, ignore_errors=True)
        return self.report.results

    def _configuration(self, config: str, workdir: Path, model: Path) -> list[Cell]:
        deployment = self._deployment(config, workdir, model)
        cells: list[Cell] = []
        try:
            self.report.step(f"{config}: starting")
            target = deployment.start()
            broken = self._warm_up(target)
            for placement in self._placements():
                if broken:
                    cells += self._unserved(config, placement, broken)
                    continue
                if placement == "pinned":
                    if not deployment.pids():
                        # attached: its placement is not ours to change
                        self.report.progress.drop(
                            len(self.settings.lengths) * len(self.settings.rates)
                        )
                        continue
                    deployment.pin()
                self._enter(placement)
                idle = self._idle_cpu(deployment)
                for length in self.settings.lengths:
                    for rate in self.settings.rates:
                        self.report.step(f"{config} {placement} {length} tok {rate:g}/s")
                        cell = self._cell(deployment, target, placement, length, rate, idle)
                        self.report.add(cell)
                        cells.append(cell)
        finally:
            deployment.stop()
        return cells

    # Where a variant (bench/across_serve.py, bench/fleet.py) runs the configurations instead:

    def _runs(self) -> list[str]:
        """What the run starts in turn: the plain instance first, its answers the oracle."""
        return sorted(self.settings.configs, key=lambda c: c != "plain")

    def _deployment(self, config: str, workdir: Path, model: Path) -> Deployment:
        return Deployment(config, self.settings, workdir, model)

    def _placements(self) -> tuple[str, ...]:
        return self.settings.placements

    def _enter(self, placement: str) -> None:
        """Set the machine up for `placement`'s cells (pinning is the deployment's)."""

    def _warm_up(self, target: load.Target) -> str:
        """First requests pay for connections and caches: not part of any cell. Why
        the configuration cannot serve, if it cannot ("": it can)."""
        s = self.settings
        for length in s.lengths:
            batch = load.prompts(2, length, seed=s.seed + 999_999 + length)
            outcomes = asyncio.run(
                load.run(target, batch, [0.0, 0.1], s.output_tokens, s.request_timeout_s)
            )
            failed = [o.error for o in outcomes if not o.ok]
            if failed:
                return f"warm-up at {length} tokens failed: {failed[0][:200]}"
        return ""

    def _unserved(self, config: str, placement: str, why: str) -> list[Cell]:
        """The cells of a configuration that could not serve its warm-up: every
        request failed, none sent (each would only wait out its timeout)."""
        s = self.settings
        cells = []
        for length in s.lengths:
            for rate in s.rates:
                outcomes = [load.Outcome(False, error=why)] * s.requests
                cell = summarize(config, placement, length, rate, outcomes, None, 0.0, s, {}, {})
                self.report.add(cell)
                cells.append(cell)
        return cells

    def _idle_cpu(self, deployment: Deployment) -> dict[str, float]:
        # vLLM's workers spin for a second after their last step (their step queue's
        # busy loop): idle starts after that.
        time.sleep(IDLE_SETTLE_S)
        before = deployment.cpu_seconds()
        time.sleep(self.settings.idle_seconds)
        return _cores(before, deployment.cpu_seconds(), self.settings.idle_seconds)

    def _cell(
        self, deployment: Deployment, target: load.Target, placement: str, length: int,
        rate: float, idle: dict[str, float],
    ) -> Cell:  # fmt: skip
        s = self.settings
        # Fresh prompts per placement (a prefix cache must not serve the second one),
        # the same across configurations (so answers compare).
        number = (*PLACEMENTS, *self._placements()).index(placement)
        seed = s.seed + number * 1_000_003 + length * 101 + int(rate * 1000)
        if s.workload == "chat":
            batch, send_at = chat.batch(s.requests, rate, seed, length)
        else:
            batch = load.prompts(s.requests, length, seed)
            send_at = load.arrivals(s.requests, rate, seed)
        deployment.spans()  # start this cell's span counts afresh
        before = deployment.cpu_seconds()
        started, wall_start = time.monotonic(), time.time()
        outcomes = asyncio.run(
            load.run(target, batch, send_at, s.output_tokens, s.request_timeout_s)
        )
        seconds = time.monotonic() - started
        busy = _cores(before, deployment.cpu_seconds(), seconds)
        key = (placement, length, rate)
        if deployment.config == "plain":
            self.expected[key] = [o.token_ids for o in outcomes]
        cell = summarize(
            deployment.config, placement, length, rate, outcomes, self.expected.get(key),
            seconds, s, idle, busy,
        )  # fmt: skip
        cell.spans = deployment.spans()
        name = f"traces-{placement}-{deployment.config}-{length}-{rate:g}.json"
        traces = deployment.traces(s.requests)
        kept.write_traces(self.out / name, traces, outcomes, send_at, wall_start)
        return cell


def markdown(cells: list[Cell]) -> str:
    """The results as a Markdown table, with each TTFT p50 as a ratio to plain's."""
    plain = {(c.placement, c.prompt_len, c.rate): c.ttft_p50_ms for c in cells
             if c.config == "plain"}  # fmt: skip
    rows = [
        "| placement | prompt | rate /s | config | TTFT p50 ms | x plain | TTFT p90 | TTFT p99 "
        "| T2T p50 ms | T2T p90 | TPOT p50 ms | TPOT p99 | ITL p99 | goodput /s | failed "
        "| mismatched | CPU idle | CPU load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(cells, key=lambda c: (c.placement, c.prompt_len, c.rate, c.config)):
        base = plain.get((c.placement, c.prompt_len, c.rate))
        ratio = f"{c.ttft_p50_ms / base:.2f}" if base and c.ttft_p50_ms else "—"
        rows.append(
            f"| {c.placement} | {c.prompt_len} | {c.rate:g} | {c.config} | {_f(c.ttft_p50_ms)} "
            f"| {ratio} | {_f(c.ttft_p90_ms)} | {_f(c.ttft_p99_ms)} | {_f(c.t2t_p50_ms)} "
            f"| {_f(c.t2t_p90_ms)} | {_f(c.tpot_p50_ms)} "
            f"| {_f(c.tpot_p99_ms)} | {_f(c.itl_p99_ms)} | {c.goodput_rps:g} | {c.failures} "
            f"| {c.mismatches} | {_cpu(c.cpu_idle_cores)} | {_cpu(c.cpu_load_cores)} |"
        )
    return "\n".join(rows) + "\n"


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _cpu(cores: dict[str, float]) -> str:
    return " ".join(f"{name} {value:.2f}" for name, value in sorted(cores.items())) or "—"


def cell_count(settings: Settings) -> int:
    s = settings
    return len(s.configs) * len(s.placements) * len(s.lengths) * len(s.rates)


def upstream_push_available() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPushConnector  # noqa: F401
    except ImportError:
        return False
    return True


def default_configs() -> tuple[str, ...]:
    """Every configuration the installed vLLM can run, but those run only on request."""
    return tuple(
        c for c in CONFIGS
        if c not in ON_REQUEST and (c != "upstream-push" or upstream_push_available())
    )  # fmt: skip


def parse_list(text: str, kind: Callable[[str], float]) -> tuple:
    return tuple(kind(part) for part in text.split(",") if part.strip())
