"""Ray Serve LLM's decode replica, streaming a client's first token from prefill.

Ray's orchestrator (Ray 2.60, `PDOrchestratorMixin`) streams the decode leg's answer
alone: with both legs at once (push) it drains the prefill leg's answer unread, and
one after the other (pull) it reads only its kv_transfer_params. Either way a
streaming client's first token waits for decode's first step. `KVPushDecodeServer`
opens the client's stream with the token of prefill's answer instead, and decode's
stream follows from its second token, edited as kvpush router edits it
(kvpush.router.first_token holds what each leg is sent and how decode's events are
edited; docs/routing.md, 3a). Decode's first token is checked against prefill's; if
they differ, or decode's leg fails after the client has its first token, the choice
continues on this replica's engine from the prompt plus the tokens the client has.

    app = kvpush.ray_serve.build_pd_app(config)   # instead of build_pd_openai_app

Turned off per deployment by `"experimental_configs": {"kvpush_first_token": False}`
in the decode config. With Ray's default connector backend (kvpush's not registered)
the replica is Ray's as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import (
    CompletionRequest,
    ErrorResponse,
)
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer

from kvpush.router import first_token, sse
from kvpush.router.continuation import Departed, continuation_leg, text_in_context
from kvpush.router.legs import openai_error
from kvpush.vllm.compat import seeds_rewind

log = logging.getLogger(__name__)

SWITCH = "kvpush_first_token"  # in the decode config's experimental_configs
# Where a sequential hand-off's decode leg carries prefill's answer to the replica,
# which takes it out before the engine sees the leg.
PREFILL_ANSWER = "kvpush_prefill_answer"
DONE = "data: [DONE]\n\n"


def seed_of(transfer_id: str) -> int:
    """The seed both legs of an unseeded request sample with: from its transfer id,
    since Ray prepares the two legs in separate calls that share nothing else."""
    return int(hashlib.sha256(transfer_id.encode()).hexdigest()[:8], 16) % 2**31


def as_body(request: Any) -> dict[str, Any]:
    """A Ray request model as kvpush router would have its JSON: fields left unset
    absent (chat's max_completion_tokens of None must not hide its max_tokens)."""
    return request.model_dump(exclude_none=True)


def serves(request: Any) -> bool:
    """Whether a request's first token can come from its prefill leg (decided in the
    decode replica, which prepares both legs, on its own engine's platform)."""
    return first_token.serves(as_body(request), seeds_rewind=seeds_rewind())


class _FirstTokenEngine(LLMServer):
    """The replica's own engine as Ray's orchestrator calls it for the decode leg
    (its `super()`): a sequential hand-off's decode leg carries prefill's answer, put
    there by kvpush's backend, and is streamed behind its token."""

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        return await self._decode_leg("completions", request, raw_request_info)

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        return await self._decode_leg("chat", request, raw_request_info)

    async def _decode_leg(self, method: str, request: Any, raw_request_info: Any) -> Any:
        params = dict(getattr(request, "kv_transfer_params", None) or {})
        answer = params.pop(PREFILL_ANSWER, None)
        if answer is None:
            return await getattr(LLMServer, method)(self, request, raw_request_info)
        request.kv_transfer_params = params
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        ready.set_result(answer)
        return self._opened(method, request, raw_request_info, ready)

    async def _opened(
        self, method: str, decode_request: Any, raw_request_info: Any, answer: asyncio.Future
    ) -> AsyncIterator[Any]:
        """The client's stream: prefill's token as soon as `answer` (prefill's whole
        answer) is there, then decode's leg from its second token."""
        body = as_body(decode_request)
        decode_request.return_token_ids = True  # to check decode's first token
        local = None
        try:
            local = await getattr(LLMServer, method)(self, decode_request, raw_request_info)
            answered = await answer
            if isinstance(answered, ErrorResponse) or answered is None:
                yield answered or [_error("the prefill leg answered nothing")]
                return
            if not isinstance(answered, dict):
                answered = answered.model_dump()
            edit = first_token.DecodeEdit.start(answered, body, method == "chat")
            if edit is None:  # not an answer this path can stand on: decode's stream
                asked = first_token.as_asked(body)
                async for chunk in local:
                    yield _rewritten(chunk, asked)
                return
            yield [_encode(event) for event in edit.opening.events]
            if edit.unfinished():
                body["request_id"] = decode_request.request_id  # Serve's, stamped by now
                async for out in self._edited(local, edit, body):
                    yield out
            else:  # decode computes one token nobody reads; its leg still claims the KV
                _drain(local)
                local = None
            yield [*(_encode(event) for event in edit.ending()), DONE]
        finally:
            if local is not None:  # a diverged choice's own stream is read no further
                with contextlib.suppress(BaseException):
                    await local.aclose()  # aborts decode's request if it still runs

    async def _edited(
        self, local: Any, edit: first_token.DecodeEdit, body: dict[str, Any]
    ) -> AsyncIterator[list[str]]:
        """Decode's events through `edit`; the choice continued here instead where its
        first token diverged or decode's leg failed."""
        why = None
        async with contextlib.aclosing(_events(local)) as decoded:
            async for event in decoded:
                actions = edit.feed(event)  # a diverged choice is continued below
                sent = [_encode(a.event) for a in actions if isinstance(a, first_token.Send)]
                if sent:
                    yield sent
                stop = next((a for a in actions if isinstance(a, first_token.Stop)), None)
                if stop is not None:  # closed on leaving: decode stops generating
                    why = stop.error and json.dumps(stop.error["error"])[:300]
                    break
        if why is not None:
            log.warning("kvpush: decode's leg failed mid-stream (%s); continuing here", why)
        for index in [i for i, c in edit.choices.items() if c.elsewhere] + edit.unfinished():
            async for out in self._continued(edit, body, index):
                yield out

    async def _continued(
        self, edit: first_token.DecodeEdit, body: dict[str, Any], index: int
    ) -> AsyncIterator[list[str]]:
        """Choice `index` from a completions request of its own: its prompt plus the
        tokens the client has (this engine's prefix cache holds the prompt's KV)."""
        state = edit.choices[index]
        if state.ended:
            return
        try:
            text_of = text_in_context(state.first.prompt, lambda ids: self._detokenize(body, ids))
            had = await edit.resume(index, text_of)
            leg = continuation_leg(body, state.first.prompt, had, edit.chat)
            base = body.get("request_id") or "kvpush"
            request = CompletionRequest.model_validate(
                {**leg, "request_id": f"{base}-continued-{index}-{len(had)}"}
            )
            stream = await LLMServer.completions(self, request, None)
            async for event in _events(stream):
                if "error" in event:
                    raise Departed(json.dumps(event["error"]))
                out = edit.continued(index, event)
                if out is not None:
                    yield [_encode(out)]
        except Departed as exc:
            failure = f"choice {index} could not be continued: {exc}"
            yield [_encode(openai_error(failure[:500], "upstream_error", 502))]

    async def _detokenize(self, body: dict[str, Any], ids: list[int]) -> str:
        """The text of token ids, as this replica's tokenizer reads them. Ray's engine
        serves no tokenization task, so the tokenizer is its vLLM engine client's
        (`renderer`, part of vLLM's EngineClient), reached through Ray's engine."""
        renderer = getattr(getattr(self.engine, "_engine_client", None), "renderer", None)
        if renderer is None:
            raise Departed("this replica's engine offers no tokenizer to read token ids with")
        return renderer.get_tokenizer().decode(ids, skip_special_tokens=True)


class KVPushDecodeServer(PDDecodeServer, _FirstTokenEngine):
    """Ray's decode replica, with a streaming client's first token from prefill."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:
        await super().__init__(llm_config, **kwargs)
        backend = self._get_connector_backend()
        if hasattr(backend, "first_token"):  # kvpush's backend (kvpush.ray_serve)
            backend.first_token = bool(llm_config.experimental_configs.get(SWITCH, True))

    async def _concurrent_decode(
        self,
        method: str,
        decode_request: Any,
        prefill_resp: Any,
        raw_request_info: Any,
        *,
        cancel_on_failure: bool = True,
    ) -> AsyncIterator[Any]:
        if not (getattr(self._get_connector_backend(), "first_token", False)
                and serves(decode_request)):  # fmt: skip
            async for chunk in super()._concurrent_decode(
                method, decode_request, prefill_resp, raw_request_info,
                cancel_on_failure=cancel_on_failure,
            ):  # fmt: skip
                yield chunk
            return
        # The prefill leg is always read to its end: Ray's replica accounting fires then.
        prefill = asyncio.ensure_future(_answer(prefill_resp))
        try:
            async for chunk in self._opened(method, decode_request, raw_request_info, prefill):
                yield chunk
        finally:
            try:
                await prefill
            except Exception as exc:  # the client has its answer or an error already
                log.error("kvpush: the prefill leg failed: %s", exc)


_DRAINING: set[asyncio.Task] = set()  # referenced until done, or the loop may drop them


def _drain(local: Any) -> None:
    """Every choice ended at its first token: the client's stream ends now, and
    decode's leg is read to its end behind it (an abort before decode claimed the KV
    would leave prefill holding it for its lease)."""

    async def drain() -> None:
        with contextlib.suppress(Exception):
            async for _ in local:
                pass

    task = asyncio.ensure_future(drain())
    _DRAINING.add(task)
    task.add_done_callback(_DRAINING.discard)


def _rewritten(chunk: Any, edit: Any) -> Any:
    """A batch of Ray's `data: ...` strings with each JSON event through `edit`."""
    if not isinstance(chunk, list):
        return chunk
    out = []
    for item in chunk:
        event = sse.data(item) if isinstance(item, str) else None
        out.append(_encode(edit(event)) if isinstance(event, dict) else item)
    return out


async def _answer(prefill_resp: Any) -> Any:
    """The prefill leg's answer (its first item), read to the end."""
    answer = None
    async for chunk in prefill_resp:
        if answer is None:
            answer = chunk
    return answer


async def _events(stream: Any) -> AsyncIterator[dict[str, Any]]:
    """An engine stream's events as JSON, up to [DONE] or an error, when the stream is
    closed: Ray yields lists of `data: ...` strings, and an ErrorResponse where the
    engine failed."""
    try:
        async for batch in stream:
            for item in batch if isinstance(batch, list) else [batch]:
                if isinstance(item, ErrorResponse):
                    yield item.model_dump()
                    return
                for line in str(item).splitlines():
                    event = sse.data(line)
                    if event is sse.END:
                        return
                    if event is not None:
                        yield event
    finally:
        with contextlib.suppress(BaseException):
            await stream.aclose()


def _encode(event: dict[str, Any]) -> str:
    return sse.encode(event).decode()


def _error(message: str) -> str:
    return _encode(openai_error(message, "upstream_error", 502))
