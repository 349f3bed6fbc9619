"""`kvpush bench serve --fleet 1p2d,2p2d`: a fleet of kvpush instances behind
`kvpush router`, routed three ways over the SAME instances:

  rr-aggregated  every instance serves whole requests, none disaggregated: the router
                 with `--disaggregate never` and every instance, prefill ones too,
                 listed as a decode instance (least loaded, ties round robin). The
                 router's hop stays in, so the three differ only in how they route.
  disagg-all     every request disaggregated (`--disaggregate always`), placed as
                 `kvpush router` places by default.
  decide         the router's own decisions and pair placement, a request not
                 disaggregated run whole on the best instance of either role
                 (`--disaggregate auto --placement prefix --aggregate-on prefill,decode`).

A fleet's engines start once and serve every configuration; the configurations of a
cell run back to back (with --rounds N, taking turns on N parts of its requests), each
from a fresh router and with every prefix cache emptied (vLLM's `POST /reset_prefix_cache`,
served in its dev mode), so no configuration finds what another left. Placements are
serve.py's: colocated, then pinned (every prefill instance's tree on --prefill-cpus,
every decode instance's on --decode-cpus).

Beyond serve.py's cell, each records decode's prefix-cache hit ratio (vLLM's
`vllm:prefix_cache_hits`/`queries` counters, summed over the instances that ran
decodes, counted over the cell: every instance for rr-aggregated and decide, whose
prefill instances run whole requests too, less what they looked up for prefill legs,
`vllm:kvpush_prefill_leg_prefix_tokens_total`), the best ratio the cell's trace allows
(one cache that saw every earlier request: `best_hits`), and the router's
decisions by reason (`kvpush_router_decisions_total`) with where whole requests
ran (`kvpush_router_whole_requests_total`, by role). The first configuration's
answers are the oracle the others' must match token for token.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpush.bench import chat, kept, load, serve_report
from kvpush.bench.cpu import parse_cpus, pin_tree
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.bench.serve import Bench, Cell, Deployment, Settings, summarize
from kvpush.errors import KVPushError
from kvpush.metrics import samples

CONFIGS = ("rr-aggregated", "disagg-all", "decide")
ROUTER_FLAGS = {
    "rr-aggregated": ("--disaggregate", "never"),
    "disagg-all": ("--disaggregate", "always"),
    "decide": ("--disaggregate", "auto", "--placement", "prefix",
               "--aggregate-on", "prefill,decode"),
}  # fmt: skip
DEFAULT_BLOCK_SIZE = 16  # when no instance says its own
_SHAPE = re.compile(r"(\d+)p(\d+)d")


def shape(name: str) -> tuple[int, int]:
    """ "1p2d" -> (1 prefill, 2 decode instances)."""
    found = _SHAPE.fullmatch(name.strip().lower())
    if not found or min(int(found[1]), int(found[2])) < 1:
        raise KVPushError(f"a fleet is NpMd with N, M >= 1 (e.g. 1p2d), not {name!r}")
    return int(found[1]), int(found[2])


def check(settings: Settings) -> None:
    """What a fleet run cannot take, named."""
    for name in settings.fleet:
        shape(name)
    unknown = sorted(set(settings.configs) - set(CONFIGS))
    if unknown:
        raise KVPushError(f"with --fleet, --configs takes {list(CONFIGS)}, not {unknown}")
    if settings.attach:
        raise KVPushError("--fleet starts its own instances: it takes no --attach")
    if settings.rounds > settings.requests:
        raise KVPushError(f"--rounds {settings.rounds} splits --requests {settings.requests} "
                          "into parts of one request at least: give fewer rounds")  # fmt: skip


@dataclass
class FleetCell(Cell):
    fleet: str = ""
    prefix_hits: int = 0  # decode instances' prefix-cache hits over the cell, in tokens
    prefix_queries: int = 0
    best_hit_ratio: float | None = None
    decisions: dict[str, int] = field(default_factory=dict)  # "path/reason" -> count

    @property
    def hit_ratio(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


def prefix_counters(metrics_text: str) -> tuple[int, int]:
    """(hits, queries) of vLLM's prefix cache, summed over its engines, for the requests
    the instance decodes: less its prefill legs' lookups, which kvpush counts apart."""
    hits = sum(v for _, v in samples(metrics_text, "vllm:prefix_cache_hits"))
    queries = sum(v for _, v in samples(metrics_text, "vllm:prefix_cache_queries"))
    for labels, value in samples(metrics_text, "vllm:kvpush_prefill_leg_prefix_tokens"):
        if 'reason="hit"' in labels:
            hits -= value
        elif 'reason="queried"' in labels:
            queries -= value
    return int(hits), int(queries)


def decision_counts(metrics_text: str) -> dict[str, int]:
    """kvpush_router_decisions_total by "path/reason", and whole requests by the role
    of the instance that ran them, "whole_on/role"."""
    counts: dict[str, int] = {}
    keys = {
        "kvpush_router_decisions": lambda said: f"{said.get('path')}/{said.get('reason')}",
        "kvpush_router_whole_requests": lambda said: f"whole_on/{said.get('role')}",
    }
    for name, key_of in keys.items():
        for labels, value in samples(metrics_text, name):
            key = key_of(dict(re.findall(r'(\w+)="([^"]*)"', labels)))
            counts[key] = counts.get(key, 0) + int(value)
    return counts


def best_hits(prompts: list[list[int]], block_size: int, rounds: int = 1) -> tuple[int, int]:
    """(hits, prompt tokens) of one cache that kept every earlier prompt of its part
    (parts(): the caches are emptied before each of `rounds`): each prompt hits its
    longest prefix shared with an earlier one, in whole blocks and short of its last
    token (vLLM computes at least one)."""
    hits = 0
    for start, end in parts(len(prompts), rounds):
        part = prompts[start:end]
        for i, prompt in enumerate(part):
            shared = max((_common(prompt, earlier) for earlier in part[:i]), default=0)
            hits += min(shared, len(prompt) - 1) // block_size * block_size
    return hits, sum(len(p) for p in prompts)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


class FleetDeployment(Deployment):
    """A fleet's instances, started once, and the router in front, one per cell."""

    def __init__(self, name: str, settings: Settings, workdir: Path, model: Path) -> None:
        super().__init__(name, settings, workdir, model)
        self.prefills, self.decodes = shape(name)

    def start(self) -> load.Target:
        s = self.settings
        kv = {**s.kv_extra, "mode": "push"}
        roles = (("prefill", self.prefills, s.prefill_cpus, "kv_producer"),
                 ("decode", self.decodes, s.decode_cpus, "kv_consumer"))  # fmt: skip
        for role, count, cpus, kv_role in roles:
            for i in range(count):
                server = self.cluster.add_server(f"{role}{i}", kv_role, core=cpus, **kv)
                self._fit(server)
                server.spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
        self.cluster.start()
        return self.target

    def names(self, role: str) -> list[str]:
        return [n for n in self.cluster.servers if n.startswith(role)]

    def deciders(self, config: str) -> list[str]:
        """The instances that run decodes (and whole requests) under `config`."""
        return self.names("decode") if config == "disagg-all" else list(self.cluster.servers)

    def route(self, config: str) -> load.Target:
        """(Re)start the router as `config` routes; its target."""
        # rr-aggregated lists every instance as a decode one; decide reaches prefill
        # instances for whole requests through --aggregate-on instead.
        decodes = self.deciders(config) if config == "rr-aggregated" else self.names("decode")
        url = self.cluster.start_router(
            [self._spec(n) for n in self.names("prefill")], [self._spec(n) for n in decodes],
            mode="push", flags=ROUTER_FLAGS[config] + self.settings.router_args,
        )  # fmt: skip
        self.target = load.Target(url)
        return self.target

    def _spec(self, name: str) -> str:
        """The router's spec of a server, naming the cores it computes on: the
        instances of a role share theirs (every placement binds their compute there)."""
        s = self.settings
        cores = s.prefill_cpus if name.startswith("prefill") else s.decode_cpus
        return f"{self.cluster.router_spec(name)},device=cpus-{cores.replace(',', '.')}"

    def instances(self) -> list[dict[str, object]]:
        """The router's view of its instances at the cell's end (GET /instances): what it
        counted on each, and the pace it learnt."""
        return load.get_json(self.target.url + "/instances") or []

    def pin(self) -> None:
        s = self.settings
        for name, pid in self.pids().items():
            pin_tree(pid, parse_cpus(s.prefill_cpus if name.startswith("prefill")
                                     else s.decode_cpus))  # fmt: skip

    def reset_prefix_caches(self) -> None:
        for name, server in self.cluster.servers.items():
            request = urllib.request.Request(server.url + "/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status != 200:
                    raise KVPushError(f"{name}: /reset_prefix_cache answered {response.status}")

    def prefix_counters(self, names: list[str]) -> tuple[int, int]:
        pairs = [prefix_counters(_get(self.cluster.servers[n].url + "/metrics")) for n in names]
        return sum(h for h, _ in pairs), sum(q for _, q in pairs)

    def decisions(self) -> dict[str, int]:
        _, url = self.cluster.routers["router"]
        return decision_counts(_get(url + "/metrics"))

    def block_size(self) -> int:
        for answer in self._ask_each("/query", routers=False).values():
            if isinstance(answer, dict) and answer.get("block_size"):
                return int(answer["block_size"])
        return DEFAULT_BLOCK_SIZE


class FleetBench(Bench):
    """Per fleet: its instances once; per placement, cell, round and configuration, a
    fresh router over them and emptied caches."""

    def _runs(self) -> list[str]:
        return list(self.settings.fleet)

    def _configuration(self, name: str, workdir: Path, model: Path) -> list[Cell]:
        """A fleet's cells: its instances once, every configuration of a cell back to back."""
        s = self.settings
        cells: list[Cell] = []
        deployment = FleetDeployment(name, s, workdir, model)
        try:
            self.report.step(f"{name}: starting")
            deployment.start()
            block = deployment.block_size()
            for placement in s.placements:
                if placement == "pinned":
                    deployment.pin()
                for length in s.lengths:
                    for rate in s.rates:
                        for cell in self._cells(deployment, placement, length, rate, block):
                            self.report.add(cell)
                            cells.append(cell)
        finally:
            deployment.stop()
        return cells

    def _cells(self, deployment: FleetDeployment, placement: str, length: int, rate: float,
               block: int) -> list[FleetCell]:  # fmt: skip
        """Every configuration's cell at one placement, length and rate. The cell's
        requests are cut into --rounds parts in their order, and each part is served by
        every configuration in turn: a host that slows down for a minute (a neighbour's
        load, a clock that drops) then slows each configuration alike."""
        s = self.settings
        # The same requests for every configuration of a placement (answers compare).
        seed = s.seed + s.placements.index(placement) * 1_000_003 + length * 101 + int(rate * 1000)
        if s.workload == "chat":
            batch, send_at = chat.batch(s.requests, rate, seed, length)
        else:
            batch, send_at = (
                load.prompts(s.requests, length, seed),
                load.arrivals(s.requests, rate, seed),
            )
        runs = {config: _Run() for config in s.configs}
        for number, (start, end) in enumerate(parts(len(batch), s.rounds)):
            prompts = batch[start:end]
            at = [t - send_at[start] for t in send_at[start:end]]
            for config in s.configs:
                self.report.step(f"{deployment.config} {placement} {config} {length} tok "
                                 f"{rate:g}/s, round {number + 1} of {s.rounds}")  # fmt: skip
                trace = f"{deployment.config}-{placement}-{config}-{length}-{rate:g}"
                trace += f"-round{number + 1}" if s.rounds > 1 else ""
                runs[config].add(self._part(deployment, config, prompts, at, trace))
        expected = [o.token_ids for o in runs[s.configs[0]].outcomes]
        best = best_hits(batch, block, s.rounds)
        return [self._cell(run, config, deployment.config, placement, length, rate, expected,
                           best) for config, run in runs.items()]  # fmt: skip

    def _part(self, deployment: FleetDeployment, config: str, prompts: list[list[int]],
              send_at: list[float], trace: str) -> _Run:  # fmt: skip
        """One configuration serving one part of a cell's requests, from a fresh router
        and emptied prefix caches."""
        s = self.settings
        target = deployment.route(config)
        broken = self._warm_up(target)
        deployment.reset_prefix_caches()
        deciders = deployment.deciders(config)
        hits0, queries0 = deployment.prefix_counters(deciders)
        decided = deployment.decisions()  # the warm-up's, not the part's
        started, wall_start = time.monotonic(), time.time()
        if broken:
            outcomes = [load.Outcome(False, error=broken)] * len(prompts)
        else:
            outcomes = asyncio.run(load.run(target, prompts, send_at, s.output_tokens,
                                            s.request_timeout_s))  # fmt: skip
        seconds = time.monotonic() - started
        hits1, queries1 = deployment.prefix_counters(deciders)
        traces = {**deployment.traces(len(prompts)), "instances": deployment.instances()}
        kept.write_traces(self.out / f"traces-{trace}.json", traces, outcomes, send_at, wall_start)
        return _Run(list(outcomes), seconds, hits1 - hits0, queries1 - queries0,
                    _less(deployment.decisions(), decided))  # fmt: skip

    def _cell(self, run: _Run, config: str, fleet: str, placement: str, length: int,
              rate: float, expected: list[list[int] | None], best: tuple[int, int],
              ) -> FleetCell:  # fmt: skip
        cell = summarize(config, placement, length, rate, run.outcomes, expected, run.seconds,
                         self.settings, {}, {})  # type: ignore[arg-type]  # fmt: skip
        hits, total = best
        return FleetCell(**asdict(cell), fleet=fleet, prefix_hits=run.hits,
                         prefix_queries=run.queries,
                         best_hit_ratio=hits / total if total else None,
                         decisions=run.decisions)  # fmt: skip


@dataclass
class _Run:
    """What one configuration's parts of a cell added up to."""

    outcomes: list[load.Outcome] = field(default_factory=list)
    seconds: float = 0.0
    hits: int = 0  # decode instances' prefix-cache hits, in tokens
    queries: int = 0
    decisions: dict[str, int] = field(default_factory=dict)

    def add(self, part: _Run) -> None:
        self.outcomes += part.outcomes
        self.seconds += part.seconds
        self.hits += part.hits
        self.queries += part.queries
        for key, count in part.decisions.items():
            self.decisions[key] = self.decisions.get(key, 0) + count


def parts(count: int, rounds: int) -> list[tuple[int, int]]:
    """[start, end) of `rounds` consecutive parts of `count` requests, as even as they
    divide (the earlier parts one longer)."""
    size, extra = divmod(count, rounds)
    bounds = [0]
    for number in range(rounds):
        bounds.append(bounds[-1] + size + (number < extra))
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _less(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n for k, v in after.items() if (n := v - before.get(k, 0))}


def markdown(cells: list[FleetCell]) -> str:
    """A row per cell: TTFT p50/p99 (and p50 over rr-aggregated's), decode's prefix
    hits against the trace's best, and the router's decisions."""
    base = {(c.fleet, c.placement, c.prompt_len, c.rate): c.ttft_p50_ms for c in cells
            if c.config == "rr-aggregated"}  # fmt: skip
    rows = ["| fleet | placement | rate /s | config | TTFT p50 ms | TTFT p99 ms | p50 ÷ rr-agg "
            "| TPOT p50 ms | failed | mismatched | decode prefix hit | best | hit ÷ best "
            "| decisions |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    order = {c: i for i, c in enumerate(CONFIGS)}
    for c in sorted(cells, key=lambda c: (c.fleet, c.placement, c.prompt_len, c.rate,
                                          order.get(c.config, 9))):  # fmt: skip
        b = base.get((c.fleet, c.placement, c.prompt_len, c.rate))
        hit = c.hit_ratio
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(c.decisions.items())) or "—"
        rows.append(
            f"| {c.fleet} | {c.placement} | {c.rate:g} | {c.config} | {_f1(c.ttft_p50_ms)} "
            f"| {_f1(c.ttft_p99_ms)} | {_ratio(c.ttft_p50_ms, b)} | {_f(c.tpot_p50_ms)} "
            f"| {c.failures} | {c.mismatches} | {_pct(hit)} | {_pct(c.best_hit_ratio)} "
            f"| {_ratio(hit, c.best_hit_ratio)} | {decisions} |"
        )
    return "\n".join(rows) + "\n"


def verdicts(cells: list[FleetCell]) -> list[str]:
    """Issue 44's targets, per fleet and placement: decide beats the other two on
    TTFT p50 and p99 at every rate; at the lowest rate its p50 is within 1.10x
    rr-aggregated's; its decode prefix hits are >= 80 % of the trace's best."""
    lines = []
    groups = sorted({(c.fleet, c.placement, c.prompt_len) for c in cells})
    for fleet, placement, length in groups:
        here = [
            c for c in cells if (c.fleet, c.placement, c.prompt_len) == (fleet, placement, length)
        ]
        rates = sorted({c.rate for c in here})
        by = {(c.config, c.rate): c for c in here}
        for rate in rates:
            mine = by.get(("decide", rate))
            if mine is None:
                continue
            for other in ("disagg-all", "rr-aggregated"):
                theirs = by.get((other, rate))
                if theirs is None:
                    continue
                for q in ("p50", "p99"):
                    a, b = getattr(mine, f"ttft_{q}_ms"), getattr(theirs, f"ttft_{q}_ms")
                    ok = a is not None and b is not None and a < b
                    lines.append(f"{_mark(ok)} {fleet} {placement} {rate:g}/s: decide TTFT {q} "
                                 f"{_f1(a)} < {other} {_f1(b)}")  # fmt: skip
            hit, best = mine.hit_ratio, mine.best_hit_ratio
            ok = hit is not None and best is not None and hit >= 0.8 * best
            lines.append(f"{_mark(ok)} {fleet} {placement} {rate:g}/s: decide's decode prefix "
                         f"hit {_pct(hit)} >= 80 % of best {_pct(best)}")  # fmt: skip
        low, agg = by.get(("decide", rates[0])), by.get(("rr-aggregated", rates[0]))
        if low and agg and low.ttft_p50_ms and agg.ttft_p50_ms:
            ratio = low.ttft_p50_ms / agg.ttft_p50_ms
            lines.append(f"{_mark(ratio <= 1.10)} {fleet} {placement} {rates[0]:g}/s: decide "
                         f"TTFT p50 {ratio:.2f}x rr-aggregated's (<= 1.10)")  # fmt: skip
    return lines


def plots(cells: list[FleetCell], out: Path) -> list[Path]:
    """Per fleet and placement, `ttft-cdf-<fleet>-<placement>.png`: each
    configuration's TTFTs as a CDF, a panel per rate."""
    written: list[Path] = []
    for fleet in dict.fromkeys(c.fleet for c in cells):
        for placement in dict.fromkeys(c.placement for c in cells):
            mine = [c for c in cells if (c.fleet, c.placement) == (fleet, placement)]
            if mine:
                path = out / f"ttft-cdf-{fleet}-{placement}.png"
                written += serve_report.ttft_cdf(mine, path, f"{fleet} {placement}")
    return written


def _mark(ok: bool) -> str:
    return "met   " if ok else "missed"


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _f1(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f} %"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def main(settings: Settings, out: Path, as_json: bool) -> int:
    check(settings)
    count = len(settings.fleet) * len(settings.placements) * len(settings.configs) * len(
        settings.lengths) * len(settings.rates)  # fmt: skip
    report = Report(as_json, Progress("kvpush bench serve --fleet", "cell", count))
    cells = FleetBench(settings, out, report).run()
    table = markdown(cells) + "\n" + "\n".join(verdicts(cells)) + "\n"
    (out / "table.md").write_text(table)
    plots(cells, out)
    report.finish(lambda _: print(table))
    print(f"kvpush bench serve --fleet: results in {out}", file=sys.stderr)
    return 1 if sum(c.failures + c.mismatches for c in cells) else 0
