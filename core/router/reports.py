"""What the router tells about itself and its instances: /health, /v1/models,
/metrics, and /kvpush/trace (the last requests' milestones and routes)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.metrics import Metrics
from kvpush.router.health import HealthWatch
from kvpush.router.instances import Pool
from kvpush.router.legs import openai_error
from kvpush.router.request import Trace

# Router histograms: (name, from milestone, to milestone).
SPANS = (
    ("router_dispatch_seconds", "received", "decode_sent"),
    ("router_prefill_leg_seconds", "prefill_sent", "prefill_answered"),
    ("router_decode_first_byte_seconds", "decode_sent", "first_byte"),
    ("router_first_byte_seconds", "received", "first_byte"),
)


@dataclass
class Reports:
    mode: str
    prefill: Pool
    decode: Pool
    metrics: Metrics
    watch: HealthWatch
    http: Callable[[], aiohttp.ClientSession]
    forwarded: Callable[[web.Request], dict[str, str]]
    traces: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=512))

    async def models(self, request: web.Request) -> web.Response:
        instance = self.decode.pick()
        headers = self.forwarded(request)
        try:
            async with self.http().get(instance.url + "/v1/models", headers=headers) as response:
                return web.json_response(await response.json(), status=response.status)
        except aiohttp.ClientError as exc:
            return web.json_response(
                openai_error(
                    f"decode instance {instance.url} unreachable: {exc}", "upstream_error", 502
                ),
                status=502,
            )

    async def health(self, request: web.Request) -> web.Response:
        everyone = self.prefill.instances + self.decode.instances
        problems = await asyncio.gather(*(self.watch.probe(i) for i in everyone))
        states = [problem is None for problem in problems]
        report = {
            i.url: {
                "role": i.role,
                "healthy": ok,
                "outstanding": i.outstanding,
                "computing_tokens": i.computing,
                "draining": i.draining,
            }
            for i, ok in zip(everyone, states, strict=True)
        }
        prefill_ok = any(ok for i, ok in zip(everyone, states, strict=True) if i.role == "prefill")
        decode_ok = any(ok for i, ok in zip(everyone, states, strict=True) if i.role == "decode")
        status = 200 if prefill_ok and decode_ok else 503
        return web.json_response({"mode": self.mode, "instances": report}, status=status)

    async def trace(self, request: web.Request) -> web.Response:
        """The last N requests' milestones (?last=N, default 100), oldest first."""
        try:
            last = int(request.query.get("last", "100"))
        except ValueError:
            last = 100
        return web.json_response(list(self.traces)[-last:])

    def record(self, trace: Trace) -> None:
        for name, start, end in SPANS:
            seconds = trace.since(start, end)
            if seconds is not None:
                self.metrics.observe(name, seconds)
        self.traces.append(trace.as_dict())

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.metrics.prometheus(prefix="kvpush_"), content_type="text/plain"
        )
