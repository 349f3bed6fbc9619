"""Open-loop load for `kvpush bench serve`: Poisson arrivals of streamed completions
(and paced(), the soak's arrivals, which may stop early).

Each request is a prompt of token ids, greedy, a fixed number of output tokens
(ignore_eos), streamed, so every token's arrival time is seen. A request goes either
straight to one URL (a plain instance, or a router that sends both legs) or, for
upstream's pull connector, through the two legs its own toy proxy sends: prefill
first, then decode with the prefill answer's kv_transfer_params; or, for upstream's
push connector, both legs at once, paired by a shared X-Request-Id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MODEL = "tiny"


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds since it was sent)."""

    ok: bool
    ttft: float = 0.0
    t2t: float | None = None  # when the second token arrived (None: fewer than two)
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class Target:
    """Where requests go: `url` answers OpenAI completions; `two_legs` makes the
    client send upstream's prefill leg to `prefill_url` first, or alongside when
    `concurrent_decode_params` are what the decode leg carries."""

    url: str
    model: str = MODEL
    two_legs: bool = False
    prefill_url: str = ""
    concurrent_decode_params: dict[str, Any] | None = None


def prompts(count: int, length: int, seed: int, vocab: int = 2040) -> list[list[int]]:
    """Fresh token-id prompts (ids above the tiny model's six special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 6 + vocab) for _ in range(length)] for _ in range(count)]


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times of a Poisson process of `rate` requests a second, from 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def paced(
    count: int, rate: float, seed: int, send: Callable[[int], Awaitable[None]],
    least: int, enough: asyncio.Event,
) -> int:  # fmt: skip
    """send(0), send(1), ... at the arrival times of a Poisson process of `rate` a
    second (`seed`): the first `least` whatever happens, the rest until `enough` is
    set, at most `count`. Back once every send has returned; how many were made."""
    start = time.monotonic()
    sending = []
    for index, at in enumerate(arrivals(count, rate, seed)):
        delay = start + at - time.monotonic()
        if index < least:
            await asyncio.sleep(max(0.0, delay))
        elif await _set_within(enough, delay):
            break
        sending.append(asyncio.ensure_future(send(index)))
    await asyncio.gather(*sending)
    return len(sending)


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` is set within `seconds` (at once when it is already)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), max(0.0, seconds))
    return event.is_set()


async def run(
    target: Target, batch: list[list[int]], send_at: list[float], output_tokens: int,
    timeout_s: float = 600.0,
) -> list[Outcome]:  # fmt: skip
    """Send each prompt at its time; every outcome, in prompt order."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.monotonic()

        async def one(tokens: list[int], at: float) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            try:
                return await _request(session, target, tokens, output_tokens)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return Outcome(False, error=f"{type(exc).__name__}: {exc}")

        return list(await asyncio.gather(*(one(p, t) for p, t in zip(batch, send_at, strict=True))))


async def _request(
    session: aiohttp.ClientSession, target: Target, tokens: list[int], output_tokens: int
) -> Outcome:
    body: dict[str, Any] = {
        "model": target.model, "prompt": tokens, "max_tokens": output_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    sent = time.monotonic()
    headers: dict[str, str] = {}
    prefill: asyncio.Task | None = None
    if target.two_legs:
        upstream_prefill = {"do_remote_decode": True, "do_remote_prefill": False}
        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": upstream_prefill}
        if target.concurrent_decode_params is None:
            answer = await _prefill_leg(session, target.prefill_url, leg, headers)
            if isinstance(answer, Outcome):
                return answer
            body["kv_transfer_params"] = answer.get("kv_transfer_params")
        else:
            rid = uuid.uuid4().hex
            headers["X-Request-Id"] = rid
            body["kv_transfer_params"] = {
                **target.concurrent_decode_params, "remote_request_id": f"cmpl-{rid}-0"
            }  # fmt: skip
            prefill = asyncio.create_task(_prefill_leg(session, target.prefill_url, leg, headers))
    outcome = await _decode_leg(session, target.url, body, headers, sent)
    if prefill is not None:
        answer = await prefill
        if isinstance(answer, Outcome) and outcome.ok:
            return answer
    return outcome


async def _prefill_leg(
    session: aiohttp.ClientSession, url: str, leg: dict, headers: dict[str, str]
) -> dict | Outcome:
    """The prefill answer, or a failed Outcome saying why."""
    async with session.post(url + "/v1/completions", json=leg, headers=headers) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            return Outcome(False, error=f"prefill leg {response.status}: {answer}")
        return answer


async def _decode_leg(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str], sent: float
) -> Outcome:
    outcome = Outcome(True)
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            return Outcome(False, error=f"HTTP {response.status}: {await response.text()}")
        async for chunk in sse_chunks(response):
            if "error" in chunk:
                return Outcome(False, error=str(chunk["error"]))
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids") or []
                if not (ids or choice.get("text")):
                    continue
                now = time.monotonic() - sent
                outcome.token_times.append(now)
                outcome.token_ids += ids
                # Counted in tokens, not chunks: one chunk may carry the first two.
                arrived = len(outcome.token_ids) if ids else len(outcome.token_times)
                if outcome.t2t is None and arrived >= 2:
                    outcome.t2t = now
                outcome.text += choice.get("text") or ""
    if not outcome.token_times:
        return Outcome(False, error="the stream ended without a token")
    outcome.ttft = outcome.token_times[0]
    return outcome


class StreamCut(aiohttp.ClientPayloadError):
    """A stream ended without `data: [DONE]`: cut off, whatever it carried so far."""


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI server-sent-event stream, up to `data: [DONE]`;
    StreamCut if the stream ends before that."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])
    raise StreamCut("the stream ended without data: [DONE]")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET `url`'s JSON answer; None where there is none (not serving, an older kvpush
    without that path, or not JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
