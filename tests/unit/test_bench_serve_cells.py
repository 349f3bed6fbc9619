"""How `kvpush bench serve` turns request outcomes into a cell and a table row."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.bench import kept, load, serve, serve_report
from kvpush.bench.load import Outcome

SETTINGS = serve.Settings(configs=("plain", "push"), slo_ttft_ms=100.0, slo_tpot_ms=10.0)


def _ok(ttft: float, tokens: list[int]) -> Outcome:
    times = [ttft + 0.005 * i for i in range(len(tokens))]
    t2t = times[1] if len(times) > 1 else None
    return Outcome(True, ttft=ttft, t2t=t2t, token_times=times, token_ids=tokens)


def test_a_cell_counts_failures_mismatches_and_goodput_against_the_slo():
    outcomes = [_ok(0.05, [1, 2]), _ok(0.5, [1, 2]), _ok(0.05, [9, 9]), Outcome(False, error="x")]
    expected = [[1, 2], [1, 2], [1, 2], [1, 2]]
    cell = serve.summarize("push", "pinned", 64, 1.0, outcomes, expected, 2.0, SETTINGS, {}, {})
    assert (cell.requests, cell.failures, cell.mismatches) == (4, 1, 1)
    assert cell.goodput_rps == 1.0  # two of three answered within the TTFT SLO, over 2 s
    assert cell.ttft_p50_ms == 50.0 and cell.errors == ["x"]


def test_a_configuration_that_cannot_serve_is_a_row_of_failures_not_a_hang():
    outcomes = [Outcome(False, error="warm-up at 3072 tokens failed: timeout")] * 3
    cell = serve.summarize("upstream-push", "colocated", 3072, 8.0, outcomes, None, 0.0,
                           SETTINGS, {}, {})  # fmt: skip
    assert cell.failures == 3 and cell.ttft_p50_ms is None and cell.goodput_rps == 0.0
    row = serve.markdown([cell]).splitlines()[-1]
    assert "| upstream-push |" in row and "| 3 |" in row


def test_t2t_is_the_second_tokens_arrival_and_the_cell_keeps_every_ttft():
    outcomes = [_ok(0.05, [1, 2, 3]), _ok(0.07, [1, 2, 3]), _ok(0.09, [1])]
    cell = serve.summarize("push", "pinned", 64, 1.0, outcomes, None, 2.0, SETTINGS, {}, {})
    # _ok's tokens come 5 ms apart; the one-token answer has no second token.
    assert (cell.t2t_p50_ms, cell.t2t_p99_ms) == (65.0, pytest.approx(74.8))
    assert cell.ttfts_ms == [50.0, 70.0, 90.0]
    assert "| 65 |" in serve.markdown([cell]).splitlines()[-1]


def _spans(**means: float) -> dict:
    return {key.replace("_", ".", 1): {"count": 3, "mean_ms": ms} for key, ms in means.items()}


def _cell(config: str, ttft_ms: float, spans: dict | None = None, rate: float = 1.0):
    cell = serve.summarize(config, "pinned", 64, rate, [_ok(ttft_ms / 1e3, [1, 2])], None, 1.0,
                           SETTINGS, {}, {})  # fmt: skip
    cell.spans = spans or {}
    return cell


def test_the_mean_ttft_splits_into_the_spans_in_order_and_the_rest():
    spans = {
        "prefill": _spans(prefill_queued=2.0, prefill_compute=20.0),
        "decode": _spans(
            decode_handoff=1.0, decode_report=1.5, decode_resume=0.5, decode_queued=9.0
        ),
    }
    split = serve.where_time_goes(_cell("push-decode-first", 30.0, spans))
    assert list(split) == ["prefill queue", "prefill compute", "hand-off", "report", "resume",
                           serve.REST]  # fmt: skip
    assert split[serve.REST] == 5.0 and sum(split.values()) == 30.0
    # The first token from the prefill leg: the hand-off is off its path.
    split = serve.where_time_goes(_cell("push", 25.0, spans))
    assert list(split) == ["prefill queue", "prefill compute", serve.REST_FROM_PREFILL]
    assert split[serve.REST_FROM_PREFILL] == 3.0


def test_a_configuration_without_spans_is_one_part_and_the_rest_is_never_negative():
    assert serve.where_time_goes(_cell("plain", 21.0)) == {"plain": 21.0}
    spans = {"prefill": _spans(prefill_compute=50.0)}  # spans outlasting the client's mean
    assert serve.where_time_goes(_cell("push", 30.0, spans))[serve.REST_FROM_PREFILL] == 0.0
    assert serve.where_time_goes(serve.summarize(
        "push", "pinned", 64, 1.0, [Outcome(False, error="x")], None, 1.0, SETTINGS, {}, {}
    )) == {}  # fmt: skip


@pytest.mark.parametrize("rates", [(1.0,), (1.0, 8.0)], ids=["one-rate", "two-rates"])
def test_every_plot_is_drawn_for_one_rate_and_for_several(tmp_path, rates):
    pytest.importorskip("matplotlib")
    spans = {"prefill": _spans(prefill_compute=20.0), "decode": _spans(decode_handoff=2.0)}
    cells = [
        _cell(config, ms * rate, spans if config != "plain" else None, rate)
        for rate in rates for config, ms in (("plain", 20.0), ("push", 30.0), ("pull", 40.0))
    ]  # fmt: skip
    written = serve_report.plots(cells, tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["tpot-pinned.png", "ttft-cdf-pinned.png", "ttft-pinned.png",
                     "where-pinned.png"]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in written)


def test_the_streaming_client_times_the_second_token_even_when_it_shares_a_chunk():
    """A real SSE answer on loopback whose first chunk carries two tokens: T2T is
    that chunk's arrival, not the next chunk's."""
    from aiohttp import web

    chunks = [{"token_ids": [5, 6], "text": "ab"}, {"token_ids": [7], "text": "c"}]

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for choice in chunks:
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.3)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def scenario() -> list[Outcome]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            return await load.run(load.Target(f"http://127.0.0.1:{port}"), [[9]], [0.0], 3)
        finally:
            await runner.cleanup()

    (outcome,) = asyncio.run(scenario())
    assert outcome.ok and outcome.token_ids == [5, 6, 7]
    assert outcome.t2t == outcome.ttft == outcome.token_times[0]
    assert outcome.t2t < outcome.token_times[1]


def test_prefill_alone_runs_only_when_named():
    assert "prefill-alone" not in serve.default_configs()
    assert serve.Settings().configs == serve.default_configs()
    named = ("plain", "prefill-alone")
    assert serve.Settings(configs=named).configs == named
    with pytest.raises(serve.KVPushError, match="unknown configuration"):
        serve.Settings(configs=("prefill-only",))


def test_a_cells_traces_hold_each_request_as_the_client_saw_it_beside_the_servers(tmp_path):
    outcomes = [_ok(0.05, [1]), Outcome(False, error="refused")]
    servers = {"router": [{"transfer_id": "t0"}, {"transfer_id": "t1"}]}
    kept.write_traces(tmp_path / "traces-x.json", servers, outcomes, [0.0, 1.25], 1000.0)
    written = json.loads((tmp_path / "traces-x.json").read_text())
    assert written["router"] == [{"transfer_id": "t0"}, {"transfer_id": "t1"}]
    assert written["client"]["started_unix"] == 1000.0
    requests = written["client"]["requests"]
    seen = [(r["at_s"], r["ok"], r["ttft_ms"]) for r in requests]
    assert seen == [(0.0, True, 50.0), (1.25, False, 0.0)]
    assert requests[1]["error"] == "refused"


def test_every_servers_log_is_kept_in_the_output_after_the_run(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "push" / "prefill").mkdir(parents=True)
    (work / "push" / "prefill" / "server.log").write_text("engine started")
    (work / "push" / "router.log").write_text("routing")
    kept.keep_logs(work, out)
    assert (out / "logs" / "push" / "prefill" / "server.log").read_text() == "engine started"
    assert (out / "logs" / "push" / "router.log").read_text() == "routing"
