"""A streaming client's first token from the prefill leg, at the router.

Real HTTP on loopback, the router in front of small vLLM-shaped servers (as in
test_router_app): the order in which the client is told things, what each leg is
sent, and the paths real vLLM rarely takes (a first token decode samples otherwise,
a decode that breaks off mid-stream). tests/e2e checks every request shape against
a plain vLLM instance.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from test_router_app import ECHO, Fake, _close, _serve, run

from kvpush.identities import PROMPT_CUT
from kvpush.router.first_token import DecodeEdit, First, Opening, opening

PROMPT = [11, 12, 13]
TOKENS = [(7, "A"), (8, "B"), (9, "C")]  # what both engines generate, in order


def prefill_answer(chat: bool = False, n: int = 1):
    """vLLM's one-token answer: the first of TOKENS for every choice."""

    async def answer(request: web.Request, body: dict) -> web.Response:
        params = {**ECHO, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
        token, text = TOKENS[0]
        choices = []
        for index in range(n):
            choice: dict[str, Any] = {"index": index, "finish_reason": "length",
                                      "token_ids": [token], "logprobs": None}  # fmt: skip
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, prompt_token_ids=PROMPT)
            choices.append(choice)
        top = {"prompt_token_ids": PROMPT} if chat else {}
        return web.json_response({
            "id": "cmpl-prefill", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": n},
            "kv_transfer_params": params, **top,
        })  # fmt: skip

    return answer


def _event(chat: bool, index: int, token: int, text: str, finish: str | None) -> bytes:
    if chat:
        choice = {"index": index, "delta": {"content": text}, "token_ids": [token]}
    else:
        choice = {"index": index, "text": text, "token_ids": [token]}
    choice["finish_reason"] = finish
    event = {"id": "cmpl-decode", "created": 2, "model": "m", "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n".encode()


def decode_stream(
    tokens=TOKENS, go: asyncio.Event | None = None, chat: bool = False, die_after: int = 0
):
    """vLLM's stream of `tokens` (the last finishing), after `go` if given; with
    die_after, the connection breaks after that many tokens instead. A continuation
    (a prompt of token ids, no transfer) gets the tokens after those it was given."""

    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        sent = tokens
        if "kv_transfer_params" not in body:  # a continuation
            sent = TOKENS[len(body["prompt"]) - len(PROMPT) :]
        elif chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            await stream.write(f"data: {json.dumps({'choices': [role]})}\n\n".encode())
        if go is not None:
            await go.wait()
        for i, (token, text) in enumerate(sent):
            if die_after and i == die_after:
                request.transport.close()
                return stream
            finish = "length" if i == len(sent) - 1 else None
            await stream.write(
                _event(chat and "kv_transfer_params" in body, 0, token, text, finish)
            )
        usage = {"prompt_tokens": len(PROMPT), "completion_tokens": len(sent),
                 "total_tokens": len(PROMPT) + len(sent)}  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            await stream.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    return answer


BODY = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 3, "temperature": 0.7,
        "stream_options": {"include_usage": True}}  # fmt: skip


async def _post(url: str, body: dict, path: str = "/v1/completions") -> tuple[int, list[dict]]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as response:
        return response.status, await _events(response)


async def _events(response: aiohttp.ClientResponse) -> list[dict]:
    events = []
    async for line in response.content:
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
    return events


def _text(events: list[dict]) -> str:
    return "".join(
        c.get("text") or (c.get("delta") or {}).get("content") or ""
        for e in events
        for c in e.get("choices") or []
    )


def test_the_client_has_prefills_token_before_decode_says_anything():
    async def scenario():
        go = asyncio.Event()
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream(go=go))
        router, runner, url = await _serve([prefill], [decode])
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions",
                                                              json=BODY) as r:  # fmt: skip
            assert r.status == 200
            first = json.loads((await r.content.readline())[6:])
            assert first["choices"][0]["text"] == "A" and first["id"] == "cmpl-prefill"
            go.set()  # only now may decode stream
            rest = await _events(r)
        assert _text([first, *rest]) == "ABC"
        assert all(e["id"] == "cmpl-prefill" for e in rest)  # one stream, one id
        assert rest[-1]["usage"]["completion_tokens"] == 3
        assert all(c.get("token_ids") is None for e in rest for c in e["choices"])
        # Both legs sample alike: the client's parameters, one seed the router chose.
        (p,), (d,) = prefill.bodies, decode.bodies
        assert p["max_tokens"] == 1 and p["temperature"] == 0.7 and not p.get("stream")
        assert p["seed"] == d["seed"] == router.traces[-1]["seed"]
        assert p["return_token_ids"] and d["return_token_ids"] and d["stream"]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_clients_seed_reaches_both_legs_as_it_is():
    async def scenario():
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream())
        router, runner, url = await _serve([prefill], [decode])
        _, events = await _post(url, {**BODY, "seed": 42})
        assert _text(events) == "ABC"
        assert prefill.bodies[0]["seed"] == decode.bodies[0]["seed"] == 42
        assert "seed" not in router.traces[-1]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_with_the_switch_off_the_first_token_waits_for_decode():
    async def scenario():
        go = asyncio.Event()
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream(go=go))
        _, runner, url = await _serve([prefill], [decode], first_token=False)
        answer = asyncio.ensure_future(_post(url, BODY))
        done, _ = await asyncio.wait({answer}, timeout=0.5)
        assert not done, "the client was answered before decode said anything"
        go.set()
        _, events = await answer
        assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC"
        assert prefill.bodies[0]["temperature"] == 0 and "seed" not in prefill.bodies[0]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_several_choices_are_relayed_from_decode_as_before():
    async def scenario():
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream())
        _, runner, url = await _serve([prefill], [decode])
        _, events = await _post(url, {**BODY, "n": 2, "seed": 3})
        assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC"
        leg = prefill.bodies[0]  # one engine request, as decode's siblings expect
        assert "n" not in leg and "seed" not in leg and leg["temperature"] == 0
        await _close(runner, [prefill, decode])

    run(scenario())


def test_structured_output_is_relayed_from_decode_as_before():
    """A continuation would start the grammar over: structured output never takes
    the first-token path, whose divergences and recoveries continue choices."""

    async def scenario():
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream())
        _, runner, url = await _serve([prefill], [decode])
        grammars = [{"response_format": {"type": "json_object"}},
                    {"structured_outputs": {"regex": "[A-C]+"}},
                    {"guided_choice": ["ABC"]}]  # fmt: skip
        for grammar in grammars:
            _, events = await _post(url, {**BODY, **grammar})
            assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC", grammar
        _, events = await _post(url, {**BODY, "response_format": {"type": "text"}})
        assert events[0]["id"] != "cmpl-decode"  # plain text: prefill's token first
        await _close(runner, [prefill, decode])

    run(scenario())


def test_chat_gets_one_role_chunk_then_prefills_token():
    async def scenario():
        prefill = Fake(prefill_answer(chat=True))
        decode = Fake(decode_stream(chat=True))
        _, runner, url = await _serve([prefill], [decode])
        body = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
        _, events = await _post(url, body, "/v1/chat/completions")
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert sum("role" in d for d in deltas) == 1 and _text(events) == "ABC"
        assert events[0]["object"] == "chat.completion.chunk"
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_first_token_decode_samples_otherwise_is_continued_from_prefills():
    async def scenario():
        prefill = Fake(prefill_answer())
        decode = Fake(decode_stream(tokens=[(99, "Z"), (98, "Y"), (97, "X")]))
        router, runner, url = await _serve([prefill], [decode])
        _, events = await _post(url, BODY)
        assert _text(events) == "ABC"  # decode's own Z, Y, X never reach the client
        assert events[-1]["usage"]["completion_tokens"] == 3
        continuation = decode.bodies[1]
        assert continuation["prompt"] == [*PROMPT, 7] and continuation["max_tokens"] == 2
        assert continuation["seed"] == decode.bodies[0]["seed"]
        assert router.metrics.counter("first_token_divergences") == 1
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_decode_that_breaks_off_is_continued_on_another_from_what_the_client_has():
    async def scenario():
        prefill = Fake(prefill_answer())
        dying, other = Fake(decode_stream(die_after=2)), Fake(decode_stream())
        _, runner, url = await _serve([prefill], [dying, other])
        for _ in range(2):  # round robin: the second request starts on `other`
            _, events = await _post(url, BODY)
            assert _text(events) == "ABC" and not any("error" in e for e in events)
            assert events[-1]["usage"]["completion_tokens"] == 3
        assert [b["prompt"] for b in other.bodies if "kv_transfer_params" not in b] == [
            [*PROMPT, 7, 8]
        ]
        await _close(runner, [prefill, dying, other])

    run(scenario())


def test_a_decode_that_refuses_after_the_first_token_is_an_error_in_the_stream_naming_it():
    """Sequential legs (the router has not met prefill yet): the client has its
    first token without waiting for decode to take its leg."""

    async def failing(request: web.Request, body: dict) -> web.Response:
        return web.json_response({"error": {"message": "engine dead"}}, status=503)

    async def scenario():
        prefill, decode = Fake(prefill_answer()), Fake(failing)
        _, runner, url = await _serve([prefill], [decode])
        status, events = await _post(url, BODY)
        # The client had prefill's token; decode refused, and so did the continuation.
        assert status == 200 and _text(events) == "A"
        (error,) = [e["error"]["message"] for e in events if "error" in e]
        assert decode.url in error and "engine dead" in error, error
        assert len(decode.bodies) == 2  # the leg, then the continuation
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_choice_ended_at_its_first_token_leaves_decodes_leg_to_finish_unread():
    """max_tokens 1: prefill's token is the whole answer. Decode's leg is not cut
    (prefill would hold KV nobody claims for its lease) but read to its end."""

    async def scenario():
        go = asyncio.Event()
        prefill, decode = Fake(prefill_answer()), Fake(decode_stream(tokens=TOKENS[:1], go=go))
        router, runner, url = await _serve([prefill], [decode])
        status, events = await _post(url, {**BODY, "max_tokens": 1})
        assert status == 200 and _text(events) == "A"
        assert events[0]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 1
        go.set()
        while router._draining:
            await asyncio.sleep(0.01)
        assert decode.cancelled == 0
        await _close(runner, [prefill, decode])

    run(scenario())


def test_decode_holding_back_text_prefill_already_gave_is_not_sent_twice():
    """vLLM holds back streamed text that may begin a stop string; prefill's whole
    answer did not. Decode's first token comes without its text, which arrives with
    the second: the client gets it once."""
    first = First(token=7, text="ab", prompt=PROMPT, finished=False)
    edit = DecodeEdit(Opening([{"id": "x", "created": 1}], {0: first}, 3), False, True)
    held = {"choices": [{"index": 0, "text": "", "token_ids": [7]}]}
    late = {"choices": [{"index": 0, "text": "abcd", "token_ids": [8]}]}
    assert edit.edit(held) == (None, [])
    out, diverged = edit.edit(late)
    assert out["choices"][0]["text"] == "cd" and out["choices"][0]["token_ids"] == [8]
    assert not diverged and edit.choices[0].had == [7, 8]


def test_an_answer_this_path_cannot_stand_on_is_no_opening():
    body = {"max_tokens": 4}
    tool_call = {"choices": [{"index": 0, "token_ids": [7], "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}}],
        "prompt_token_ids": PROMPT, "usage": {"prompt_tokens": 3}}  # fmt: skip
    assert opening(tool_call, body, chat=True) is None
    no_ids = {"choices": [{"index": 0, "text": "A"}], "usage": {"prompt_tokens": 3}}
    assert opening(no_ids, body, chat=False) is None
    # A recurrent-state model's prefill leg stopped before the prompt's last token.
    whole = {"choices": [{"index": 0, "text": "A", "token_ids": [7],
             "prompt_token_ids": PROMPT}], "usage": {"prompt_tokens": 3}}  # fmt: skip
    assert opening(whole, body, chat=False) is not None
    cut = {**whole, "kv_transfer_params": {PROMPT_CUT: True}}
    assert opening(cut, body, chat=False) is None


def test_a_chat_choice_continues_as_a_completion_of_its_token_ids_shown_as_chat():
    from kvpush.router.first_token import as_client_event, continuation_leg

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_completion_tokens": 5, "min_tokens": 2, "temperature": 0.5, "seed": 9,
            "logprobs": True, "top_logprobs": 1, "n": 1, "cache_salt": "s"}  # fmt: skip
    leg = continuation_leg(body, PROMPT, [7, 8], chat=True)
    assert leg["prompt"] == [*PROMPT, 7, 8] and "messages" not in leg
    assert leg["cache_salt"] == "s"  # or decode's cached prompt is not found
    assert leg["max_tokens"] == 3 and leg["min_tokens"] == 0 and leg["logprobs"] == 1
    assert leg["seed"] == 9 and leg["temperature"] == 0.5 and "max_completion_tokens" not in leg
    logprobs = {"tokens": ["C"], "token_logprobs": [-0.5], "top_logprobs": [{"C": -0.5}]}
    event = {"id": "c", "choices": [{"index": 0, "text": "C", "token_ids": [9],
             "finish_reason": "length", "stop_reason": None, "logprobs": logprobs}]}  # fmt: skip
    out = as_client_event(event, 2, True, {"id": "x", "created": 1}, wants_ids=False)
    (choice,) = out["choices"]
    assert out["id"] == "x" and out["object"] == "chat.completion.chunk"
    assert choice["index"] == 2 and choice["delta"] == {"content": "C"}
    assert choice["finish_reason"] == "length" and choice["token_ids"] is None
    assert choice["logprobs"]["content"][0]["logprob"] == -0.5
    assert choice["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "C"
