"""Every error kvpush raises on purpose derives from KVPushError.

Callers that must never crash (the connector inside an engine, the router) catch
KVPushError and turn it into a failed request; anything else is a bug.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KVPushError(Exception):
    """Base of all kvpush errors."""


class ConfigError(KVPushError, ValueError):
    """A configuration value or key is wrong; the message names it."""


class BackendError(KVPushError):
    """No backend, or the wrong one, for a device or a request."""


class BackendNotImplemented(BackendError, NotImplementedError):
    """The backend exists but does not implement this operation yet."""


class RegionError(KVPushError, ValueError):
    """A memory region or block layout cannot be registered or addressed."""


class TransportError(KVPushError):
    """A NIXL operation failed. Names the operation and, when known, the peer."""

    def __init__(self, op: str, detail: str, peer: str | None = None) -> None:
        self.op = op
        self.peer = peer
        self.detail = detail
        where = f" with peer {peer!r}" if peer else ""
        super().__init__(f"NIXL {op}{where} failed: {detail}")


class PeerLostError(TransportError):
    """The remote agent disconnected or died."""


class MetadataError(TransportError):
    """Agent metadata from a peer could not be loaded."""


class ProtocolError(KVPushError):
    """A message could not be decoded, or does not fit the protocol state."""


class AuthError(ProtocolError):
    """A message failed authentication or was replayed."""


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """The known word closest to a misspelt one, as " (did you mean 'x'?)"; "" if none is close."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
