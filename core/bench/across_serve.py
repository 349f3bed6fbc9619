"""`kvpush bench serve --across-namespaces`: the end-to-end benchmark with prefill and
decode on two simulated hosts, their link capped at each `--link-rate` in turn.

Prefill (and upstream's prefill) runs in network namespace a, decode in b, joined by
one veth link (kvpush.netns); the plain instance, kvpush's router and the load run in
the root namespace, which reaches each host over a link of its own, so the
host-to-host link carries only what the two servers send each other. The servers run
with UCX held to TCP (`UCX_TLS=tcp,self`): left to choose, UCX moves the KV through
shared memory between two namespaces of one machine and no cap applies to it.

Each configuration starts once; its cells run once per link rate, the link re-capped
with tc's `tbf` before each (a "placement" of bench/serve.py named for the rate), with
fresh prompts per rate. After each configuration the run checks what UCX reported it
chose for the two servers' remote memory writes and reads (tcp on the link, nothing
else) and how many bytes the link carried against the KV its requests moved.

Without --model it runs the KV-heavy tiny model (16 KiB of KV per token, fp32), so
that moving a prompt's KV takes as long as computing it at link rates near a gigabit,
and every server computes prompts in steps of STEP_TOKENS unless `--vllm-args` sets
`--max-num-batched-tokens`. A real model's 32 to 80 layers let push send all but a
layer's share of a prompt's KV while its last step computes; the tiny model has two,
and in one step would leave half of it for after. Small steps give it that grain.
Needs root; every namespace, link and process it made is removed when it ends.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvpush.bench import across
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.bench.serve import (
    UPSTREAM,
    Bench,
    Cell,
    Deployment,
    Settings,
    markdown,
)
from kvpush.bench.serve_report import plots
from kvpush.errors import KVPushError
from kvpush.netns import TwoHosts
from kvpush.transport.ucx_report import TCP_ONLY, peer_lanes

# Where each server of a configuration runs: the others (plain) stay in the root namespace.
SIDES = {"prefill": "a", "decode": "b"}
STEP_TOKENS = 512  # the module's docstring
# Configurations that move KV between the two hosts.
MOVING = ("push", "pull", "push-decode-first", "upstream")


@dataclass(frozen=True)
class Link:
    """One link rate the cells run at: `bits` a second, or None for the bare veth."""

    bits: int | None

    @property
    def name(self) -> str:
        """As tc spells the rate: a placement's name, and part of file names."""
        if self.bits is None:
            return "link-veth"
        for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
            if self.bits >= scale:
                return f"link-{self.bits / scale:g}{unit}"
        return f"link-{self.bits}bit"


@dataclass
class LaneCheck:
    """A configuration's KV, as UCX and the link saw it."""

    config: str
    lanes: dict[str, list[str]]  # server -> what UCX reported for its peer's RMA
    link_bytes: int  # prefill's host sent on the link while the configuration ran
    kv_bytes: int  # the KV of the prompt tokens its cells and warm-up sent, but the last

    def problems(self, device: dict[str, str]) -> list[str]:
        found = []
        for server, lanes in self.lanes.items():
            if set(lanes) != {f"tcp/{device[server]}"}:
                found.append(f"{self.config}: UCX on {server} reports {lanes or 'nothing'}, "
                             f"not tcp/{device[server]} alone")  # fmt: skip
        if self.link_bytes < self.kv_bytes:
            found.append(f"{self.config}: the link carried {self.link_bytes} bytes, less than "
                         f"the KV's {self.kv_bytes}")  # fmt: skip
        return found


class AcrossDeployment(Deployment):
    """A configuration's servers placed on the two hosts, UCX held to TCP."""

    def __init__(self, config: str, settings: Settings, workdir: Path, model: Path,
                 hosts: TwoHosts) -> None:  # fmt: skip
        super().__init__(config, settings, workdir, model)
        self.hosts = hosts

    def _fit(self, server) -> None:
        super()._fit(server)
        side = SIDES.get(server.spec.name)
        if side is None:
            return
        host = getattr(self.hosts, side)
        server.spec.host, server.spec.launcher = host.address, host.command([])
        server.spec.env.update(TCP_ONLY)
        # Only the host-to-host link: UCX would also stripe over the host's link to the
        # root namespace, which no cap holds.
        server.spec.env["UCX_NET_DEVICES"] = host.device
        # Upstream's NixlConnector advertises this as its side channel's address.
        server.spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host.address


class AcrossBench(Bench):
    """bench/serve.py's grid, its placements the link rates."""

    def __init__(self, settings: Settings, out: Path, report: Report, hosts: TwoHosts,
                 links: tuple[Link, ...], kv_bytes_per_token: int) -> None:  # fmt: skip
        super().__init__(settings, out, report)
        self.hosts = hosts
        self.links = {link.name: link for link in links}
        self.kv_bytes_per_token = kv_bytes_per_token
        self.checks: list[LaneCheck] = []
        self._current: AcrossDeployment | None = None

    def _deployment(self, config: str, workdir: Path, model: Path) -> Deployment:
        self._current = AcrossDeployment(config, self.settings, workdir, model, self.hosts)
        return self._current

    def _placements(self) -> tuple[str, ...]:
        return tuple(self.links)

    def _enter(self, placement: str) -> None:
        self.hosts.cap_link(self.links[placement].bits)

    def _configuration(self, config: str, workdir: Path, model: Path) -> list[Cell]:
        sent = self.hosts.a.sent_bytes()
        cells = super()._configuration(config, workdir, model)
        if config in MOVING and self._current is not None:
            self.checks.append(self._check(config, self.hosts.a.sent_bytes() - sent, cells))
        return cells

    def _check(self, config: str, link_bytes: int, cells: list[Cell]) -> LaneCheck:
        assert self._current is not None
        servers = self._current.cluster.servers
        lanes = {
            name: sorted(peer_lanes(servers[name].log_path.read_text(errors="replace")))
            for name in SIDES
            if name in servers
        }
        s = self.settings
        answered = sum(c.requests - c.failures for c in cells)
        warm_up = 2 * sum(s.lengths)  # bench/serve.py's two warm-up prompts a length
        tokens = warm_up + answered * (sum(s.lengths) / len(s.lengths))
        kv = int((tokens - answered) * self.kv_bytes_per_token)
        return LaneCheck(config, lanes, link_bytes, max(0, kv))


def refuse_unless_able(settings: Settings) -> None:
    across.refuse_unless_able()
    if "upstream-push" in settings.configs:
        raise KVPushError("--across-namespaces runs plain, push, pull, push-decode-first and "
                          "upstream; leave upstream-push out of --configs")  # fmt: skip
    if settings.attach:
        raise KVPushError("--across-namespaces starts its own servers: it takes no --attach")


def in_small_steps(settings: Settings) -> Settings:
    """`settings`, its servers computing in steps of STEP_TOKENS unless its vLLM
    arguments choose a step."""
    if any(arg.startswith("--max-num-batched-tokens") for arg in settings.vllm_args):
        return settings
    steps = ("--max-num-batched-tokens", str(STEP_TOKENS))
    return replace(settings, vllm_args=(*settings.vllm_args, *steps))


def main(settings: Settings, link_rates: tuple[int | None, ...], out: Path,
         as_json: bool) -> int:  # fmt: skip
    from kvpush.demo.tinymodel import cached_kv_heavy_model

    refuse_unless_able(settings)
    settings = in_small_steps(replace(settings, model=settings.model or cached_kv_heavy_model()))
    links = tuple(Link(bits) for bits in link_rates)
    cells_count = len(settings.configs) * len(links) * len(settings.lengths) * len(settings.rates)
    report = Report(as_json, Progress("kvpush bench serve --across-namespaces", "cell",
                                      cells_count))  # fmt: skip
    hosts = TwoHosts(reachable=True)
    try:
        hosts.start()
        bench = AcrossBench(settings, out, report, hosts, links, _kv_bytes(settings.model))
        cells = bench.run()
    finally:
        across.close_uninterrupted(hosts)
    devices = {"prefill": hosts.a.device, "decode": hosts.b.device}
    problems = [p for check in bench.checks for p in check.problems(devices)]
    (out / "lanes.json").write_text(json.dumps([vars(c) for c in bench.checks], indent=1))
    table = markdown(cells) + "\n" + t2t_table(cells, links)
    (out / "table.md").write_text(table)
    written = [*plots(cells, out), *t2t_plot(cells, links, out)]
    report.finish(lambda _: print(table + "\n" + lane_lines(bench.checks)))
    print(f"kvpush bench serve: results in {out} ({len(written)} plots)", file=sys.stderr)
    for problem in problems:
        print(f"kvpush bench serve: {problem}", file=sys.stderr)
    failed = sum(c.failures + c.mismatches for c in cells if c.config not in UPSTREAM)
    return 1 if failed or problems else 0


def _kv_bytes(model: Path | None) -> int:
    """KV bytes per token of `model` as the servers run it (fp32, the tiny models' dtype)."""
    from kvpush.demo.tinymodel import kv_bytes_per_token

    config = json.loads((Path(model) / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return kv_bytes_per_token(config)


def t2t_table(cells: list[Cell], links: tuple[Link, ...]) -> str:
    """TTFT and T2T p50 of each configuration at each link rate, and push's T2T over
    pull's."""
    configs = [c for c in ("plain", "push", "pull", "upstream", "push-decode-first")
               if any(cell.config == c for cell in cells)]  # fmt: skip
    head = " | ".join(f"{c} TTFT / T2T" for c in configs)
    rows = [f"| link | prompt | rate /s | {head} | push ÷ pull T2T |",
            "|---" * (len(configs) + 4) + "|"]  # fmt: skip
    for link in links:
        for length in sorted({c.prompt_len for c in cells}):
            for rate in sorted({c.rate for c in cells}):
                here = {
                    c.config: c
                    for c in cells
                    if c.placement == link.name and c.prompt_len == length and c.rate == rate
                }
                values = [_pair(here.get(c)) for c in configs]
                ratio = _ratio(here.get("push"), here.get("pull"))
                rows.append(f"| {link.name[5:]} | {length} | {rate:g} | {' | '.join(values)} "
                            f"| {ratio} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def _pair(cell: Cell | None) -> str:
    if cell is None or cell.ttft_p50_ms is None:
        return "—"
    t2t = "—" if cell.t2t_p50_ms is None else f"{cell.t2t_p50_ms:.0f}"
    return f"{cell.ttft_p50_ms:.0f} / {t2t}"


def _ratio(push: Cell | None, pull: Cell | None) -> str:
    if not (push and pull and push.t2t_p50_ms and pull.t2t_p50_ms):
        return "—"
    return f"{push.t2t_p50_ms / pull.t2t_p50_ms:.2f}"


def lane_lines(checks: list[LaneCheck]) -> str:
    lines = []
    for check in checks:
        lanes = "; ".join(f"{s} {','.join(v) or 'none'}" for s, v in check.lanes.items())
        crossed = check.link_bytes / check.kv_bytes if check.kv_bytes else 0.0
        lines.append(f"{check.config}: UCX lanes {lanes}; link carried {crossed:.2f}x the KV")
    return "\n".join(lines)


def t2t_plot(cells: list[Cell], links: tuple[Link, ...], out: Path) -> list[Path]:
    """T2T p50 against link rate: a panel per (prompt length, request rate), a line per
    configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    keys = sorted({(c.prompt_len, c.rate) for c in cells})
    figure, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    names = [link.name for link in links]
    for axis, (length, rate) in zip(axes[0], keys, strict=True):
        for config in sorted({c.config for c in cells}):
            points = [(names.index(c.placement), c.t2t_p50_ms) for c in cells
                      if c.config == config and (c.prompt_len, c.rate) == (length, rate)
                      and c.t2t_p50_ms is not None]  # fmt: skip
            if points:
                points.sort()
                axis.plot(*zip(*points, strict=True), marker="o", label=config)
        axis.set_xticks(range(len(names)), [n[5:] for n in names])
        axis.set_xlabel("prefill-decode link")
        axis.set_ylabel("T2T p50 (ms)")
        axis.set_yscale("log")  # upstream's can be tens of times the others'
        axis.set_title(f"{length}-token prompts, {rate:g}/s, UCX on TCP")
        axis.legend()
    path = out / "t2t-by-link.png"
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [path]
