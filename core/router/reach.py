"""Why the router could not learn an instance's identity, in words that point at
the cause: nothing listening, no answer, something else answering (the instance's
Mooncake bootstrap port, say), and whether the address leads back to the router's
own host."""

from __future__ import annotations

import asyncio
import errno
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvpush.addresses import is_loopback


def identity_unreachable(
    role: str, instance_url: str, url: str, exc: BaseException, timeout_s: float
) -> str:
    """What to tell the user when asking `url` (an instance's identity endpoint)
    failed with `exc` after at most `timeout_s` seconds."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    where = f"{role} instance {instance_url}: its kvpush identity endpoint {url}"
    if _refused(exc):
        said = (
            f"{where} refused the connection: nothing listens on port {port} there. Is the "
            f"instance up, and is {port} its identity_port (identity= names it)?"
        )
    elif isinstance(exc, TimeoutError | asyncio.TimeoutError):
        said = (
            f"{where} did not answer within {timeout_s:g}s: a firewall dropping the port, or "
            "a host that is down or overloaded"
        )
    elif isinstance(exc, ValueError | aiohttp.ClientResponseError):
        said = (
            f"{where} answered, but not as a kvpush identity endpoint does ({exc}): is {port} "
            "its identity_port, and does it run KVPushConnector?"
        )
    else:
        said = f"{where} could not be asked: {exc}"
    if is_loopback(host):
        said += (
            f". {host} is a loopback address: it leads to the router's own host (and network "
            "namespace) only; if the instance runs elsewhere, name it by an address the "
            "router reaches"
        )
    return said


def not_an_identity(role: str, instance_url: str, answer: Any, exc: Exception) -> str:
    """What to tell the user when an identity endpoint answered JSON that is not a
    kvpush identity. The likeliest port to confuse with identity_port is the
    instance's bootstrap_port, whose Mooncake-shaped /query holds the identity one
    level down: that one is named."""
    where = f"{role} instance {instance_url}"
    if isinstance(answer, dict) and isinstance(answer.get("0"), dict) and "kvpush" in answer["0"]:
        return (
            f"{where}: {exc}: it is the Mooncake-shaped answer of the instance's "
            "bootstrap_port; identity= wants its identity_port"
        )
    return f"{where}: {exc}"


def _refused(exc: BaseException | None) -> bool:
    """Whether the connection was refused (aiohttp wraps the OSError it got)."""
    while exc is not None:
        if getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        exc = getattr(exc, "os_error", None) or exc.__cause__
    return False
