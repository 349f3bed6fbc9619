"""The decode leg's answer to the client: a relay object, chosen once per dispatch.

`Relay` passes decode's answer through as it comes, streamed or not; its subclass
`FirstTokenRelay` (first_token_relay.py) opens a streaming client's answer with the
prefill leg's token. The router (app.py) picks one per request and asks it what each
leg is sent and how decode's answer reaches the client; neither knows the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.metrics import Metrics
from kvpush.router import request as req
from kvpush.router.instances import Instance, Pool
from kvpush.router.legs import prefill_leg
from kvpush.router.sse import Rewriter, first_word, whole_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeLeg:
    """A decode leg on its way: the client's request, the leg posted to `decode` (the
    future of its answer) and prefill's answer, as a relay takes them."""

    request: web.Request
    decode: Instance
    endpoint: str
    leg: dict[str, Any]
    headers: dict[str, str]
    posted: asyncio.Future
    prefill_answer: asyncio.Future
    body: dict[str, Any]


@dataclass
class Relay:
    """Decode's answer, passed through as it comes."""

    http: Callable[[], aiohttp.ClientSession]
    metrics: Metrics
    decode: Pool  # where a broken stream continues (FirstTokenRelay)
    eject: Callable[[Instance], None]  # an instance out of the pick for a cooldown
    draining: set[asyncio.Future] = field(default_factory=set)  # decode legs nobody reads

    def seeded(self, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """The body both legs are built from, and the seed minted for it (None)."""
        return body, None

    def prefill_leg(self, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
        return prefill_leg(body, transfer_id)

    def decode_leg(self, leg: dict[str, Any]) -> dict[str, Any]:
        return leg

    async def relay(self, d: DecodeLeg) -> web.StreamResponse:
        """The client's answer from the decode leg (sent already)."""
        return await self.stream(d.request, d.decode, d.endpoint, d.leg, d.posted)

    async def stream(
        self,
        request: web.Request,
        decode: Instance,
        endpoint: str,
        leg: dict[str, Any],
        posted: asyncio.Future,
        rewrite: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> web.StreamResponse:
        """Pass the decode leg's answer through, streamed if it streams; each streamed
        event through `rewrite` if given."""
        trace: req.Trace = request[req.TRACE]
        stream: web.StreamResponse | None = None
        try:
            async with await posted as response:
                if response.status >= 400:
                    raise await self.refused(decode, leg, response)
                if not leg.get("stream"):
                    return self._whole(decode, endpoint, trace, await response.read())
                # Answer the client only once decode has produced something: until then a
                # failed leg can still become a proper error status, or a retry.
                chunks = response.content.iter_any()
                head = b""
                async for chunk in chunks:
                    head += chunk
                    if (word := first_word(head)) is not None:
                        break
                else:
                    word = None
                if word and "error" in word:
                    self.metrics.inc("leg_failures", leg="decode", why="error_event")
                    raise await self.kvpush_reason(decode, leg, req.error_event(decode, word))
                trace.mark("first_byte")
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await stream.prepare(request)
                request[req.ANSWERED] = True
                rewriter = Rewriter(rewrite) if rewrite is not None else None
                await stream.write(rewriter.feed(head) if rewriter else head)
                async for chunk in chunks:
                    await stream.write(rewriter.feed(chunk) if rewriter else chunk)
                if rewriter is not None:
                    await stream.write(rewriter.rest())
                await stream.write_eof()
                self.metrics.inc("requests", endpoint=endpoint, status="200")
                return stream
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as exc:
            if stream is not None:
                return self._cut(stream, decode, endpoint, exc)
            self.metrics.inc("leg_failures", leg="decode", why=req.cause(exc))
            message = f"decode instance {decode.url} failed: {req.describe(exc)}"
            raise req.LegFailed(502, message, instance=decode) from exc

    def _whole(
        self, decode: Instance, endpoint: str, trace: req.Trace, payload: bytes
    ) -> web.Response:
        """A whole (unstreamed) answer, checked to be one."""
        if not whole_json(payload):
            # Headers came, then the connection ended: a decode that died
            # mid-answer. Passing the stub on would be a 200 with no answer.
            self.metrics.inc("leg_failures", leg="decode", why="cut_short")
            message = (
                f"decode instance {decode.url} ended its answer early "
                f"({len(payload)} bytes, not a whole JSON object)"
            )
            raise req.LegFailed(502, message, instance=decode)
        trace.mark("first_byte")
        self.metrics.inc("requests", endpoint=endpoint, status="200")
        return web.Response(body=payload, content_type="application/json")

    async def refused(
        self, decode: Instance, leg: dict[str, Any], response: aiohttp.ClientResponse
    ) -> req.LegFailed:
        """A decode leg answered with an error status: the failure, with kvpush's
        reason if kvpush failed it."""
        text = (await response.read()).decode(errors="replace")
        self.metrics.inc("leg_failures", leg="decode", why=str(response.status))
        failure = req.LegFailed(
            response.status, req.upstream_message(decode, text), instance=decode
        )
        return await self.kvpush_reason(decode, leg, failure)

    def _cut(
        self, stream: web.StreamResponse, decode: Instance, endpoint: str, exc: BaseException
    ) -> web.StreamResponse:
        """A stream the client was already reading broke. Leaving the decode leg's
        context closed its connection, so vLLM aborts it; whose fault was it?"""
        upstream = (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            asyncio.TimeoutError,
        )
        if isinstance(exc, upstream):
            self.metrics.inc("leg_failures", leg="decode", why=req.cause(exc))
            log.warning("kvpush router: decode %s broke off a stream: %s", decode.url, exc)
        else:
            self.metrics.inc("client_disconnects", endpoint=endpoint)
        return stream

    async def kvpush_reason(
        self, decode: Instance, leg: dict[str, Any], failure: req.LegFailed
    ) -> req.LegFailed:
        """A decode leg that failed on the server side: if kvpush failed it (its KV
        could not be loaded), the decode instance's trace says why, and the client is
        told that rather than vLLM's bare "Internal server error"."""
        transfer_id = (leg.get("kv_transfer_params") or {}).get("transfer_id")
        if failure.status < 500 or not decode.identity_url or not transfer_id:
            return failure
        url = decode.identity_url.removesuffix("/query") + "/kvpush/trace?last=512"
        try:
            async with self.http().get(url, timeout=aiohttp.ClientTimeout(total=5)) as answer:
                traces = await answer.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return failure
        reasons = [
            t["error"] for t in traces if t.get("transfer_id") == transfer_id and t.get("error")
        ]
        if not reasons:
            return failure
        self.metrics.inc("kv_load_failures")
        message = f"decode instance {decode.url} could not load the prompt's KV: {reasons[-1]}"
        log.warning("kvpush router: %s", message)  # the client is told; the operator too
        return req.LegFailed(failure.status, message, "kv_transfer_error", instance=decode)
