"""`kvpush bench serve --fleet`: its shapes and configurations, the counters it reads
from /metrics, the best prefix-hit ratio of a trace, and the targets it checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.bench import fleet, serve
from kvpush.bench.load import Outcome
from kvpush.errors import KVPushError


def test_a_fleet_shape_is_prefill_and_decode_counts_and_bad_ones_are_named():
    assert fleet.shape("1p2d") == (1, 2) and fleet.shape("2P2D") == (2, 2)
    for bad in ("1p0d", "p2d", "2d1p", "1p2d3"):
        with pytest.raises(KVPushError, match=bad):
            fleet.shape(bad)


def test_fleet_settings_take_only_the_fleet_configurations():
    settings = serve.Settings(fleet=("1p2d",), configs=fleet.CONFIGS)
    assert settings.configs == ("rr-aggregated", "disagg-all", "decide")
    with pytest.raises(KVPushError, match="plain"):
        serve.Settings(fleet=("1p2d",), configs=("plain", "decide"))
    with pytest.raises(KVPushError, match="3x3"):
        serve.Settings(fleet=("3x3",), configs=fleet.CONFIGS)
    with pytest.raises(KVPushError, match="attach"):
        serve.Settings(fleet=("1p2d",), configs=fleet.CONFIGS, attach={"push": "http://x"})


def test_each_configuration_routes_the_way_its_name_says():
    flags = {name: " ".join(f) for name, f in fleet.ROUTER_FLAGS.items()}
    assert flags == {
        "rr-aggregated": "--disaggregate never",
        "disagg-all": "--disaggregate always",
        "decide": "--disaggregate auto --placement prefix --aggregate-on prefill,decode",
    }


METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 2048.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
vllm:gpu_prefix_cache_hits_total{engine="0"} 99.0
"""


LEGS = """\
vllm:kvpush_prefill_leg_prefix_tokens_total{engine="0",model_name="tiny",reason="queried"} 3000.0
vllm:kvpush_prefill_leg_prefix_tokens_total{engine="0",model_name="tiny",reason="hit"} 512.0
vllm:kvpush_prefill_leg_prefix_tokens_created{engine="0",model_name="tiny",reason="hit"} 1.7e9
"""


def test_prefix_counters_sum_engines_and_skip_other_series():
    # _created is a timestamp and gpu_ another metric: neither counts.
    assert fleet.prefix_counters(METRICS) == (2048, 5096)
    assert fleet.prefix_counters("") == (0, 0)


def test_prefix_counters_leave_out_the_prefill_legs_lookups():
    # What an instance looked up for requests it only prefilled is not a decode's hit.
    assert fleet.prefix_counters(METRICS + LEGS) == (2048 - 512, 5096 - 3000)


def test_decision_counts_are_keyed_by_path_and_reason():
    text = (
        'kvpush_router_decisions_total{path="decode_alone",reason="short"} 5.0\n'
        'kvpush_router_decisions_total{reason="long",path="disaggregated"} 3.0\n'
        "kvpush_router_prompt_tokens_total 100.0\n"
        'kvpush_router_whole_requests_total{role="prefill"} 2.0\n'
    )
    counts = fleet.decision_counts(text)
    assert counts == {"decode_alone/short": 5, "disaggregated/long": 3, "whole_on/prefill": 2}
    # A cell's own: what the warm-up had decided before it is taken off.
    assert fleet._less(counts, {"decode_alone/short": 2, "disaggregated/long": 3}) == {
        "decode_alone/short": 3,
        "whole_on/prefill": 2,
    }


def test_the_best_hits_count_shared_prefixes_in_whole_blocks_short_of_the_last_token():
    system = list(range(40))
    prompts = [
        system + [100] * 10,  # 50 tokens, nothing before it: 0
        system + [100] * 10 + [7] * 14,  # 64 tokens, shares 50: 48 in blocks of 16
        list(range(200, 220)),  # 20 fresh tokens: 0
        system[:33],  # 33 tokens all seen: 32 (its last token is computed)
    ]
    assert fleet.best_hits(prompts, 16) == (48 + 32, 50 + 64 + 20 + 33)
    assert fleet.best_hits([], 16) == (0, 0)
    # Caches emptied between two parts: the last two prompts find nothing of the first
    # two, and the fourth nothing of the third (which it does not share).
    assert fleet.best_hits(prompts, 16, rounds=2) == (48, 50 + 64 + 20 + 33)


def test_a_cells_requests_are_cut_into_even_consecutive_parts():
    assert fleet.parts(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert fleet.parts(5, 1) == [(0, 5)]
    assert fleet.parts(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(KVPushError, match="--rounds 5 splits --requests 4"):
        serve.Settings(fleet=("1p2d",), configs=fleet.CONFIGS, requests=4, rounds=5)
    with pytest.raises(KVPushError, match="--rounds interleaves"):
        serve.Settings(configs=("push",), rounds=2)


class _Fleet:
    """A fleet deployment's surface as the rounds use it, its instances imagined: every
    request served counts a prefix hit and a decision."""

    config = "1p2d"

    def __init__(self) -> None:
        self.routed = ""
        self.served = 0
        self.log: list[str] = []

    def route(self, config):
        self.routed = config
        self.log.append(f"route {config}")
        return fleet.load.Target("http://router")

    def reset_prefix_caches(self):
        self.log.append("reset")

    def deciders(self, config):
        return ["decode0"]

    def prefix_counters(self, names):
        return self.served, 2 * self.served

    def decisions(self):
        return {"decode_alone/short": self.served}

    def traces(self, last):
        return {}

    def instances(self):
        return []


def test_the_configurations_take_turns_on_each_part_and_their_cells_add_the_parts_up(
    monkeypatch, tmp_path
):
    deployment, sent = _Fleet(), []

    async def serve_part(target, prompts, send_at, output_tokens, timeout):
        sent.append((deployment.routed, [p[0] for p in prompts], send_at))
        deployment.served += len(prompts)
        # disagg-all answers the request whose prompt starts with 4 differently.
        wrong = deployment.routed == "disagg-all"
        return [Outcome(True, ttft=0.01, token_ids=[p[0] + (wrong and p[0] == 4)])
                for p in prompts]  # fmt: skip

    monkeypatch.setattr(fleet.load, "run", serve_part)
    monkeypatch.setattr(fleet.load, "arrivals", lambda n, rate, seed: [0.5 * i for i in range(n)])
    monkeypatch.setattr(fleet.load, "prompts", lambda n, length, seed: [[i] * 20 for i in range(n)])
    settings = serve.Settings(fleet=("1p2d",), configs=fleet.CONFIGS, requests=6, rounds=2,
                              workload="fresh")  # fmt: skip
    quiet = SimpleNamespace(step=lambda label: None)
    bench = fleet.FleetBench(settings, tmp_path, report=quiet)
    bench._warm_up = lambda target: ""
    cells = bench._cells(deployment, "pinned", 20, 2.0, block=16)

    # Part one (requests 0-2) by each configuration, then part two (3-5), each part's
    # first request sent at once, each from a fresh router and emptied caches.
    parts = [(c, [0, 1, 2]) for c in fleet.CONFIGS] + [(c, [3, 4, 5]) for c in fleet.CONFIGS]
    assert [(config, firsts) for config, firsts, _ in sent] == parts
    assert all(at == [0.0, 0.5, 1.0] for _, _, at in sent)
    assert deployment.log == [f"route {c}" if i % 2 == 0 else "reset"
                              for c in fleet.CONFIGS * 2 for i in range(2)]  # fmt: skip
    assert sorted(tmp_path.glob("traces-*")) == sorted(
        tmp_path / f"traces-1p2d-pinned-{c}-20-2-round{n}.json"
        for c in fleet.CONFIGS
        for n in (1, 2)
    )
    by = {c.config: c for c in cells}
    assert [c.config for c in cells] == list(fleet.CONFIGS)
    # Each cell is all six requests in order, checked against the first configuration's.
    assert all(c.requests == 6 and c.failures == 0 for c in cells)
    assert by["rr-aggregated"].mismatches == 0 and by["decide"].mismatches == 0
    assert by["disagg-all"].mismatches == 1
    # Counters are the sum of each configuration's own parts, not of the others'.
    assert by["decide"].prefix_hits == 6 and by["decide"].prefix_queries == 12
    assert by["decide"].decisions == {"decode_alone/short": 6}
    # Each part's caches start empty: prompts [i]*20 share nothing anyway.
    assert by["decide"].best_hit_ratio == 0.0


def _cell(config: str, p50: float, p99: float, rate: float, hits=(0, 0), best=None):
    outcomes = [Outcome(True, ttft=p50 / 1e3)] * 98 + [Outcome(True, ttft=p99 / 1e3)] * 2
    base = serve.summarize(config, "pinned", 3072, rate, outcomes, None, 1.0,
                           serve.Settings(configs=("push",)), {}, {})  # fmt: skip
    from dataclasses import asdict

    return fleet.FleetCell(**asdict(base), fleet="1p2d", prefix_hits=hits[0],
                           prefix_queries=hits[1], best_hit_ratio=best)  # fmt: skip


def test_verdicts_say_met_only_where_decide_meets_each_target():
    cells = [
        _cell("rr-aggregated", 100, 400, 1.0),
        _cell("disagg-all", 150, 300, 1.0),
        _cell("decide", 105, 250, 1.0, hits=(85, 100), best=1.0),  # p50 1.05x, hits 85 %
        _cell("rr-aggregated", 300, 900, 4.0),
        _cell("disagg-all", 200, 600, 4.0),
        _cell("decide", 250, 500, 4.0, hits=(70, 100), best=1.0),  # p50 worse, hits 70 %
    ]
    lines = fleet.verdicts(cells)
    missed = [line for line in lines if line.startswith("missed")]
    assert any("1/s: decide TTFT p50 105.0 < rr-aggregated 100.0" in line for line in missed)
    assert any("4/s: decide TTFT p50 250.0 < disagg-all 200.0" in line for line in missed)
    assert any("4/s: decide's decode prefix hit 70 %" in line for line in missed)
    assert len(missed) == 3
    assert any(line.startswith("met") and "1.05x rr-aggregated" in line for line in lines)
    # A trace that shares no prefix: nothing to hit, so no hit is the best there is.
    nothing = [_cell("decide", 10, 20, 8.0, hits=(0, 100), best=0.0)]
    assert any(line.startswith("met") and "hit 0 %" in line for line in fleet.verdicts(nothing))
    table = fleet.markdown(cells)
    assert "| 1p2d | pinned | 1 | decide | 105.0 | 250.0 | 1.05 |" in table
    assert "| 85 % | 100 % | 0.85 |" in table


def test_a_ttft_cdf_is_drawn_per_fleet_and_placement_each_configuration_its_own_colour(tmp_path):
    pytest.importorskip("matplotlib")
    from dataclasses import replace

    from kvpush.bench import serve_report

    cells = [_cell(config, 20.0 * (i + 1), 90.0, rate)
             for rate in (1.0, 4.0) for i, config in enumerate(fleet.CONFIGS)]  # fmt: skip
    cells += [replace(c, fleet="2p2d") for c in cells]
    written = fleet.plots(cells, tmp_path)
    assert sorted(p.name for p in written) == ["ttft-cdf-1p2d-pinned.png",
                                               "ttft-cdf-2p2d-pinned.png"]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in written)
    colours = {serve_report._color(config, cells) for config in fleet.CONFIGS}
    assert len(colours) == 3 and serve_report._color("plain", cells) not in colours


def test_the_command_line_runs_the_fleet_bench_with_its_own_configurations(monkeypatch, tmp_path):
    from kvpush.cli import main

    seen = []
    monkeypatch.setattr(fleet, "main", lambda settings, out, as_json: seen.append(settings) or 0)
    argv = ["bench", "serve", "--fleet", "1p2d,2p2d", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert seen[0].fleet == ("1p2d", "2p2d") and seen[0].configs == fleet.CONFIGS
    assert seen[0].rounds == 1
    assert main([*argv, "--rounds", "4"]) == 0 and seen[1].rounds == 4
    assert main([*argv, "--configs", "plain"]) == 2  # not a fleet configuration: refused


def test_a_fleet_deployment_makes_its_instances_and_lists_who_runs_decodes(tmp_path):
    settings = serve.Settings(fleet=("2p2d",), configs=fleet.CONFIGS, lengths=(3072,))
    deployment = fleet.FleetDeployment("2p2d", settings, tmp_path, tmp_path)
    deployment.cluster.start = lambda *names, timeout=0: None  # no engines in a unit test
    deployment.start()
    servers = deployment.cluster.servers
    assert sorted(servers) == ["decode0", "decode1", "prefill0", "prefill1"]
    assert all(s.spec.env["VLLM_SERVER_DEV_MODE"] == "1" for s in servers.values())
    assert servers["prefill1"].spec.core == "0" and servers["decode1"].spec.core == "1"
    # decide runs whole requests on prefill instances too: their caches count.
    assert deployment.deciders("rr-aggregated") == deployment.deciders("decide") == list(servers)
    assert deployment.deciders("disagg-all") == ["decode0", "decode1"]
    # ...but the router lists each server once: decide reaches prefill instances for
    # whole requests through --aggregate-on, and a server listed twice is refused.
    routed = []
    deployment.cluster.start_router = lambda p, d, **kw: routed.append((p, d)) or "http://r"
    for config in fleet.CONFIGS:
        deployment.route(config)
    prefills, decodes = ["prefill0", "prefill1"], ["decode0", "decode1"]
    assert fleet.CONFIGS == ("rr-aggregated", "disagg-all", "decide")
    # Each spec names the cores the instance computes on: its role's.
    spec = {n: f"{deployment.cluster.router_spec(n)},device=cpus-{servers[n].spec.core}"
            for n in servers}  # fmt: skip
    assert spec["prefill1"].endswith(",device=cpus-0") and spec["decode0"].endswith("cpus-1")
    specs = lambda names: [spec[n] for n in names]  # noqa: E731
    assert routed == [(specs(prefills), specs(servers)), (specs(prefills), specs(decodes)),
                      (specs(prefills), specs(decodes))]  # fmt: skip
