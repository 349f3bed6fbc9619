"""The process's open-file limit, raised for servers and clients that hold a socket
per request in flight."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_files(wanted: int = 65536) -> int:
    """Raise the soft limit on open files towards `wanted` (never past the hard
    limit); the soft limit now.

    A router holds three sockets per request in flight (client, prefill leg, decode
    leg), so the common default of 1024 caps it near 300 concurrent requests, and the
    one past that fails with "Too many open files". vLLM raises its own limit the
    same way.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("kvpush: could not raise the open-file limit from %d: %s", soft, exc)
    return soft
