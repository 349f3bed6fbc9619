"""Server-sent events as vLLM streams them: `data: <JSON>` blocks, `data: [DONE]`
last."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp


def encode(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


END = object()  # what data() makes of `data: [DONE]`


def data(line: bytes | str) -> Any:
    """One line of a stream: its JSON object, END for [DONE], None for anything else."""
    prefix, done = (b"data:", b"[DONE]") if isinstance(line, bytes) else ("data:", "[DONE]")
    if not line.startswith(prefix):
        return None
    payload = line[5:].strip()
    if payload == done:
        return END
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


async def events(content: aiohttp.StreamReader) -> Any:
    """A server-sent event stream's JSON events, up to [DONE]. Split by hand: an
    event can be longer than aiohttp's line limit (a long prompt's token ids)."""
    pending = b""
    async for chunk in content.iter_any():
        pending += chunk
        *blocks, pending = pending.split(b"\n\n")
        for block in blocks:
            for line in block.splitlines():
                event = data(line)
                if event is END:
                    return
                if event is not None:
                    yield event


class Rewriter:
    """A stream's bytes with each JSON event passed through `edit`: whole events go
    out as they complete, the rest waits for the next chunk."""

    def __init__(self, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.edit = edit
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        *blocks, self.pending = self.pending.split(b"\n\n")
        return b"".join(self._block(block) for block in blocks)

    def rest(self) -> bytes:
        """What never completed an event, as it came."""
        rest, self.pending = self.pending, b""
        return rest

    def _block(self, block: bytes) -> bytes:
        lines = []
        for line in block.splitlines():
            event = data(line)
            if isinstance(event, dict):
                line = encode(self.edit(event)).rstrip(b"\n")
            lines.append(line)
        return b"\n".join(lines) + b"\n\n"


def whole_json(payload: bytes) -> bool:
    """Whether a non-streamed answer arrived whole: one JSON object."""
    try:
        return isinstance(json.loads(payload), dict)
    except ValueError:
        return False


def first_word(head: bytes) -> dict[str, Any] | None:
    """The first complete event of a stream's head that is more than chat's role
    preamble: output, an error, or the end ({} for [DONE] or what is not JSON); None
    while no such event has arrived in full."""
    for block in head.split(b"\n\n")[:-1]:
        for line in block.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            try:
                event = json.loads(payload) if payload != b"[DONE]" else {}
            except ValueError:
                return {}  # not ours to judge: pass it on
            if not isinstance(event, dict):
                return {}
            if not role_only(event):
                return event
    return None


def role_only(event: dict[str, Any]) -> bool:
    """Chat's first chunk: every choice's delta names the role and says nothing yet.
    vLLM sends it before the engine has run, so it proves nothing about the leg."""
    choices = event.get("choices")
    return bool(choices) and all(
        isinstance(c, dict)
        and "delta" in c
        and not c.get("finish_reason")
        and {k for k, v in (c.get("delta") or {}).items() if v} <= {"role"}
        for c in choices
    )
