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
from kvpush.router.first_token import Continue, DecodeEdit, First, Opening, Send, Stop, opening

PROMPT = [11, 12, 13]
TOKENS = [(7, "A"), (8, "B"), (9, "C")]  # what both engines generate, in order


def prefill_answer(chat: bool = False, n: int = 1, rewinds: bool = False):
    """vLLM's one-token answer: the first of TOKENS for every choice; `rewinds`: its
    identity says its generators rewind (vLLM on CUDA)."""

    async def answer(request: web.Request, body: dict) -> web.Response:
        params = {**ECHO, "transfer_id": body["kv_transfer_params"]["transfer_id"],
                  "remote_seeds_rewind": rewinds}  # fmt: skip
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


def _event(
    chat: bool,
    index: int,
    token: int,
    text: str,
    finish: str | None,
    stop_reason: str | None = None,
    prompt_ids: list[int] | None = None,
) -> bytes:
    if chat:
        choice = {"index": index, "delta": {"content": text}, "token_ids": [token]}
    else:
        choice = {"index": index, "text": text, "token_ids": [token],
                  "prompt_token_ids": prompt_ids}  # fmt: skip
    choice["finish_reason"] = finish
    if finish:
        choice["stop_reason"] = stop_reason
    event = {"id": "cmpl-decode", "created": 2, "model": "m", "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n".encode()


def decode_stream(
    tokens=TOKENS,
    go: asyncio.Event | None = None,
    chat: bool = False,
    die_after: int = 0,
    stop: tuple[str, str | None] = ("length", None),
    prompt_ids: bool = False,
):
    """vLLM's stream of `tokens` (the last finishing for `stop`'s reason), after `go`
    if given; with die_after, a decode leg's connection breaks after that many tokens.
    A continuation (a prompt of token ids, no transfer) gets the tokens after those
    it was given. `prompt_ids`: the first event carries the prompt's."""

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
            if die_after and i == die_after and "kv_transfer_params" in body:
                request.transport.close()
                return stream
            last = i == len(sent) - 1
            event = _event(chat and "kv_transfer_params" in body, 0, token, text,
                           stop[0] if last else None, stop[1] if last else None,
                           PROMPT if prompt_ids and i == 0 else None)  # fmt: skip
            await stream.write(event)
        usage = {"prompt_tokens": len(PROMPT), "completion_tokens": len(sent),
                 "total_tokens": len(PROMPT) + len(sent)}  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            await stream.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    return answer


BODY = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 3, "temperature": 0.7,
        "seed": 5, "stream_options": {"include_usage": True}}  # fmt: skip


def decode_fake(answer) -> Fake:
    """A decode instance whose tokenizer reads TOKENS' ids as their texts."""
    fake = Fake(answer)
    fake.texts = dict(TOKENS)
    return fake


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
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream(go=go))
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
        # Both legs sample alike: the client's parameters and seed.
        (p,), (d,) = prefill.bodies, decode.bodies
        assert p["max_tokens"] == 1 and p["temperature"] == 0.7 and not p.get("stream")
        assert p["seed"] == d["seed"] == 5 and "seed" not in router.traces[-1]
        assert p["return_token_ids"] and d["return_token_ids"] and d["stream"]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_clients_seed_reaches_both_legs_as_it_is():
    async def scenario():
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream())
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
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream(go=go))
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
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream())
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
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream())
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
        decode = decode_fake(decode_stream(chat=True))
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
        decode = decode_fake(decode_stream(tokens=[(99, "Z"), (98, "Y"), (97, "X")]))
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
        dying, other = decode_fake(decode_stream(die_after=2)), decode_fake(decode_stream())
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
        prefill, decode = Fake(prefill_answer()), decode_fake(failing)
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
        prefill = Fake(prefill_answer())
        decode = decode_fake(decode_stream(tokens=TOKENS[:1], go=go))
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
    first = First(token=7, text="ab", prompt=PROMPT, finished=False, shown="ab")
    edit = DecodeEdit(Opening([{"id": "x", "created": 1}], {0: first}, 3), False, True)
    held = {"choices": [{"index": 0, "text": "", "token_ids": [7]}]}
    late = {"choices": [{"index": 0, "text": "abcd", "token_ids": [8]}]}
    assert edit.edit(held) == (None, [])
    out, diverged = edit.edit(late)
    assert out["choices"][0]["text"] == "cd" and out["choices"][0]["token_ids"] == [8]
    assert not diverged and edit.choices[0].had == [7, 8]


def test_feed_says_what_each_of_decodes_events_asks_of_the_shell():
    """One place decides, for the router and Ray alike: send, continue a diverged
    choice elsewhere, or stop reading decode (an error, or nothing left for it)."""
    firsts = {i: First(token=7, text="a", prompt=PROMPT, finished=False, shown="a") for i in (0, 1)}
    edit = DecodeEdit(Opening([{"id": "x", "created": 1}], firsts, 3), False, True)
    same = {"choices": [{"index": 0, "text": "ab", "token_ids": [7, 8]}]}
    [send] = edit.feed(same)
    assert isinstance(send, Send) and send.event["choices"][0]["text"] == "b"
    other = {"choices": [{"index": 1, "text": "z", "token_ids": [9]}]}
    assert edit.feed(other) == [Continue(1)]  # choice 0 is decode's still: read on
    ends = {"choices": [{"index": 0, "text": "c", "token_ids": [3], "finish_reason": "stop"}]}
    assert isinstance(edit.feed(ends)[0], Send) and not edit.unfinished()
    error = {"error": {"message": "boom"}}
    assert edit.feed(error) == [Stop(error)]

    alone = DecodeEdit(Opening([{"id": "x", "created": 1}], {0: firsts[0]}, 3), False, True)
    assert alone.feed(other | {"choices": [{"index": 0, "text": "z", "token_ids": [9]}]}) == [
        Continue(0),
        Stop(),
    ]


def test_an_edit_starts_only_from_an_answer_it_can_stand_on_and_ends_with_usage_if_asked():
    answer = {"id": "x", "created": 1, "choices": [{"index": 0, "text": "a", "token_ids": [7],
              "prompt_token_ids": PROMPT}], "usage": {"prompt_tokens": 3}}  # fmt: skip
    body = {"stream": True, "stream_options": {"include_usage": True}}
    edit = DecodeEdit.start(answer, body, chat=False)
    assert edit is not None and edit.ending()[0]["usage"]["completion_tokens"] == 1
    assert DecodeEdit.start(answer, {"stream": True}, chat=False).ending() == []
    assert DecodeEdit.start({"choices": []}, body, chat=False) is None


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
    from kvpush.router.continuation import as_client_event, continuation_leg

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


def test_an_unseeded_sampled_stream_gets_decodes_first_token_where_seeds_cannot_rewind():
    """A seed minted for both legs kills a CPU engine that computes the request's
    prompt in chunks: no instance said its generators rewind, so no seed is minted
    and the stream is decode's own, counted by why."""

    async def scenario():
        prefill, decode = Fake(prefill_answer()), decode_fake(decode_stream())
        router, runner, url = await _serve([prefill], [decode])
        unseeded = {k: v for k, v in BODY.items() if k != "seed"}
        for _ in range(2):  # sequential legs first, then both at once
            _, events = await _post(url, unseeded)
            assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC"
        assert all(b.get("seed") is None for b in prefill.bodies + decode.bodies)
        assert all("seed" not in t for t in router.traces)
        assert router.metrics.counter("first_token_from_decode", why="unseeded_sampling") == 2
        # Greedy needs no seed: served from prefill, none minted.
        _, events = await _post(url, {**unseeded, "temperature": 0})
        assert events[0]["id"] == "cmpl-prefill" and _text(events) == "ABC"
        assert prefill.bodies[-1].get("seed") is None
        await _close(runner, [prefill, decode])

    run(scenario())


def test_an_unseeded_sampled_stream_gets_one_minted_seed_where_the_pair_rewinds_seeds():
    async def scenario():
        prefill, decode = Fake(prefill_answer(rewinds=True)), decode_fake(decode_stream())
        router, runner, url = await _serve([prefill], [decode])
        unseeded = {k: v for k, v in BODY.items() if k != "seed"}
        _, events = await _post(url, unseeded)  # prefill not met yet: decode's token
        assert events[0]["id"] == "cmpl-decode"
        _, events = await _post(url, unseeded)
        assert events[0]["id"] == "cmpl-prefill" and _text(events) == "ABC"
        seed = router.traces[-1]["seed"]
        assert prefill.bodies[-1]["seed"] == decode.bodies[-1]["seed"] == seed
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_stop_string_that_starts_in_the_first_token_holds_its_text_back_as_vllm_does():
    """stop ["AB"], tokens "A" then "B": a plain instance streams "A" never (held
    back, then cut with the stop string); prefill's whole one-token answer has it."""

    async def scenario():
        prefill = Fake(prefill_answer())
        decode = decode_fake(decode_stream(tokens=[(7, ""), (8, "")], stop=("stop", "AB")))
        _, runner, url = await _serve([prefill], [decode])
        for _ in range(2):
            _, events = await _post(url, {**BODY, "stop": ["AB"]})
            assert _text(events) == "" and events[0]["id"] == "cmpl-prefill"
            assert events[-2]["choices"][0]["finish_reason"] == "stop"
        # A stop the first token cannot begin: its text goes out at once.
        _, events = await _post(url, {**BODY, "stop": ["Q"]})
        assert events[0]["choices"][0]["text"] == "A"
        await _close(runner, [prefill, decode])

    run(scenario())


def test_text_decode_held_back_before_it_broke_off_is_generated_again_not_skipped():
    """stop ["xyz"] holds back two characters: decode streams A and B as "" and dies.
    The continuation starts from the prompt, not after B, and the client reads ABC."""

    async def scenario():
        prefill = Fake(prefill_answer())
        dying = decode_fake(decode_stream(tokens=[(7, ""), (8, ""), (9, "ABC")], die_after=2))
        _, runner, url = await _serve([prefill], [dying])
        body = {**BODY, "stop": ["xyz"], "return_token_ids": True}
        for _ in range(2):
            _, events = await _post(url, body)
            assert _text(events) == "ABC" and not any("error" in e for e in events)
            ids = [i for e in events for c in e.get("choices") or [] for i in c["token_ids"] or []]
            assert ids == [7, 8, 9]  # each once, though 7 and 8 were generated twice
            assert events[-1]["usage"]["completion_tokens"] == 3
        continuation = [b for b in dying.bodies if "kv_transfer_params" not in b][-1]
        assert continuation["prompt"] == PROMPT and continuation["max_tokens"] == 3
        await _close(runner, [prefill, dying])

    run(scenario())


def test_a_continuation_resumes_inside_a_token_whose_text_the_client_has_in_part():
    """The client has "Hel" of token "Hello" (the rest held back): the continuation
    starts before that token and the client gets only "lo" of it."""
    first = First(token=7, text="Hello", prompt=PROMPT, finished=False, shown="Hel")
    edit = DecodeEdit(Opening([{"id": "x", "created": 1}], {0: first}, 3), False, True)
    texts = {7: "Hello", 8: " world"}

    async def text_of(ids: list[int]) -> str:
        return "".join(texts[i] for i in ids)

    assert asyncio.run(edit.resume(0, text_of)) == []
    again = {"choices": [{"index": 0, "text": "Hello", "token_ids": [7]}]}
    out = edit.continued(0, again)
    assert out["choices"][0]["text"] == "lo" and out["choices"][0]["token_ids"] == []
    more = {"choices": [{"index": 0, "text": " world", "token_ids": [8]}]}
    assert edit.continued(0, more)["choices"][0]["token_ids"] == [8]
    assert edit.choices[0].had == [7, 8] and edit.choices[0].sent == "Hello world"


def test_a_relayed_stream_carries_token_ids_only_when_the_client_asked():
    """An answer the first-token path cannot stand on (no token ids) is relayed from
    decode, whose leg asked for ids to check: vLLM sends null where nobody asked."""

    async def no_ids(request: web.Request, body: dict) -> web.Response:
        params = {**ECHO, "transfer_id": body["kv_transfer_params"]["transfer_id"]}
        return web.json_response({"id": "p", "choices": [{"index": 0, "text": "A"}],
                                  "usage": {"prompt_tokens": 3},
                                  "kv_transfer_params": params})  # fmt: skip

    async def scenario():
        prefill, decode = Fake(no_ids), decode_fake(decode_stream(prompt_ids=True))
        router, runner, url = await _serve([prefill], [decode])
        _, events = await _post(url, BODY)
        assert _text(events) == "ABC" and events[0]["id"] == "cmpl-decode"
        assert all(e.get("prompt_token_ids") is None for e in events)
        assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None
                   for e in events for c in e.get("choices") or [])  # fmt: skip
        _, events = await _post(url, {**BODY, "return_token_ids": True})
        assert [c["token_ids"] for e in events for c in e["choices"]] == [[7], [8], [9]]
        assert router.metrics.counter("first_token_unusable") == 2
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_diverged_decode_leg_is_closed_before_its_choice_is_continued():
    """Decode sampled another first token and would go on to max_tokens: its leg is
    closed at once, not left open beside the continuation on the same instance."""
    seen: list[int] = []

    async def scenario():
        prefill = Fake(prefill_answer())
        continuation = decode_stream()

        async def answer(request: web.Request, body: dict) -> web.StreamResponse:
            if "kv_transfer_params" not in body:
                await asyncio.sleep(0.2)  # the router's close reaches decode meanwhile
                seen.append(decode.cancelled)
                return await continuation(request, body)
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            for token in [99] + [98] * 1000:  # decode's own tokens, one a step
                await stream.write(_event(False, 0, token, "Z", None))
                await asyncio.sleep(0.01)
            return stream

        decode = decode_fake(answer)
        _, runner, url = await _serve([prefill], [decode])
        _, events = await _post(url, BODY)
        assert _text(events) == "ABC" and seen == [1]
        await _close(runner, [prefill, decode])

    run(scenario())


def test_a_prompt_with_media_is_relayed_from_decode():
    """A continuation is a completions request of token ids: an image or audio part
    of the prompt would not be in it, so such a stream never takes this path."""

    async def scenario():
        prefill = Fake(prefill_answer(chat=True))
        decode = decode_fake(decode_stream(chat=True))
        router, runner, url = await _serve([prefill], [decode])
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        content = [{"type": "text", "text": "what is this?"}, image]
        body = {**BODY, "messages": [{"role": "user", "content": content}]}
        _, events = await _post(url, body, "/v1/chat/completions")
        assert _text(events) == "ABC" and all(e.get("id") != "cmpl-prefill" for e in events)
        assert router.metrics.counter("first_token_from_decode", why="media") == 1
        text_only = {**BODY, "messages": [{"role": "user", "content": content[:1]}]}
        _, events = await _post(url, text_only, "/v1/chat/completions")
        assert events[0]["id"] == "cmpl-prefill"
        await _close(runner, [prefill, decode])

    run(scenario())
