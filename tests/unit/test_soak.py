"""The soak's pure parts: its request mix, which fault explains which failure, how a
client reads an answer, and the verdict it draws from a run."""

from __future__ import annotations

import asyncio
import json

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


def test_greedy_and_seeded_requests_are_compared_and_n2_is_seeded():
    for shape in mix.mix(300, 3, LIMIT, 0.0):
        assert shape.deterministic
        if shape.n == 2:
            assert "seed" in shape.body and shape.body["temperature"] > 0
        else:
            assert shape.body["temperature"] == 0
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
    fault_list = [_fault(1, 99.0, 120.0)]
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
    assert "--rate and --load must be positive" in capsys.readouterr().err
