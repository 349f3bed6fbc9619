"""The relay whose streaming client gets its first token from the prefill leg: its
I/O. What each leg is sent and how decode's events are edited is first_token.py's
(`DecodeEdit`); this module reads, writes and continues as it says.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import first_token
from kvpush.router import request as req
from kvpush.router.continuation import Departed, continuation_leg, text_in_context
from kvpush.router.first_token import Continue, DecodeEdit, Send
from kvpush.router.instances import Instance
from kvpush.router.legs import openai_error
from kvpush.router.relay import DecodeLeg, Relay
from kvpush.router.sse import encode, events

log = logging.getLogger(__name__)


class FirstTokenRelay(Relay):
    """A streaming client's first token from the prefill leg, the rest from decode."""

    def seeded(self, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        return first_token.with_seed(body)

    def prefill_leg(self, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
        return first_token.prefill_leg(body, transfer_id)

    def decode_leg(self, leg: dict[str, Any]) -> dict[str, Any]:
        return first_token.decode_leg(leg)

    async def relay(self, d: DecodeLeg) -> web.StreamResponse:
        """The decode leg (`posted`, its request, sent already), streamed, behind
        prefill's first token: the client is answered when prefill answers, without
        waiting for decode at all, and gets decode's stream from its second token on.
        The prefill leg has validated the client's parameters by then, so a decode
        leg that fails later has failed on its own: each unfinished choice continues
        from the tokens the client has, on another decode instance if there is one."""
        request, decode, endpoint, leg = d.request, d.decode, d.endpoint, d.leg
        headers, posted, prefill_answer, body = d.headers, d.posted, d.prefill_answer, d.body
        trace: req.Trace = request[req.TRACE]
        unread: asyncio.Future | None = posted  # to close when the client has its answer
        try:
            edit = DecodeEdit.start(
                await prefill_answer, body, endpoint.endswith("/chat/completions")
            )
            if edit is None:
                self.metrics.inc("first_token_unusable")
                return await self.stream(
                    request, decode, endpoint, leg, posted, first_token.as_asked(body)
                )
            if posted.done() and not posted.exception() and posted.result().status >= 400:
                raise await self.refused(decode, leg, posted.result())  # still retryable
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            request[req.ANSWERED] = True
            for event in edit.opening.events:
                await stream.write(encode(event))
            trace.mark("first_byte")
            why = None
            if edit.unfinished():
                why = await self._edited(stream, posted, decode, leg, body, edit, headers)
            else:
                self._drain(posted)
                unread = None
            if why is not None:
                await self._recover(stream, decode, body, edit, headers, why)
            for event in edit.ending():
                await stream.write(encode(event))
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
            self.metrics.inc("requests", endpoint=endpoint, status="200")
            return stream
        finally:
            # Closing the decode leg's connection makes vLLM abort it, if it runs still.
            if unread is not None:
                unread.cancel()
                if unread.done() and not unread.cancelled() and not unread.exception():
                    unread.result().close()

    async def _edited(
        self,
        stream: web.StreamResponse,
        posted: asyncio.Future,
        decode: Instance,
        leg: dict[str, Any],
        body: dict[str, Any],
        edit: DecodeEdit,
        headers: dict[str, str],
    ) -> str | None:
        """Decode's events through `edit` to the client, diverged choices continued
        beside them; None when decode's stream ended whole, else why it did not."""
        continuations: list[asyncio.Future] = []
        why = None
        try:
            response = await posted
            if response.status >= 400:  # nothing sent yet, nothing continued
                return (await self.refused(decode, leg, response)).message
            async for event in events(response.content):
                stop = None
                for action in edit.feed(event):
                    if isinstance(action, Send):
                        await stream.write(encode(action.event))
                    elif isinstance(action, Continue):
                        self.metrics.inc("first_token_divergences")
                        continuations.append(asyncio.ensure_future(
                            self._continue(stream, decode, body, edit, action.index, headers)
                        ))  # fmt: skip
                    else:
                        stop = action
                if stop is not None and stop.error is not None:
                    self.metrics.inc("leg_failures", leg="decode", why="error_event")
                    failure = req.error_event(decode, stop.error)
                    why = (await self.kvpush_reason(decode, leg, failure)).message
                    break
                if stop is not None:
                    response.close()  # so decode stops generating what nobody reads
                    break
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if isinstance(exc, ConnectionResetError):
                raise  # the client went away
            self.metrics.inc("leg_failures", leg="decode", why=req.cause(exc))
            self.eject(decode)
            why = f"decode instance {decode.url} failed: {req.describe(exc)}"
        try:
            await asyncio.gather(*continuations)
        finally:
            for task in continuations:
                task.cancel()
        return why if edit.unfinished() else None

    async def _recover(
        self,
        stream: web.StreamResponse,
        failed: Instance,
        body: dict[str, Any],
        edit: DecodeEdit,
        headers: dict[str, str],
        why: str,
    ) -> None:
        """The client holds the start of the answer: each unfinished choice goes on
        from there, on another decode instance where there is one."""
        log.warning("kvpush router: continuing a stream elsewhere: %s", why)
        self.metrics.inc("stream_continuations")
        target = self.decode.pick(avoid=failed)
        await asyncio.gather(
            *(self._continue(stream, target, body, edit, i, headers) for i in edit.unfinished())
        )

    async def _continue(
        self,
        stream: web.StreamResponse,
        decode: Instance,
        body: dict[str, Any],
        edit: DecodeEdit,
        index: int,
        headers: dict[str, str],
    ) -> None:
        """One choice, continued on `decode` from its prompt plus the tokens the client
        has. If that fails too, the client is told in the stream."""
        state = edit.choices[index]
        try:
            text_of = text_in_context(
                state.first.prompt, lambda ids: self._detokenize(decode, body, ids, headers)
            )
            had = await edit.resume(index, text_of)
            leg = continuation_leg(body, state.first.prompt, had, edit.chat)
            async with self.http().post(
                decode.url + "/v1/completions", json=leg, headers=headers
            ) as response:
                if response.status >= 400:
                    text = (await response.read()).decode(errors="replace")
                    raise req.LegFailed(response.status, req.upstream_message(decode, text))
                async for event in events(response.content):
                    out = edit.continued(index, event)
                    if out is not None:
                        await stream.write(encode(out))
        except (aiohttp.ClientError, asyncio.TimeoutError, req.LegFailed, Departed) as exc:
            if isinstance(exc, ConnectionResetError):
                raise  # the client went away
            message = exc.message if isinstance(exc, req.LegFailed) else req.describe(exc)
            failure = f"choice {index} could not be continued on {decode.url}: {message}"
            await stream.write(encode(openai_error(failure, "upstream_error", 502)))

    async def _detokenize(
        self,
        decode: Instance,
        body: dict[str, Any],
        ids: list[int],
        headers: dict[str, str],
    ) -> str:
        """The text of token ids, as `decode`'s tokenizer reads them."""
        request = {"model": body.get("model"), "tokens": ids}
        async with self.http().post(
            decode.url + "/detokenize", json=request, headers=headers
        ) as response:
            text = (await response.read()).decode(errors="replace")
            if response.status >= 400:
                raise req.LegFailed(response.status, req.upstream_message(decode, text))
            try:
                return json.loads(text)["prompt"]
            except (ValueError, KeyError, TypeError) as exc:
                raise req.LegFailed(
                    502, f"{decode.url}/detokenize answered {text[:200]!r}"
                ) from exc

    def _drain(self, posted: asyncio.Future) -> None:
        """Every choice ended at its first token, so the client needs nothing from
        decode; but its leg runs on, unread, to its end: an abort before decode
        claimed the KV would leave prefill holding it for its whole lease. Decode
        computes one token for it."""

        async def drain() -> None:
            try:
                async with await posted as response:
                    await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass

        task = asyncio.ensure_future(drain())
        self.draining.add(task)
        task.add_done_callback(self.draining.discard)
        self.metrics.inc("decode_legs_drained")
