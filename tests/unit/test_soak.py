"""The soak's pure parts: its request mix, which fault explains which failure, how a
client reads an answer, and the verdict it draws from a run."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpush.bench import faults, mix, soak
from kvpush.bench.faults import Fault
from kvpush.bench.soak import DISCONNECTED, FAILED, HUNG, OK, Instance, Record
from kvpush.errors import KVPushError

LIMIT = 2048


def test_the_mix_is_the_same_for_a_seed_and_another_for_another_seed():
    first = mix.mix(300, seed=5, max_model_len=LIMIT, disconnect_share=0.1)
    assert first == mix.mix(300, seed=5, max_model_len=LIMIT, disconnect_share=0.1)
    assert first != mix.mix(300, seed=6, max_model_len=LIMIT, disconnect_share=0.1)
    assert [s.index for s in first] == list(range(300))


def test_the_mix_has_every_kind_of_request_and_every_prompt_fits_the_context():
    shapes = mix.mix(1000, seed=1, max_model_len=LIMIT, disconnect_share=0.05)
    chat = [s for s in shapes if s.path == mix.CHAT]
    completions = [s for s in shapes if s.path == mix.COMPLETIONS]
    assert 200 < len(chat) < 400 and len(chat) + len(completions) == 1000
    assert 0.4 < sum(s.stream for s in shapes) / 1000 < 0.6
    assert 100 < sum(s.n == 2 for s in shapes) < 300
    assert any(len(s.prompt_lens) == 2 for s in completions)
    assert 20 < sum(s.disconnect_after_s is not None for s in shapes) < 90
    assert any(s.shared_prefix for s in shapes)
    lengths = [n for s in completions for n in s.prompt_lens]
    assert min(lengths) == 1
    at_limit = [s for s in completions if s.prompt_lens[0] + s.body["max_tokens"] == LIMIT]
    assert at_limit, "no prompt reaches the context limit"
    for shape in completions:
        prompts = shape.body["prompt"]
        prompts = prompts if isinstance(prompts[0], list) else [prompts]
        for tokens in prompts:
            assert 1 <= len(tokens) <= LIMIT - shape.body["max_tokens"]
            assert min(tokens) >= mix.SPECIAL  # never a special token
    for shape in chat:
        assert shape.prompt_lens[0] <= (LIMIT - shape.body["max_tokens"]) // 8


def test_shared_prefix_prompts_share_a_prefix_of_at_least_a_block():
    shapes = [s for s in mix.mix(400, 2, LIMIT, 0.0) if s.shared_prefix]
    heads = {tuple(s.body["prompt"][:128]) for s in shapes}
    assert len(shapes) > len(heads) > 1  # a few prefixes, each used more than once


def test_greedy_and_seeded_requests_are_compared_n2_is_seeded_and_some_streams_sample():
    sampled = 0
    for shape in mix.mix(300, 3, LIMIT, 0.0):
        if shape.n == 2:
            assert "seed" in shape.body and shape.body["temperature"] > 0
            assert shape.deterministic
        elif "temperature" not in shape.body:  # vLLM's default, 1, and no seed
            assert shape.stream and "seed" not in shape.body and not shape.deterministic
            sampled += 1
        else:
            assert shape.body["temperature"] == 0 and shape.deterministic
    assert 20 < sampled < 80  # about 0.5 x 0.8 x 0.3 of 300
    random_sampled = mix.Shape(0, mix.COMPLETIONS, {"temperature": 1.0, "max_tokens": 1},
                               (1,), False, None)  # fmt: skip
    assert not random_sampled.deterministic


def _fault(id: int, start: float, end: float | None, skipped: bool = False) -> Fault:
    return Fault(id, "kill-prefill", "prefill0", start, end, skipped=skipped)


def test_a_failure_belongs_to_the_fault_whose_window_it_was_in_flight_in():
    window = [_fault(1, 100.0, 140.0), _fault(2, 300.0, 310.0)]
    assert faults.attribute(90.0, 101.0, window, grace_s=20.0).id == 1  # in flight at kill
    assert faults.attribute(120.0, 121.0, window, grace_s=20.0).id == 1  # sent while down
    assert faults.attribute(155.0, 156.0, window, grace_s=20.0).id == 1  # in the grace
    assert faults.attribute(161.0, 170.0, window, grace_s=20.0) is None  # after it
    assert faults.attribute(50.0, 99.0, window, grace_s=20.0) is None  # before it
    assert faults.attribute(305.0, 306.0, window, grace_s=20.0).id == 2


def test_a_skipped_fault_explains_nothing_and_one_never_over_explains_everything_after():
    assert faults.attribute(10.0, 11.0, [_fault(1, 5.0, 6.0, skipped=True)], 20.0) is None
    assert faults.attribute(9000.0, 9001.0, [_fault(1, 5.0, None)], 20.0).id == 1


def test_an_error_names_its_cause_by_leg_instance_or_kvpush_reason():
    assert faults.names_cause("prefill instance http://127.0.0.1:5 failed: Cannot connect")
    assert faults.names_cause("decode instance http://127.0.0.1:6: KV transfer peer_lost")
    assert faults.names_cause("watchdog_expired")
    assert not faults.names_cause("Internal Server Error")
    assert not faults.names_cause("the stream ended without data: [DONE]")
    assert not faults.names_cause("decoder exploded")  # whole words only


def test_faults_come_in_turn_each_on_an_instance_of_its_role():
    pick = faults.schedule(("kill-prefill", "stop-decode", "cut"), ["p0", "p1"], ["d0"], 0)
    assert [pick(i) for i in range(6)] == [
        ("kill-prefill", "p0"), ("stop-decode", "d0"), ("cut", "p0"),
        ("kill-prefill", "p1"), ("stop-decode", "d0"), ("cut", "p1"),
    ]  # fmt: skip
    with pytest.raises(KVPushError, match="unknown fault kind"):
        faults.parse_kinds("kill-prefill,flood")


def _record(index: int, outcome: str, sent: float = 0.0, ended: float = 1.0, **kw) -> Record:
    return Record(index, {}, sent, ended, outcome, **kw)


def _instance(name: str = "decode0", state=None, rss=(100.0, 105.0), fds=(50, 52)) -> Instance:
    state = {"sending": 0, "producing": 0, "receiving": 0} if state is None else state
    return Instance(name, "decode", 0, state, rss, fds)


ROUTER_ERROR = "decode instance http://127.0.0.1:9: failed: Server disconnected"


def test_a_clean_run_passes_every_target():
    records = [
        _record(0, OK, answer=["a"]),
        _record(1, DISCONNECTED),
        _record(2, FAILED, 100.0, 101.0, error=ROUTER_ERROR, openai_error=True),
    ]
    fault_list = [_fault(1, 99.0, 120.0)]
    soak.compare(records, {0: ["a"]})
    soak.explain(records, fault_list, grace_s=20.0)
    summary = soak.summarize(records, fault_list, [_instance()], 130.0, 2.0)
    assert summary["passed"], summary["targets"]
    assert summary["outcomes"] == {OK: 1, FAILED: 1, DISCONNECTED: 1, HUNG: 0}
    assert summary["compared"] == 1 and summary["failures_by_fault"] == {"1": 1}


def test_each_kind_of_trouble_fails_its_own_target():
    records = [
        _record(0, OK, answer=["a"]),  # the plain instance said "b"
        _record(1, HUNG, 100.0, 220.0, error="no answer within the 120s deadline"),
        _record(2, FAILED, 500.0, 501.0, error=ROUTER_ERROR, openai_error=True),  # no fault
        _record(3, FAILED, 100.0, 101.0, error="Internal Server Error", openai_error=True),
        _record(4, FAILED, 100.0, 101.0, error=ROUTER_ERROR, openai_error=False),  # not shaped
        _record(5, OK, answer=["c"]),  # the plain instance failed it: not compared
    ]
    # A drain whose instance still got requests after the router forgot it.
    drain = Fault(2, "drain-decode", "decode1", 400.0, 420.0, held=False)
    fault_list = [_fault(1, 99.0, 120.0), drain]
    soak.compare(records, {0: ["b"], 5: None})
    soak.explain(records, fault_list, grace_s=20.0)
    leaky = _instance(state={"sending": 0, "producing": 0, "receiving": 2})
    grown = _instance("prefill0", rss=(100.0, 111.0))
    summary = soak.summarize(records, fault_list, [leaky, grown], 600.0, 1.0)
    assert not summary["passed"]
    assert not any(summary["targets"].values()), summary["targets"]
    assert summary["wrong"] == 1 and summary["compared"] == 1
    assert summary["unexplained_failures"] == 1 and summary["failures_not_naming_cause"] == 2
    assert [e["index"] for e in summary["examples"]["hung"]] == [1] and records[1].fault == 1
    assert summary["examples"]["unexplained"][0]["error"] == ROUTER_ERROR
    assert records[5].match is None


def test_an_instance_that_answers_no_state_is_not_quiet():
    assert not _instance(state={"error": "connection refused"}).quiet
    assert _instance(rss=(100.0, 110.0), fds=(50, 55)).within_tolerance
    assert not _instance(fds=(50, 56)).within_tolerance


def _samples(*rss: tuple[float, float], every_s: float = 10.0) -> list[dict]:
    """Footprint samples of prefill0 and decode0, `every_s` apart."""
    return [
        {"t": i * every_s, "prefill0": (p, 200), "decode0": (d, 190)}
        for i, (p, d) in enumerate(rss)
    ]


def test_memory_has_levelled_once_no_instance_grew_a_percent_in_thirty_seconds():
    names = ["prefill0", "decode0"]
    # The 2026-12-01 run's first minutes: both climb steeply, then flatten.
    climbing = _samples((3037, 3029), (3225, 3082), (3395, 3124), (3466, 3178))
    assert not soak.levelled(climbing, names)
    flat = _samples((3470, 3178), (3486, 3211), (3500, 3220), (3500, 3200))
    assert soak.levelled(flat, names)  # +0.9 % and +0.7 % over the last 30 s
    assert not soak.levelled(flat[:3] + [{**flat[3], "prefill0": (3506, 200)}], names)
    one_still_climbing = _samples((3500, 3100), (3500, 3150), (3500, 3180), (3500, 3200))
    assert not soak.levelled(one_still_climbing, names)  # decode +3.2 %
    assert not soak.levelled(flat[:3], names)  # not 30 s of samples yet


def test_the_table_and_the_json_line_carry_the_numbers():
    records = [_record(0, OK, answer=["a"]), _record(1, FAILED, error="x")]
    summary = soak.summarize(records, [_fault(1, 0.0, 5.0)], [_instance()], 10.0, 3.0)
    table = soak.markdown(summary)
    assert "| 2 | 1 | 1 | 0 | 0 | 0 / 0 | 1 | 1 | 1 (0) | 3 | 10 |" in table
    assert "| decode0 | decode | 0 | 0 | 0 | 0 | 100 → 105 | 50 → 52 |" in table
    assert "- FAIL every_failure_in_a_fault_window" in table
    line = json.loads(records[1].as_json())
    assert line["type"] == "request" and line["outcome"] == FAILED
    assert json.loads(json.dumps(summary))["type"] == "summary"


# -- how the client reads answers (a stand-in server) ---------------------------------


async def _answers(handler, shape: mix.Shape, deadline_s: float = 5.0) -> Record:
    app = web.Application()
    app.router.add_post(shape.path, handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        return await soak.send(session, url, shape, deadline_s, lambda: 0.0)


def _stream_of(*events: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {event}\n\n".encode())
        return response

    return handler


STREAMED = mix.Shape(0, mix.COMPLETIONS, {"stream": True, "max_tokens": 2}, (1,), False, None)
CHUNK = json.dumps({"choices": [{"index": 0, "text": "hi"}]})


def test_a_stream_cut_before_done_is_a_failure_not_an_answer():
    record = asyncio.run(_answers(_stream_of(CHUNK), STREAMED))
    assert record.outcome == FAILED and not record.openai_error
    assert "without data: [DONE]" in record.error
    whole = asyncio.run(_answers(_stream_of(CHUNK, CHUNK, "[DONE]"), STREAMED))
    assert whole.outcome == OK and whole.answer == ["hihi"]


def test_an_error_event_in_a_stream_is_an_openai_error():
    event = json.dumps({"error": {"message": "decode instance x: peer_lost", "code": 502}})
    record = asyncio.run(_answers(_stream_of(CHUNK, event), STREAMED))
    assert record.outcome == FAILED and record.openai_error and "peer_lost" in record.error


def test_a_chat_answer_is_read_per_choice_and_an_error_status_is_a_failure():
    chat = mix.Shape(0, mix.CHAT, {"n": 2, "max_tokens": 1}, (3,), False, None)

    async def answer(request: web.Request) -> web.Response:
        choices = [
            {"index": 1, "message": {"content": "b"}},
            {"index": 0, "message": {"content": "a"}},
        ]
        return web.json_response({"choices": choices})

    assert asyncio.run(_answers(answer, chat)).answer == ["a", "b"]

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prefill instance down"}}, status=502)

    record = asyncio.run(_answers(refuse, chat))
    assert (record.outcome, record.status, record.openai_error) == (FAILED, 502, True)


def test_no_answer_by_the_deadline_is_hung_and_a_client_that_leaves_is_disconnected():
    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    record = asyncio.run(_answers(silent, STREAMED, deadline_s=0.3))
    assert record.outcome == HUNG and "deadline" in record.error
    leaving = mix.Shape(0, mix.COMPLETIONS, {"max_tokens": 1}, (1,), False, 0.2)
    assert asyncio.run(_answers(silent, leaving, deadline_s=3.0)).outcome == DISCONNECTED


def test_the_command_refuses_bad_settings_before_starting_anything(capsys):
    from kvpush import cli

    assert cli.main(["bench", "soak", "--faults", "kill-prefill,flood"]) == 2
    assert "unknown fault kind(s) ['flood']" in capsys.readouterr().err
    assert cli.main(["bench", "soak", "--rate", "0"]) == 2
    assert "argument --rate: '0' must be more than 0" in capsys.readouterr().err


# -- settling: the mix at the run's rate until memory levels off ----------------------


async def _settle(handler, rss: list[float], settle_max_s: float) -> tuple[soak.Soak, float]:
    """Settle a stand-in deployment (every path answered by `handler`) whose one
    instance's RSS reads `rss` in turn (then stays at the last): the Soak and the
    seconds settling took."""
    run = soak.Soak(soak.Settings(settle_max_s=settle_max_s, seed=3), Path("unused"))
    run.prefill, run.decode = ["prefill0"], []
    readings = iter(rss)
    last = [rss[0]]

    def footprint(name: str) -> tuple[float, int]:
        last[0] = next(readings, last[0])
        return last[0], 100

    run._footprint = footprint  # type: ignore[method-assign]
    app = web.Application()
    app.router.add_post(mix.COMPLETIONS, handler)
    app.router.add_post(mix.CHAT, handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        started = time.monotonic()
        await run._settle(session, str(server.make_url("")).rstrip("/"), rate=20.0)
        return run, time.monotonic() - started


async def _ok(request: web.Request) -> web.StreamResponse:
    """An answer of one choice per `n`, streamed when asked to be."""
    body = await request.json()
    choices = [{"index": i, "text": "x"} for i in range(body.get("n", 1))]
    if not body.get("stream"):
        return web.json_response({"choices": choices})
    return await _stream_of(json.dumps({"choices": choices}), "[DONE]")(request)


def test_settling_ends_once_memory_levels_off_not_when_its_arrivals_run_out(monkeypatch):
    monkeypatch.setattr(soak, "SAMPLE_S", 0.1)
    monkeypatch.setattr(soak, "LEVEL_WINDOW_S", 0.3)
    sent: list[float] = []

    async def counting(request: web.Request) -> web.Response:
        sent.append(time.monotonic())
        return await _ok(request)

    # Growing 10 % a sample for four samples, then flat: levelled a window later.
    run, took = asyncio.run(_settle(counting, [100, 110, 121, 133, 146], settle_max_s=30.0))
    settles = [f for f in run.footprints if f["phase"] == "settle"]
    assert 5 <= len(settles) <= 12 and settles[-1]["prefill0"] == (146, 100)
    assert took < 5.0  # not the 30 s bound, nor the 45 s of arrivals drawn for it
    assert len(sent) >= 5  # the mix went out at its rate meanwhile


def test_settling_stops_at_its_bound_when_memory_keeps_growing(monkeypatch):
    monkeypatch.setattr(soak, "SAMPLE_S", 0.1)
    monkeypatch.setattr(soak, "LEVEL_WINDOW_S", 0.3)
    growing = [100.0 * 1.05**i for i in range(200)]
    run, took = asyncio.run(_settle(_ok, growing, settle_max_s=1.0))
    assert 0.9 < took < 4.0 and not soak.levelled(run.footprints, ["prefill0"])


def test_a_request_that_fails_while_settling_stops_the_soak(monkeypatch):
    monkeypatch.setattr(soak, "SAMPLE_S", 0.1)

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prefill instance down"}}, status=502)

    with pytest.raises(KVPushError, match="settling failed, no soak: failed prefill instance"):
        asyncio.run(_settle(refuse, [100.0], settle_max_s=0.5))


# -- the load: at least --requests, and on until the last fault is over ---------------


async def _load(fault_seconds: float, least: int, rate: float) -> tuple[soak.Soak, int, float]:
    """A load of at least `least` requests at `rate` on a stand-in deployment, whose
    faults take `fault_seconds` in all: the Soak, how many it sent, and when (seconds
    from the start) the faults were over."""
    run = soak.Soak(soak.Settings(seed=3, max_faults=1, fault_interval_s=1.0), Path("unused"))
    run.prefill, run.decode = ["prefill0"], []
    run._footprint = lambda name: (100.0, 100)  # type: ignore[method-assign]
    started = time.monotonic()
    over: list[float] = []

    async def faults(done: asyncio.Event) -> None:
        await asyncio.sleep(fault_seconds)
        over.append(time.monotonic() - started)

    run._inject = faults  # type: ignore[method-assign]
    shapes = mix.mix(least * 4, 3, 2048, 0.0)
    app = web.Application()
    app.router.add_post(mix.COMPLETIONS, _ok)
    app.router.add_post(mix.CHAT, _ok)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        sent = await run._load(session, url, shapes, rate, least=least)
    return run, sent, over[0]


def test_the_load_goes_on_past_its_requests_until_the_faults_are_over():
    # 10 requests at 20 a second take half a second; the faults take 1.5 s.
    run, sent, over = asyncio.run(_load(1.5, least=10, rate=20.0))
    assert len(run.records) == sent and sorted(r.index for r in run.records) == list(range(sent))
    assert 10 < sent < 40  # more than the least, and not the whole mix
    # The last request went out before the faults were over, and none long after.
    assert max(r.sent_s for r in run.records) <= over + 0.5

    # Faults over before the least is sent: exactly the least.
    run, sent, _ = asyncio.run(_load(0.05, least=10, rate=20.0))
    assert sent == 10 and len(run.records) == 10


def test_the_plain_instance_is_asked_at_most_compare_answers_spread_over_the_run():
    asked: list[int] = []

    async def plain(request: web.Request) -> web.StreamResponse:
        asked.append(json.loads(await request.text())["max_tokens"])
        return await _ok(request)

    async def reference(compare: int | None) -> dict[int, list[str] | None]:
        run = soak.Soak(soak.Settings(seed=3, compare=compare), Path("unused"))
        shapes = [s for s in mix.mix(200, 3, 2048, 0.0) if s.deterministic][:40]
        run.records = [Record(s.index, {}, 0.0, 1.0, OK) for s in shapes]
        app = web.Application()
        app.router.add_post(mix.COMPLETIONS, plain)
        app.router.add_post(mix.CHAT, plain)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("")).rstrip("/")
            run.cluster = SimpleNamespace(servers={soak.PLAIN: SimpleNamespace(url=url)})
            return await run._reference(session, shapes)

    answers = asyncio.run(reference(10))
    indexes = sorted(answers)
    assert len(indexes) == len(asked) == 10
    every = sorted(asyncio.run(reference(None)))
    assert len(every) == 40 and indexes == every[::4]  # evenly spread, not the first ten
