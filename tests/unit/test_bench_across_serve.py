"""`kvpush bench serve --across-namespaces`: its options, where it puts each server,
the link rate each cell runs at, and what it reports of UCX's lanes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpush.bench import across, across_serve, load, serve
from kvpush.bench.across_serve import AcrossBench, AcrossDeployment, LaneCheck, Link
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.cli import main
from kvpush.errors import KVPushError
from kvpush.netns import TwoHosts
from kvpush.transport.ucx_report import peer_lanes


def test_a_link_rate_needs_the_namespaces(capsys):
    assert main(["bench", "serve", "--link-rate", "300mbit", "--configs", "push"]) == 2
    assert "--link-rate caps the link --across-namespaces makes" in capsys.readouterr().err


def test_it_refuses_without_root_before_making_anything(monkeypatch, capsys):
    monkeypatch.setattr(across.os, "geteuid", lambda: 1000)
    made = []
    monkeypatch.setattr(across_serve.TwoHosts, "start", lambda self: made.append(self))
    argv = ["bench", "serve", "--across-namespaces", "--link-rate", "1gbit", "--configs", "push"]
    assert main(argv) == 2
    assert "--across-namespaces needs root" in capsys.readouterr().err
    assert not made


def test_upstream_push_is_refused_by_name(monkeypatch):
    # Its decode leg names prefill's side channel at 127.0.0.1.
    monkeypatch.setattr(across, "refuse_unless_able", lambda: None)
    settings = SimpleNamespace(configs=("push", "upstream-push"), attach={})
    with pytest.raises(KVPushError, match="leave upstream-push out"):
        across_serve.refuse_unless_able(settings)


def test_servers_compute_in_small_steps_unless_told_otherwise():
    small = across_serve.in_small_steps(serve.Settings(vllm_args=("--enforce-eager",)))
    assert small.vllm_args == ("--enforce-eager", "--max-num-batched-tokens", "512")
    for chosen in (("--max-num-batched-tokens", "2048"), ("--max-num-batched-tokens=2048",)):
        settings = serve.Settings(vllm_args=chosen)
        assert across_serve.in_small_steps(settings).vllm_args == chosen


def _deployment(tmp_path: Path, config: str) -> AcrossDeployment:
    settings = serve.Settings(configs=(config,), lengths=(3072,))
    return AcrossDeployment(config, settings, tmp_path, tmp_path, TwoHosts(reachable=True))


def test_prefill_and_decode_run_on_their_hosts_held_to_tcp_on_the_link(tmp_path):
    deployment = _deployment(tmp_path, "push")
    deployment._server("prefill", "kv_producer", "0", mode="push")
    deployment._server("decode", "kv_consumer", "1", mode="push")
    hosts = deployment.hosts
    for name, host in (("prefill", hosts.a), ("decode", hosts.b)):
        spec = deployment.cluster.servers[name].spec
        assert spec.host == host.address
        assert spec.launcher == ["ip", "netns", "exec", host.namespace]
        assert spec.env["UCX_TLS"] == "tcp,self" and spec.env["UCX_PROTO_INFO"] == "y"
        assert spec.env["UCX_NET_DEVICES"] == host.device
        assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host.address
        assert spec.max_model_len >= 3072 + 16


def test_the_plain_instance_stays_in_the_root_namespace(tmp_path):
    deployment = _deployment(tmp_path, "plain")
    deployment._server("plain", None, "0")
    spec = deployment.cluster.servers["plain"].spec
    assert (spec.host, spec.launcher) == ("127.0.0.1", [])
    assert "UCX_TLS" not in spec.env


class RecordingHosts:
    def __init__(self) -> None:
        self.caps: list[int | None] = []

    def cap_link(self, bits: int | None) -> None:
        self.caps.append(bits)


def _bench(tmp_path: Path, links: tuple[Link, ...]) -> AcrossBench:
    settings = serve.Settings(configs=("plain",), lengths=(256,), rates=(1.0,), requests=2)
    report = Report(True, Progress("test", "cell", 2))
    return AcrossBench(settings, tmp_path, report, RecordingHosts(), links, 1024)


def test_each_placement_is_a_link_rate_set_before_its_cells(tmp_path):
    links = (Link(300_000_000), Link(10**9), Link(None))
    bench = _bench(tmp_path, links)
    assert bench._placements() == ("link-300mbit", "link-1gbit", "link-veth")
    for placement in bench._placements():
        bench._enter(placement)
    assert bench.hosts.caps == [300_000_000, 10**9, None]


class FakeDeployment:
    config = "plain"

    def spans(self) -> dict:
        return {}

    def traces(self, last: int) -> dict:
        return {}

    def cpu_seconds(self) -> dict:
        return {}


def test_each_link_rate_gets_fresh_prompts(tmp_path, monkeypatch):
    # The same prompts at the second rate would be served from the prefix cache.
    seeds = []
    monkeypatch.setattr(load, "prompts", lambda n, length, seed: seeds.append(seed) or [[1]] * n)

    async def answered(target, batch, send_at, output_tokens, timeout):
        return [load.Outcome(True, ttft=0.1, token_ids=[1]) for _ in batch]

    monkeypatch.setattr(load, "run", answered)
    bench = _bench(tmp_path, (Link(300_000_000), Link(10**9)))
    for placement in bench._placements():
        bench._cell(FakeDeployment(), load.Target(""), placement, 256, 1.0, {})
    assert len(set(seeds)) == 2


def _cell(config: str, link: str, t2t: float) -> serve.Cell:
    outcomes = [load.Outcome(True, ttft=0.1, token_ids=[1])]
    cell = serve.summarize(config, link, 3072, 0.5, outcomes, None, 1.0, serve.Settings(), {}, {})
    cell.t2t_p50_ms = t2t
    return cell


def test_the_t2t_table_gives_push_over_pull_at_each_rate():
    links = (Link(300_000_000), Link(10**9))
    cells = [_cell("push", "link-300mbit", 900), _cell("pull", "link-300mbit", 1800),
             _cell("push", "link-1gbit", 450), _cell("pull", "link-1gbit", 500)]  # fmt: skip
    rows = across_serve.t2t_table(cells, links).splitlines()[2:]
    assert rows[0].startswith("| 300mbit |") and rows[0].endswith("| 0.50 |")
    assert rows[1].startswith("| 1gbit |") and rows[1].endswith("| 0.90 |")


DEVICES = {"prefill": "kvp1a", "decode": "kvp1b"}


def test_a_lane_other_than_tcp_on_the_link_is_a_problem():
    fine = LaneCheck("push", {"prefill": ["tcp/kvp1a"], "decode": ["tcp/kvp1b"]}, 2000, 1000)
    assert fine.problems(DEVICES) == []
    shared = LaneCheck("push", {"prefill": ["cma/memory"], "decode": ["tcp/kvp1b"]}, 2000, 1000)
    assert "UCX on prefill reports ['cma/memory']" in shared.problems(DEVICES)[0]
    short = LaneCheck("pull", {"prefill": ["tcp/kvp1a"], "decode": ["tcp/kvp1b"]}, 10, 1000)
    assert "the link carried 10 bytes, less than the KV's 1000" in short.problems(DEVICES)[0]


# UCX_PROTO_INFO's tables as a server logged them: its own endpoint (self), then the
# peer's, with remote memory writes and active messages.
UCX_LOG = """\
[1.2] [vm:1:0]   | kvpush-a81e67d1-57f7-451e-a92d- self cfg#0               |
[1.2] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.2] [vm:1:0]   +---------------+-------------+----------------------------+
[1.2] [vm:1:0]   | 0..4294967295 | short       | self/memory                |
[1.2] [vm:1:0]   |       4G..inf | zero-copy   | tcp/kvp1b                  |
[1.3] [vm:1:0]   | kvpush-a81e67d1-57f7-451e-a92d- inter-node cfg#1         |
[1.3] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.3] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.3] [vm:1:0]   | 0..inf | zero-copy   | tcp/kvp1b                         |
[1.4] [vm:1:0]   | kvpush-a81e67d1-57f7-451e-a92d- inter-node cfg#1    |
[1.4] [vm:1:0]   | active message by ucp_am_send* from host memory     |
[1.4] [vm:1:0]   |   1..65528 | zero-copy            | tcp/kvp1u1      |
[1.5] [vm:1:0]   | kvpush-a81e67d1-57f7-451e-a92d- intra-node cfg#2         |
[1.5] [vm:1:0]   | remote memory read by ucp_get* from host memory to host  |
[1.5] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                        |
"""


def test_the_lanes_are_those_of_remote_memory_access_to_peers():
    assert peer_lanes(UCX_LOG) == {"tcp/kvp1b", "cma/memory"}
    assert peer_lanes("no report here\n") == set()
