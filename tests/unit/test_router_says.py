"""What the router tells its operator: the start-up lines (each instance's identity
or why it has none, where it listens), each instance going down and coming back
once per change, the input it refuses or mends at the door, the warning for legs
run one after the other, and its gauges in /metrics.

Real HTTP on loopback, as test_router_app.py; `kvpush router` itself where what is
tested is what a user sees on its stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.errors import ConfigError
from kvpush.identities import InstanceIdentity, mooncake_query
from kvpush.ports import free_port
from kvpush.router.app import Router, RouterConfig
from kvpush.router.instances import Instance

IDENTITY = InstanceIdentity(
    engine_id="engine-p", epoch="e1", transfer_mode="push", tp_size=2,
    addresses=["127.0.0.1:1", "127.0.0.1:2"], block_size=16,
)  # fmt: skip


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """An instance's API and identity endpoint in one: /health answers `status`,
    /query answers `query`, completions answer as a kvpush prefill and decode do."""

    def __init__(self, query: Any = None) -> None:
        self.status = 200
        self.query = query
        self.probes = 0
        self.legs: list[str] = []  # "prefill" or "decode", in the order they came
        self.hold = asyncio.Event()  # a prefill leg is answered once it is set
        self.hold.set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Server:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/query", self._query)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(status=self.status)

    async def _query(self, request: web.Request) -> web.Response:
        return web.json_response(self.query)

    async def _complete(self, request: web.Request) -> web.Response:
        params = (await request.json())["kv_transfer_params"]
        if params.get("do_remote_decode"):
            self.legs.append("prefill")
            await self.hold.wait()
            echo = {"remote_engine_id": "engine-p", "remote_epoch": "e1",
                    "transfer_mode": "push", "remote_addresses": ["127.0.0.1:1"],
                    "tp_size": 1, "transfer_id": params["transfer_id"]}  # fmt: skip
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": echo})
        self.legs.append("decode")
        return web.json_response({"choices": [{"text": "answer"}]})


async def _started(router: Router) -> web.AppRunner:
    runner = web.AppRunner(router.app())
    await runner.setup()
    return runner


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# -- start-up -------------------------------------------------------------------------


def test_at_start_each_instance_is_named_with_its_identity_or_why_it_has_none(caplog):
    async def scenario() -> None:
        server = await Server(IDENTITY.to_query()).start()
        closed = _closed_port()
        prefill = Instance(server.url, "prefill", f"{server.url}/query")
        decode = Instance("http://127.0.0.1:2", "decode", f"http://127.0.0.1:{closed}/query")
        other = Instance("http://127.0.0.1:3", "decode")
        router = Router(RouterConfig([prefill], [decode, other], health_interval_s=0))
        with caplog.at_level(logging.INFO, logger="kvpush"):
            runner = await _started(router)
            await runner.cleanup()
        await server.stop()
        info, warnings = _messages(caplog, logging.INFO), _messages(caplog, logging.WARNING)
        assert (
            f"kvpush router: prefill instance {server.url}: engine engine-p, push mode, TP 2, "
            f"block size 16 (from {server.url}/query)"
        ) in info
        [refused] = [m for m in warnings if "http://127.0.0.1:2" in m]
        assert f"{closed}/query refused the connection" in refused
        assert "pairs with it are not checked" in refused
        assert any(m.startswith("kvpush router: decode instance http://127.0.0.1:3: no identity=")
                   for m in info), info  # fmt: skip

    asyncio.run(scenario())


def test_kvpush_router_prints_its_instances_and_where_it_listens():
    """As a user runs it: the lines are on stderr, INFO ones included."""
    exe = shutil.which("kvpush", path=str(sys.executable).rsplit("/", 1)[0]) or "kvpush"
    port, closed = free_port(), _closed_port()
    command = [exe, "router", "--port", str(port), "--health-interval", "0",
               "--prefill", f"http://127.0.0.1:{closed},identity={closed}",
               "--decode", f"http://127.0.0.1:{closed}"]  # fmt: skip
    router = subprocess.Popen(command, stderr=subprocess.PIPE)
    said = b""
    try:
        # Raw reads of the descriptor: a buffered readline() can pull the next lines
        # into Python's buffer, where select() no longer sees them.
        with selectors.DefaultSelector() as waiting:
            waiting.register(router.stderr, selectors.EVENT_READ)
            deadline = time.monotonic() + 60
            while not re.search(rb"listening on [^\n]*\n", said):
                assert time.monotonic() < deadline and router.poll() is None, said
                if waiting.select(timeout=1):
                    said += os.read(router.stderr.fileno(), 65536)
    finally:
        router.terminate()
        router.wait(timeout=30)
    text = said.decode()
    assert f"INFO kvpush router: listening on http://127.0.0.1:{port} (push mode" in text
    assert f"WARNING kvpush router: prefill instance http://127.0.0.1:{closed}" in text
    assert "refused the connection" in text
    assert f"INFO kvpush router: decode instance http://127.0.0.1:{closed}: no identity=" in text


def test_an_identity_pointed_at_the_bootstrap_port_says_so():
    async def scenario() -> str:
        server = await Server(mooncake_query([IDENTITY])).start()
        prefill = Instance(server.url, "prefill", f"{server.url}/query")
        router = Router(RouterConfig([prefill], [Instance("http://127.0.0.1:2", "decode")]))
        router.session = aiohttp.ClientSession()
        problem = await router._try_learning(prefill)
        await router.session.close()
        await server.stop()
        return problem or ""

    problem = asyncio.run(scenario())
    assert "Mooncake-shaped answer of the instance's bootstrap_port" in problem
    assert "identity= wants its identity_port" in problem


# -- health ---------------------------------------------------------------------------


async def _probes(server: Server, more: int) -> None:
    seen = server.probes
    while server.probes < seen + more:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the probe's verdict recorded


def test_an_instance_going_down_and_back_is_said_and_counted_once_each(caplog):
    async def scenario() -> None:
        decode = await Server().start()
        router = Router(RouterConfig([Instance("http://127.0.0.1:1", "prefill")],
                                     [Instance(decode.url, "decode")],
                                     health_interval_s=0.05))  # fmt: skip
        runner = await _started(router)
        up = f'kvpush_instance_up{{instance="{decode.url}"}}'
        ejected = f'kvpush_instance_ejections_total{{instance="{decode.url}",why="health_check"}}'
        with caplog.at_level(logging.INFO, logger="kvpush"):
            await _probes(decode, 2)
            text = router.metrics.prometheus()
            assert f"{up} 1" in text and ejected not in text
            decode.status = 503
            await _probes(decode, 5)  # five failed probes: one change
            text = router.metrics.prometheus()
            assert f"{up} 0" in text and f"{ejected} 1" in text
            decode.status = 200
            await _probes(decode, 3)
            text = router.metrics.prometheus()
            assert f"{up} 1" in text and f"{ejected} 1" in text
        await runner.cleanup()
        await decode.stop()
        assert "# TYPE kvpush_instance_up gauge" in text
        down = [m for m in _messages(caplog, logging.WARNING) if f"{decode.url} is down" in m]
        back = [m for m in _messages(caplog, logging.INFO) if f"{decode.url} is back" in m]
        assert down == [
            f"kvpush router: decode instance {decode.url} is down (/health answered 503): "
            "until its /health answers again it gets requests only when no other decode "
            "instance is up"
        ]
        assert back == [f"kvpush router: decode instance {decode.url} is back: /health answers"]

    asyncio.run(scenario())


# -- input at the door ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("http://h:99999", "its port must be an integer in 1-65535"),
        ("http://h:0", "its port must be an integer in 1-65535"),
        ("http://h:8100,bootstrap=70000", "'bootstrap=70000' in 'http://h:8100,bootstrap=70000': "
         "the port must be an integer in 1-65535"),
        ("http://h:8100,identity=0", "the port must be an integer in 1-65535"),
        ("http://h:8100,identity=x", "the port must be an integer in 1-65535"),
        ("http://h:8100,port=1", "the options are identity=PORT"),
        ("http://h:8100,port=1", "device=LABEL"),
        ("http://h:8100,device=", "device='' in 'http://h:8100,device=': a label of 1-64"),
        ("http://h:8100,device=gpu 0", "device='gpu 0'"),
    ],
)  # fmt: skip
def test_ports_out_of_range_are_refused_naming_the_input(spec, said):
    with pytest.raises(ConfigError) as refused:
        Instance.parse(spec, "prefill")
    assert said in str(refused.value)


def test_a_port_out_of_range_is_a_usage_error_of_the_command(capsys, monkeypatch):
    import kvpush.router.app as app
    from kvpush.cli import main

    served = []
    monkeypatch.setattr(app, "run", lambda *args: served.append(args))
    spec = ["router", "--prefill", "http://127.0.0.1:8100,bootstrap=99999",
            "--decode", "http://127.0.0.1:8200"]  # fmt: skip
    assert main(spec) == 2 and not served
    assert "'bootstrap=99999' in 'http://127.0.0.1:8100,bootstrap=99999'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("listed", "said"),
    [
        (["--decode", "http://127.0.0.1:8200", "--decode", "http://127.0.0.1:8200/"],
         "http://127.0.0.1:8200 listed twice as a decode instance"),
        (["--decode", "http://127.0.0.1:8100", "--aggregate-on", "prefill,decode"],
         "http://127.0.0.1:8100 listed as both a prefill and a decode instance"),
    ],
)  # fmt: skip
def test_a_server_listed_twice_is_refused_as_it_would_count_half_its_load(
    listed, said, capsys, monkeypatch
):
    import kvpush.router.app as app
    from kvpush.cli import main

    served = []
    monkeypatch.setattr(app, "run", lambda *args: served.append(args))
    assert main(["router", "--prefill", "http://127.0.0.1:8100", *listed]) == 2 and not served
    assert said in capsys.readouterr().err
    # Both roles without --aggregate-on: a kv_both server may take either leg.
    both = ["router", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8100"]
    assert main(both) == 0 and served


@pytest.mark.parametrize("option", ["identity", "bootstrap"])
def test_identity_and_its_alias_bootstrap_name_the_identity_port(option):
    instance = Instance.parse(f"http://10.0.0.5:8100,{option}=7900", "prefill")
    assert instance.identity_url == "http://10.0.0.5:7900/query"


def test_a_device_label_says_which_instances_share_compute():
    assert Instance.parse("http://h:8100,device=gpu0,identity=7900", "decode").device == "gpu0"
    assert Instance.parse("http://h:8100", "decode").device is None


def test_an_ipv6_host_is_bracketed_in_the_identity_url():
    instance = Instance.parse("http://[fd00::5]:8100,identity=7900", "decode")
    assert instance.url == "http://[fd00::5]:8100"
    assert instance.identity_url == "http://[fd00::5]:7900/query"


@pytest.mark.parametrize("url", ["http://10.0.0.5:8100/v1", "http://10.0.0.5:8100/v1/"])
def test_a_trailing_v1_is_dropped_with_a_warning(url, caplog):
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        instance = Instance.parse(f"{url},identity=7900", "prefill")
    assert instance.url == "http://10.0.0.5:8100"
    [said] = _messages(caplog, logging.WARNING)
    assert "dropping its trailing /v1" in said and "using http://10.0.0.5:8100" in said


# -- requests -------------------------------------------------------------------------


def test_legs_run_in_turn_for_want_of_an_identity_with_a_warning_saying_the_cost(caplog):
    async def scenario() -> None:
        server = await Server().start()
        closed = _closed_port()
        prefill = Instance(server.url, "prefill", f"http://127.0.0.1:{closed}/query")
        router = Router(RouterConfig([prefill], [Instance(server.url, "decode")],
                                     health_interval_s=0))  # fmt: skip
        runner = await _started(router)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        with caplog.at_level(logging.WARNING, logger="kvpush"):
            async with aiohttp.ClientSession() as http, http.post(url, json={"prompt": "p"}) as r:
                assert r.status == 200
        await runner.cleanup()
        await server.stop()
        assert server.legs == ["prefill", "decode"]
        [said] = [m for m in _messages(caplog, logging.WARNING) if "this request runs" in m]
        assert f"{closed}/query refused the connection" in said
        assert "the prefill leg runs before decode is sent (no overlap, the first token later)" in (
            said
        )

    asyncio.run(scenario())


def test_requests_in_flight_are_a_gauge():
    async def scenario() -> tuple[str, str]:
        server = await Server().start()
        pools = [Instance(server.url, "prefill")], [Instance(server.url, "decode")]
        router = Router(RouterConfig(*pools, health_interval_s=0))
        runner = await _started(router)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        server.hold.clear()
        async with aiohttp.ClientSession() as http:
            request = asyncio.ensure_future(
                http.post(base + "/v1/completions", json={"prompt": "p"})
            )
            while not server.legs:  # the prefill leg arrived: the request is in flight
                await asyncio.sleep(0.01)
            async with http.get(base + "/metrics") as r:
                during = await r.text()
            server.hold.set()
            (await request).release()
            async with http.get(base + "/metrics") as r:
                after = await r.text()
        await runner.cleanup()
        await server.stop()
        return during, after

    during, after = asyncio.run(scenario())
    assert "# TYPE kvpush_router_in_flight gauge" in after
    assert "\nkvpush_router_in_flight 1\n" in during
    assert "\nkvpush_router_in_flight 0\n" in after
    assert "kvpush_router_in_flight_total" not in after
