"""Mooncake-mode routers: their bootstrap query, and decode legs that name only it.

Routers built for vLLM's MooncakeConnector (llm-d's mooncake mode, vllm-router's
mooncake mode, vLLM's own mooncake proxy) learn a prefill instance's engine id from
its bootstrap server's `GET /query`,

    {"<dp rank>": {"engine_id": E, "worker_addr": {"<tp rank>": {"<pp rank>": addr}}}}

and then send both legs at once: prefill `{"do_remote_decode": true, "transfer_id": T}`,
decode `{"do_remote_prefill": true, "transfer_id": T, "remote_engine_id": E,
"remote_bootstrap_addr": "http://host:port"}`, with no side-channel addresses. A
kvpush prefill instance serves that query (`bootstrap_port`), with its kvpush identity
added to each entry; a kvpush decode instance given such a leg asks the named
bootstrap server itself, off the engine's thread, and caches what it learns for a
short while, so an instance that restarts is learnt afresh.

The same resolver completes a decode leg that names its producer only by the
prefill echo's `remote_host` and `remote_port` (vllm-router's NIXL push mode keeps
nothing else of it): they name the prefill instance's kvpush identity endpoint,
whose `GET /query` answers the identity itself.

Whoever can send decode a request names the endpoint decode then asks, so an
endpoint must be a bare `http(s)://host:port` (kvpush appends `/query`), and a
failed query is reported by what went wrong, never by what the endpoint answered:
the report reaches decode's trace, and a client must not read another server
through it.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpush.errors import KVPushError
from kvpush.identities import IdentityError, InstanceIdentity, fetch_query, parse_identity
from kvpush.vllm.config import producer_allowed

CACHE_S = 10.0  # how long a learnt identity is used before it is asked for again
RETRY_S = 1.0  # how long a failed query is remembered before it is tried again
MAX_ENTRIES = 256  # endpoints' answers kept (the least recently asked go first)
MAX_ASKING = 32  # endpoints being asked at once
QUERY_THREADS = 2
_SCHEMES = ("http", "https")
# host:port, the host a DNS name, an IPv4 address or a bracketed IPv6 one.
_NETLOC = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253})(:(?P<port>\d{1,5}))?")
# host:port, the port required (a side-channel address, an endpoint's netloc).
HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]{1,253}):\d{1,5}")


class LegError(KVPushError):
    """A decode leg the bootstrap server cannot complete: a reason for metrics, and
    a message for people."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Entry:
    answer: dict[str, Any] | None = None  # the query's answer, once it came
    error: str = ""  # why the query failed, once it did
    at: float = 0.0  # when it came (or failed)


class BootstrapResolver:
    """Identities of prefill instances, learnt from their bootstrap servers.

    `producer` never blocks: a query it needs runs on one of QUERY_THREADS threads,
    and the caller asks again (vLLM asks again while `get_num_new_matched_tokens`
    says None). Decode legs name these endpoints, so what they cost is bounded: the
    last MAX_ENTRIES answers are kept, MAX_ASKING queries may wait, and an answer is
    read up to kvpush.identities.MAX_ANSWER bytes.
    """

    def __init__(
        self,
        fetch: Callable[[str], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch or fetch_query
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._asking: set[str] = set()
        self._pool = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="kvpush-bootstrap")

    def producer(self, address: str, engine_id: str) -> InstanceIdentity | None:
        """The kvpush identity of engine `engine_id` at bootstrap server `address`, or
        None while it is being asked for. Raises LegError if it cannot be had, or if
        `address` is anything more than http(s)://host:port."""
        problem = endpoint_problem(address)
        if problem is not None:
            raise LegError(
                "bad_bootstrap_addr",
                f"the producer endpoint {str(address)[:200]!r} must be http(s)://host:port "
                f"and nothing more: {problem}",
            )
        now = self._clock()
        with self._lock:
            entry = self._entries.get(address)
            if entry is not None and address not in self._asking:
                age = now - entry.at
                if entry.error and age < RETRY_S:
                    raise LegError(
                        "bootstrap_unreachable",
                        f"the endpoint {address} the decode leg names its producer by did "
                        f"not answer kvpush's identity query ({entry.error}): unless it is "
                        "down, the prefill instance is not running KVPushConnector (an "
                        "upstream NixlConnector, say), and a KVPushConnector decode "
                        "instance cannot pair with it",
                    )
                # A fresh answer without the engine is a restart under a new engine id
                # only if it is not very fresh: ask again, then believe it.
                known = entry.answer is not None and _has(entry.answer, engine_id)
                if entry.answer is not None and age < CACHE_S and (known or age < RETRY_S):
                    return _pick(address, entry.answer, engine_id)
            self._ask(address)
            return None

    def forget(self, address: str) -> None:
        """A transfer from what `address` named failed: ask afresh next time (the
        instance may have restarted under the same engine id, at new addresses)."""
        with self._lock:
            if address not in self._asking:
                self._entries.pop(address, None)

    def _ask(self, address: str) -> None:
        """Query `address` on the pool (once at a time per address)."""
        if address in self._asking:
            return
        if len(self._asking) >= MAX_ASKING:
            raise LegError(
                "bootstrap_unreachable",
                f"{len(self._asking)} producer endpoints are being asked already; "
                f"{address} was not",
            )
        self._asking.add(address)

        def run() -> None:
            try:
                answer, error = self._fetch(address), ""
            except Exception as exc:  # any failure is this leg's answer, not a crash
                answer, error = None, _failure(exc)
            with self._lock:
                self._entries[address] = _Entry(answer, error, self._clock())
                self._entries.move_to_end(address)
                while len(self._entries) > MAX_ENTRIES:
                    self._entries.popitem(last=False)
                self._asking.discard(address)

        self._pool.submit(run)


def _entries(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The engines an endpoint's GET /query names: a Mooncake-shaped answer lists one
    per DP rank; a kvpush identity endpoint's answer is the one engine itself."""
    if answer.get("kvpush") is True and "engine_id" in answer:
        return [{"engine_id": answer["engine_id"], "kvpush": answer}]
    return [e for e in answer.values() if isinstance(e, dict)]


def _has(answer: dict[str, Any], engine_id: str) -> bool:
    return any(e.get("engine_id") == engine_id for e in _entries(answer))


def _pick(address: str, answer: dict[str, Any], engine_id: str) -> InstanceIdentity:
    entries = _entries(answer)
    for entry in entries:
        if entry.get("engine_id") != engine_id:
            continue
        identity = entry.get("kvpush")
        if not isinstance(identity, dict):
            raise LegError(
                "not_kvpush_params",
                f"the instance behind bootstrap server {address} (engine {engine_id!r}) is "
                "not running KVPushConnector (a MooncakeConnector, say), and a "
                "KVPushConnector decode instance cannot pair with it",
            )
        try:
            return parse_identity(identity, f"the identity bootstrap server {address} gave")
        except IdentityError as exc:
            raise LegError("bad_identity", str(exc)) from None
    # How many, not which: their ids are the endpoint's words (see the module's doc).
    raise LegError(
        "unknown_engine",
        f"bootstrap server {address} serves {len(entries)} engine(s), not {engine_id!r} "
        "that the decode leg names (its GET /query lists the ones it serves)",
    )


def endpoint_problem(address: str) -> str | None:
    """What makes `address` more (or less) than http(s)://host:port, or None. A
    trailing "/" is allowed, and the port may be left to the scheme's default."""
    if not isinstance(address, str):
        return f"it is a {type(address).__name__}, not a string"
    if any(c.isspace() or not c.isprintable() for c in address):
        return "it holds white space or control characters"
    try:
        url = urllib.parse.urlsplit(address)
    except ValueError:  # an unclosed "[" of an IPv6 host, say
        return "it is not a URL"
    if url.scheme not in _SCHEMES:
        return (
            f"its scheme is {url.scheme!r}, not http or https" if url.scheme else "it has no scheme"
        )
    if "@" in url.netloc:
        return "it carries user information (user@)"
    if url.path not in ("", "/"):
        return "it has a path"
    if "?" in address:
        return "it has a query"
    if "#" in address:
        return "it has a fragment"
    netloc = _NETLOC.fullmatch(url.netloc)
    if netloc is None:
        return "its host is not a host name or IP address"
    port = netloc["port"]
    if port is not None and not 0 < int(port) < 65536:
        return f"its port {port} is not from 1 to 65535"
    return None


def producer_endpoint(params: dict[str, Any], allowed: tuple[str, ...]) -> str | None:
    """The URL of the endpoint a decode leg names its producer by, if any: an
    http(s) URL of a host `allowed` lets this decode reach. LegError if not."""
    bootstrap = params.get("remote_bootstrap_addr")
    host, port = params.get("remote_host"), params.get("remote_port")
    if bootstrap is not None:
        url = urllib.parse.urlsplit(bootstrap if isinstance(bootstrap, str) else "")
        try:
            where = f"{url.hostname}:{url.port or (443 if url.scheme == 'https' else 80)}"
        except ValueError:
            where = ""
        if url.scheme not in ("http", "https") or not url.hostname or not where:
            raise LegError(
                "bad_bootstrap_addr",
                f"remote_bootstrap_addr must be an http(s) URL, got {str(bootstrap)[:200]!r}",
            )
        endpoint = bootstrap
    elif isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
        where = f"{host}:{port}"
        if not HOST_PORT.fullmatch(where):
            raise LegError("bad_addresses", f"remote_host {host[:100]!r} is not a host name")
        endpoint = f"http://{where}"
    else:
        return None
    if not producer_allowed(where, allowed):
        raise LegError(
            "producer_not_allowed",
            f"the decode leg names its producer by {where}, which allowed_producers does not list",
        )
    return endpoint


def _failure(exc: Exception) -> str:
    """Why a query failed, in words that carry nothing the endpoint sent: its body,
    or its status line's words, could be any server's that the leg named."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP status {exc.code}"
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return "its answer is not JSON"
    if isinstance(exc, http.client.HTTPException):
        return f"its answer is not HTTP ({type(exc).__name__})"
    if isinstance(exc, urllib.error.URLError):
        return (
            f"URLError: {str(exc.reason)[:200]}" if isinstance(exc.reason, OSError) else "URLError"
        )
    if isinstance(exc, OSError | ValueError):
        # Raised here, not sent: a refused or reset connection, a timeout, and
        # fetch_query's own limits (too long, too big, not an object).
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return type(exc).__name__
