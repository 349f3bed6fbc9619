"""What the router says when an instance's identity endpoint cannot be asked: the
connection refused, no answer in time, or an address that leads back to the
router's own host. Real sockets on loopback."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import aiohttp
import pytest

from kvpush.router import app
from kvpush.router.app import Router, RouterConfig
from kvpush.router.instances import Instance
from kvpush.router.reach import identity_unreachable
from kvpush.router.request import LegFailed

OLD_ADVICE = "is it running KVPushConnector with identity_port set?"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _learn(identity_url: str) -> str:
    prefill = Instance("http://127.0.0.1:1", "prefill", identity_url)
    router = Router(RouterConfig([prefill], [Instance("http://127.0.0.1:2", "decode")]))
    router.session = aiohttp.ClientSession()
    try:
        with pytest.raises(LegFailed) as failed:
            await router._learn_identity(prefill)
    finally:
        await router.session.close()
    return failed.value.message


def test_a_refused_connection_says_so():
    port = _closed_port()
    message = asyncio.run(_learn(f"http://127.0.0.1:{port}/query"))
    assert f"endpoint http://127.0.0.1:{port}/query refused the connection" in message
    assert f"is {port} its identity_port (identity= names it)?" in message
    assert "did not answer" not in message and OLD_ADVICE not in message


def test_a_listener_that_never_answers_times_out(monkeypatch):
    monkeypatch.setattr(app, "IDENTITY_TIMEOUT", aiohttp.ClientTimeout(total=0.5))
    monkeypatch.setattr(app, "IDENTITY_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # never accepts, never answers
        port = silent.getsockname()[1]
        message = asyncio.run(_learn(f"http://127.0.0.1:{port}/query"))
    assert f"{port}/query did not answer within 0.5s" in message
    assert "refused" not in message and OLD_ADVICE not in message


def test_a_loopback_identity_url_says_where_it_leads():
    message = asyncio.run(_learn(f"http://localhost:{_closed_port()}/query"))
    assert "localhost is a loopback address: it leads to the router's own host" in message
    assert "if the instance runs elsewhere, name it by an address the router reaches" in message


def test_a_routable_address_gets_no_loopback_note():
    refused = aiohttp.ClientOSError(errno.ECONNREFUSED, "Connection refused")
    message = identity_unreachable(
        "prefill", "http://10.0.0.5:8000", "http://10.0.0.5:7900/query", refused, 3.0
    )
    assert "refused the connection" in message and "loopback" not in message


def test_the_router_says_the_reason_as_it_starts(caplog):
    port = _closed_port()
    prefill = Instance("http://127.0.0.1:1", "prefill", f"http://127.0.0.1:{port}/query")
    router = Router(RouterConfig([prefill], [Instance("http://127.0.0.1:2", "decode")]))

    async def start() -> None:
        await router._start(None)
        await router._stop(None)

    with caplog.at_level(logging.WARNING, logger="kvpush.router.app"):
        asyncio.run(start())
    assert any("refused the connection" in r.getMessage() for r in caplog.records)
