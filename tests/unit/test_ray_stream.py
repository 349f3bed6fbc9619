"""kvpush's Ray decode replica: a streaming client's first token from the prefill leg.

The replica's engine is a stand-in that streams as Ray's LLMServer does (lists of
`data: ...` strings); the paths real vLLM rarely takes are driven here: a first token
decode samples otherwise, and a decode leg that fails mid-stream. The whole Ray
application runs in tests/e2e/test_ray_pd.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.llm", reason="Ray Serve LLM is not installed: pip install -e .[ray]")

from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from test_ray_serve import PEER, _backend

from kvpush import ray_stream
from kvpush.ray_stream import PREFILL_ANSWER, KVPushDecodeServer, _FirstTokenEngine, seed_of

PROMPT = [5, 6, 7]


def _event(token: int, text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "token_ids": [token], "logprobs": None,
              "finish_reason": finish, "stop_reason": None}  # fmt: skip
    event = {"id": "cmpl-decode", "object": "text_completion", "created": 2, "model": "tiny",
             "choices": [choice]}  # fmt: skip
    return "data: " + json.dumps(event) + "\n\n"


class Engine:
    """LLMServer.completions as the replica's engine answers: the decode leg's stream
    (a request with kv_transfer_params), else a continuation's."""

    def __init__(self, decode: list[Any], continuation: list[Any] | None = None) -> None:
        self.decode, self.continuation = decode, continuation or []
        self.requests: list[Any] = []
        self.running = 0  # streams neither read to their end nor closed
        self.running_at_end = -1  # as the client's stream ended
        self.running_at_continuation = -1  # as a continuation was asked for

    async def completions(self, server: Any, request: Any) -> Any:
        self.requests.append(request)
        script = self.decode if request.kv_transfer_params else self.continuation
        if not request.kv_transfer_params:
            self.running_at_continuation = self.running

        async def stream():
            self.running += 1
            try:
                for batch in script:
                    if isinstance(batch, asyncio.Event):  # decode still generating
                        await batch.wait()
                        continue
                    yield batch
            finally:
                self.running -= 1

        return stream()


TEXTS = {7: "A", 8: "B", 9: "C", 4: "X", 3: "Y"}


class Tokenizer:
    """The replica's tokenizer: the ids' texts (TEXTS)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(TEXTS.get(i, f"<{i}>") for i in ids)


class _Server(KVPushDecodeServer):
    """The replica without its Serve deployment around it (nor an engine to shut down)."""

    def __del__(self) -> None:
        pass


def _prefill_answer(token: int = 7, text: str = "A") -> dict[str, Any]:
    return {"id": "cmpl-prefill", "object": "text_completion", "created": 1, "model": "tiny",
              "choices": [{"index": 0, "text": text, "token_ids": [token], "logprobs": None,
                           "finish_reason": "length", "stop_reason": None,
                           "prompt_token_ids": PROMPT}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip


def _prefill_stream() -> Any:
    """Prefill's answer as Ray's prefill handle streams it: one response object."""

    async def stream():
        answer = _prefill_answer()
        yield SimpleNamespace(model_dump=lambda: answer)

    return stream()


def _stream(
    engine: Engine,
    monkeypatch,
    first_token: bool = True,
    sequential: bool = False,
    **request: Any,
) -> list:
    """The client's events from the replica, with prefill answering token 7 ("A"):
    both legs at once, or (`sequential`) prefill's answer carried by the decode leg."""
    # A function, so that Ray's own path (super() in its mixin) binds it too.
    monkeypatch.setattr(LLMServer, "completions", lambda s, r, raw=None: engine.completions(s, r))
    server = object.__new__(_Server)
    backend = SimpleNamespace(first_token=first_token)
    server._get_connector_backend = lambda: backend
    # Ray's engine, as far as the replica reads it: its vLLM client's tokenizer.
    renderer = SimpleNamespace(get_tokenizer=Tokenizer)
    server.engine = SimpleNamespace(_engine_client=SimpleNamespace(renderer=renderer))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0,
            "stream": True, **request}  # fmt: skip
    params: dict[str, Any] = {"do_remote_prefill": True}
    if sequential:
        params[PREFILL_ANSWER] = _prefill_answer()
    decode = CompletionRequest(**body, kv_transfer_params=params)

    async def read():
        out = []
        if sequential:  # what Ray's orchestrator calls: its super(), the replica's engine
            stream = await _FirstTokenEngine.completions(server, decode)
        else:
            stream = server._concurrent_decode("completions", decode, _prefill_stream(), None)
        async for batch in stream:
            for item in batch:
                payload = item.removeprefix("data: ").strip()
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        engine.running_at_end = engine.running
        return out

    return asyncio.run(read())


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def test_the_first_token_is_prefills_and_decodes_stream_follows_from_its_second(monkeypatch):
    engine = Engine([[_event(7, "A")], [_event(8, "B"), _event(9, "C", "length")],
                     ["data: [DONE]\n\n"]])  # fmt: skip
    events = _stream(engine, monkeypatch)
    assert events[0]["id"] == "cmpl-prefill" and events[0]["choices"][0]["text"] == "A"
    assert _text(events) == "ABC" and events[-1] == "[DONE]"
    assert all(e["id"] == "cmpl-prefill" for e in events[:-1])  # ids are prefill's throughout
    (decode,) = engine.requests
    assert decode.return_token_ids  # to check decode's first token against prefill's


def test_a_first_token_decode_samples_otherwise_is_continued_from_prefills(monkeypatch):
    engine = Engine(
        [[_event(8, "B")], [_event(9, "C")], ["data: [DONE]\n\n"]],
        continuation=[[_event(4, "X"), _event(3, "Y", "length")], ["data: [DONE]\n\n"]],
    )
    events = _stream(engine, monkeypatch)
    assert _text(events) == "AXY"
    # decode's own stream closed before the continuation started: its request aborted
    assert engine.running_at_continuation == 0 and engine.running_at_end == 0
    decode, continuation = engine.requests
    assert continuation.prompt == [*PROMPT, 7] and continuation.max_tokens == 2
    assert continuation.request_id != decode.request_id


def test_a_decode_leg_that_fails_mid_stream_is_continued_from_what_the_client_has(monkeypatch):
    failure = {"error": {"message": "engine died", "type": "x", "param": None, "code": 500}}
    engine = Engine(
        [[_event(7, "A"), _event(8, "B")], ["data: " + json.dumps(failure) + "\n\n"]],
        continuation=[[_event(9, "C", "length")], ["data: [DONE]\n\n"]],
    )
    events = _stream(engine, monkeypatch, max_tokens=3)
    assert _text(events) == "ABC" and not any("error" in e for e in events if e != "[DONE]")
    assert engine.requests[1].prompt == [*PROMPT, 7, 8] and engine.requests[1].max_tokens == 1


def test_usage_counts_what_the_client_got(monkeypatch):
    engine = Engine(
        [[_event(8, "B")], ["data: [DONE]\n\n"]],
        continuation=[[_event(4, "X"), _event(3, "Y", "length")], ["data: [DONE]\n\n"]],
    )
    events = _stream(engine, monkeypatch, stream_options={"include_usage": True})
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 3


def test_switched_off_the_stream_is_decodes_own(monkeypatch):
    engine = Engine([[_event(7, "A"), _event(8, "B"), _event(9, "C", "length")],
                     ["data: [DONE]\n\n"]])  # fmt: skip
    events = _stream(engine, monkeypatch, first_token=False)
    assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC"


def test_an_unseeded_sampled_stream_is_decodes_own_where_seeds_cannot_rewind(monkeypatch):
    """vLLM's CPU build: a seed minted for both legs would kill the engine, so none
    is, and the client's first token is decode's."""
    monkeypatch.setattr(ray_stream, "seeds_rewind", lambda: False)
    backend = _backend("push")
    backend.first_token = True
    request = CompletionRequest(model="tiny", prompt=PROMPT, max_tokens=20, stream=True,
                                temperature=1.0)  # fmt: skip
    prefill = backend.prepare_prefill_request(request=request, peer=PEER)
    decode = backend.prepare_decode_request(request=request, peer=PEER, prefill_response=None)
    assert prefill.seed is None and decode.seed is None and prefill.max_tokens == 1
    assert not prefill.return_token_ids  # the plain prefill leg: greedy, one token
    greedy = request.model_copy(update={"temperature": 0.0})
    assert backend.prepare_prefill_request(request=greedy, peer=PEER).return_token_ids
    engine = Engine([[_event(7, "A"), _event(8, "B"), _event(9, "C", "length")],
                     ["data: [DONE]\n\n"]])  # fmt: skip
    events = _stream(engine, monkeypatch, temperature=1.0)
    assert events[0]["id"] == "cmpl-decode" and _text(events) == "ABC"


def test_both_legs_of_an_unseeded_stream_sample_with_one_seed_from_the_transfer_id(monkeypatch):
    monkeypatch.setattr(ray_stream, "seeds_rewind", lambda: True)  # vLLM on CUDA
    backend = _backend("push")
    backend.first_token = True
    request = CompletionRequest(model="tiny", prompt=PROMPT, max_tokens=20, stream=True,
                                temperature=1.0, logprobs=2)  # fmt: skip
    prefill = backend.prepare_prefill_request(request=request, peer=PEER)
    decode = backend.prepare_decode_request(request=request, peer=PEER, prefill_response=None)
    seed = seed_of(prefill.kv_transfer_params["transfer_id"])
    assert prefill.seed == decode.seed == seed
    # The prefill leg samples the client's first token: its parameters kept, one token.
    assert (prefill.max_tokens, prefill.temperature, prefill.logprobs) == (1, 1.0, 2)
    assert prefill.return_token_ids and not prefill.stream
    # A client's own seed is both legs'; a non-streaming request is cut as before.
    seeded = request.model_copy(update={"seed": 11})
    assert backend.prepare_prefill_request(request=seeded, peer=PEER).seed == 11
    whole = request.model_copy(update={"stream": False})
    assert backend.prepare_prefill_request(request=whole, peer=PEER).seed is None


def test_a_sequential_hand_off_opens_with_the_prefill_answer_its_decode_leg_carries(monkeypatch):
    engine = Engine([[_event(7, "A")], [_event(8, "B"), _event(9, "C", "length")],
                     ["data: [DONE]\n\n"]])  # fmt: skip
    events = _stream(engine, monkeypatch, sequential=True)
    assert events[0]["id"] == "cmpl-prefill" and _text(events) == "ABC"
    (decode,) = engine.requests  # the engine never sees prefill's answer
    assert PREFILL_ANSWER not in decode.kv_transfer_params and decode.return_token_ids


def test_a_sequential_decode_leg_carries_prefills_answer_and_its_seed(monkeypatch):
    monkeypatch.setattr(ray_stream, "seeds_rewind", lambda: True)  # vLLM on CUDA
    backend = _backend("pull")
    backend.first_token = True
    request = CompletionRequest(model="tiny", prompt=PROMPT, max_tokens=20, stream=True,
                                temperature=1.0)  # fmt: skip
    prefill = backend.prepare_prefill_request(request=request, peer=None)
    echo = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "p"}
    answer = SimpleNamespace(kv_transfer_params=echo, model_dump=_prefill_answer)
    decode = backend.prepare_decode_request(request=request, peer=None, prefill_response=answer)
    assert decode.seed == prefill.seed == seed_of(prefill.kv_transfer_params["transfer_id"])
    assert decode.kv_transfer_params == {**echo, PREFILL_ANSWER: _prefill_answer()}
    backend.first_token = False  # Ray's own decode replica: the echo alone
    decode = backend.prepare_decode_request(request=request, peer=None, prefill_response=answer)
    assert decode.kv_transfer_params == echo and decode.seed is None


@pytest.mark.timeout(20)
def test_a_choice_ended_at_its_first_token_gets_done_without_waiting_for_decode(monkeypatch):
    """max_tokens 1: prefill's token is the answer; [DONE] goes out at once while
    decode's leg (which must still claim the KV) is read to its end behind it."""
    generating = asyncio.Event()
    engine = Engine([generating, [_event(7, "A", "length")], ["data: [DONE]\n\n"]])
    events = _stream(engine, monkeypatch, max_tokens=1)  # waiting on decode: a hang
    assert _text(events) == "A" and events[-1] == "[DONE]"
    assert len(engine.requests) == 1  # decode's leg was sent, and is drained unread


def test_a_relayed_stream_carries_token_ids_only_when_the_client_asked():
    from kvpush.router.first_token import as_asked

    chunk = [_event(7, "A"), "data: [DONE]\n\n"]
    (event, done) = ray_stream._rewritten(chunk, as_asked({"stream": True}))
    assert json.loads(event.removeprefix("data: "))["choices"][0]["token_ids"] is None
    assert done == "data: [DONE]\n\n"
    kept = ray_stream._rewritten(chunk, as_asked({"return_token_ids": True}))
    assert json.loads(kept[0].removeprefix("data: "))["choices"][0]["token_ids"] == [7]
