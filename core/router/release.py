"""Prefill KV that no decode will claim, let go at the router's word.

Decode tells prefill when a leg its engine took in ends unclaimed (docs/protocol.md).
A decode leg that never reached decode's engine tells nobody: decode refused it with
an error status before any stream (a `max_tokens` beyond its `max_model_len`, which
the first-token path's one-token prefill leg passes), decode was unreachable, or
the router closed the leg (its client gone) before decode answered. Prefill would
hold that KV for its lease. Its answer carries a release token
(kvpush.identities.RELEASE_TOKEN), and the router hands it back to prefill's
identity endpoint (`POST /kvpush/release`) once it knows both that the decode leg
failed so and what prefill answered, in whichever order they come. Prefill keeps
KV a decode instance claimed or announced after all, so a leg that did reach decode
loses nothing.

Fire and forget: bounded by RELEASE_TIMEOUT, counted in `prefill_releases{outcome}`,
logged at debug, never in the client's way. The token is for the router alone:
nothing a client gets is built from prefill's kv_transfer_params.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp

from kvpush.identities import RELEASE_PATH, RELEASE_TOKEN
from kvpush.metrics import Metrics
from kvpush.router.instances import Instance

log = logging.getLogger(__name__)

RELEASE_TIMEOUT = aiohttp.ClientTimeout(total=5)  # prefill answers within about 2 s
# Prefill's answers, as the metric's outcome: released; asked, not answered in time
# (it goes ahead); kept (a decode claimed or announced it after all); nothing held
# (claimed and delivered already); a token refused (a restart since, or no secret).
OUTCOMES = {200: "released", 202: "pending", 409: "kept", 404: "unknown", 403: "refused"}


def untaken(leg: asyncio.Future) -> bool:
    """Whether a decode leg's request (done) ended before decode's engine could be
    holding it: cancelled or failed before decode answered, or answered with an error
    status. vLLM aborts a request whose connection closes, so none of these goes on."""
    if leg.cancelled() or leg.exception() is not None:
        return True
    return leg.result().status >= 400


def release_url(prefill: Instance, params: dict[str, Any]) -> str | None:
    """Where the engine that answered takes a release: the identity endpoint the
    router was given for the instance, at the port of the data-parallel rank the echo
    names (DP rank d answers at the endpoint's port + d, as the router learnt the
    ranks); without one, the endpoint the echo names (`remote_host`, `remote_port`)."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if prefill.identity_url:
        known = urllib.parse.urlsplit(prefill.identity_url)
        rank = params.get("remote_dp_rank", 0)
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
        host, port = known.hostname, (known.port or 80) + rank
    if not (isinstance(host, str) and host and type(port) is int):
        return None
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{port}{RELEASE_PATH}"


class PrefillReleases:
    """The router's releases of prefill KV, in flight."""

    def __init__(self, http: Callable[[], aiohttp.ClientSession], metrics: Metrics) -> None:
        self._http = http
        self.metrics = metrics
        self._posting: set[asyncio.Future] = set()  # kept referenced until done

    def watch(self, leg: asyncio.Future, prefill: Instance, answer: asyncio.Future) -> None:
        """`leg` is a decode leg's request, `answer` its prefill leg's: if the decode
        leg ends untaken, prefill lets go of the KV once it has answered (a prefill
        leg cancelled or failed frees its own)."""

        def decode_done(leg: asyncio.Future) -> None:
            if untaken(leg):
                answer.add_done_callback(lambda done: self._release(prefill, done))

        leg.add_done_callback(decode_done)

    async def close(self) -> None:
        """Let the releases in flight end (each is bounded)."""
        if self._posting:
            await asyncio.gather(*self._posting, return_exceptions=True)

    def _release(self, prefill: Instance, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return
        params = answer.result().get("kv_transfer_params") or {}
        token, transfer_id = params.get(RELEASE_TOKEN), params.get("transfer_id")
        url = release_url(prefill, params)
        if not (isinstance(token, str) and isinstance(transfer_id, str) and url):
            # An instance without a secret, or one older than release tokens.
            self.metrics.inc("prefill_releases", outcome="no_token")
            return
        task = asyncio.ensure_future(self._post(url, transfer_id, token))
        self._posting.add(task)
        task.add_done_callback(self._posting.discard)

    async def _post(self, url: str, transfer_id: str, token: str) -> None:
        body = {"transfer_id": transfer_id, "token": token}
        try:
            async with self._http().post(url, json=body, timeout=RELEASE_TIMEOUT) as response:
                outcome = OUTCOMES.get(response.status, "failed")
                detail = (await response.text())[:300]
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
            # RuntimeError: the router's session closed under it, at shutdown.
            outcome, detail = "unreachable", str(exc) or type(exc).__name__
        self.metrics.inc("prefill_releases", outcome=outcome)
        log.debug("kvpush router: release of %s at %s: %s %s", transfer_id, url, outcome, detail)
