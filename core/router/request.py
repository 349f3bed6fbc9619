"""One client request at the router: its trace, whether the client has been
answered, and the failures of its legs, with the words the client is told."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpush.errors import KVPushError
from kvpush.router.instances import Instance

# Per-request state kept on the aiohttp request (typed keys where aiohttp has them).
_RequestKey = getattr(web, "RequestKey", None)
TRACE: Any = _RequestKey("kvpush_trace", object) if _RequestKey else "kvpush_trace"
ANSWERED: Any = _RequestKey("kvpush_answered", bool) if _RequestKey else "kvpush_answered"


class LegFailed(KVPushError):
    """A leg failed; `status` and `message` are what the client is told. `instance`
    is the one that failed, if one did (not the client's own request)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "upstream_error",
        instance: Instance | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.instance = instance

    @property
    def retryable(self) -> bool:
        """Another instance might do better: the instance was unreachable or failed
        on its own (5xx), not refused the client's request (4xx)."""
        return self.instance is not None and self.status >= 500


@dataclass
class Trace:
    """One request's milestones at the router (monotonic seconds), for /kvpush/trace
    and the router's histograms. Join with an instance's trace by transfer id."""

    transfer_id: str = ""
    marks: dict[str, float] = field(default_factory=lambda: {"received": time.monotonic()})
    received_unix: float = field(default_factory=time.time)  # to line up with other logs
    seed: int | None = None  # the sampling seed the router gave both legs, if it did
    route: dict[str, Any] | None = None  # where it ran and why (route.py), once decided
    _hooks: dict[str, list[Callable[[], None]]] = field(default_factory=dict, repr=False)

    def mark(self, milestone: str) -> None:
        """The milestone reached (its first time is kept); what waits on it runs,
        so a retry's hook runs at the retry's milestone, not the first attempt's."""
        self.marks.setdefault(milestone, time.monotonic())
        for hook in self._hooks.pop(milestone, ()):
            hook()

    def at(self, milestone: str, hook: Callable[[], None]) -> None:
        """Run `hook` the next time `milestone` is marked."""
        self._hooks.setdefault(milestone, []).append(hook)

    def since(self, start: str, end: str) -> float | None:
        if start in self.marks and end in self.marks:
            return max(0.0, self.marks[end] - self.marks[start])
        return None

    def as_dict(self) -> dict[str, Any]:
        start = self.marks["received"]
        entry: dict[str, Any] = {
            "transfer_id": self.transfer_id,
            "received_unix": round(self.received_unix, 4),
            "ms_since_received": {k: round((v - start) * 1e3, 3) for k, v in self.marks.items()},
        }
        if self.seed is not None:
            entry["seed"] = self.seed
        if self.route is not None:
            entry["route"] = self.route
        return entry


def cause(exc: BaseException) -> str:
    return "timeout" if isinstance(exc, asyncio.TimeoutError) else "unreachable"


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer within the idle timeout"
    return str(exc) or type(exc).__name__


def error_event(decode: Instance, event: dict[str, Any]) -> LegFailed:
    """A decode stream whose first word is an error (vLLM's bare "Internal server
    error" for a KV load that failed): the leg failed, as if it had said so by status."""
    code = event["error"].get("code") if isinstance(event["error"], dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return LegFailed(status, upstream_message(decode, json.dumps(event)), instance=decode)


def upstream_message(instance: Instance, text: str) -> str:
    try:
        detail = json.loads(text).get("error", {}).get("message") or text
    except (ValueError, AttributeError):
        detail = text
    return f"{instance.role} instance {instance.url}: {str(detail)[:500]}"
