"""An instance's identity as others ask for it: `GET /query`, the one contract between
kvpush's connector (which serves it), its router and the Ray backend (which read it).

A kvpush identity endpoint answers the identity itself (engine id, boot epoch,
side-channel addresses per TP rank, TP size, block size, mode, ...); a bootstrap
server answers Mooncake's shape, one entry per data-parallel rank, each with the
kvpush identity inside (`mooncake_query`). `fetch_query` is the one bounded client.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import Any

TIMEOUT_S = 3.0
MAX_ANSWER = 1 << 20  # bytes: a thousand DP ranks' identities fit


def mooncake_query(identities: list[dict[str, Any]]) -> dict[str, Any]:
    """This instance as Mooncake's bootstrap `GET /query` answers it: one entry per
    data-parallel rank (each rank is its own engine, `<engine id>_dp<rank>`)."""
    answer = {}
    for identity in identities:
        workers = {str(r): {"0": f"tcp://{a}"} for r, a in enumerate(identity["addresses"])}
        answer[str(identity.get("dp_rank", 0))] = {
            "engine_id": identity["engine_id"],
            "worker_addr": workers,
            "kvpush": identity,
        }
    return answer


def fetch_query(address: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """A bootstrap server's GET /query answer (at most MAX_ANSWER bytes of it), read
    within about `timeout` seconds in all: the socket's timeout bounds each read
    only, and a server trickling a byte at a time would otherwise hold a query
    thread for as long as it liked."""
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(address.rstrip("/") + "/query", timeout=timeout) as response:
        body = b""
        while len(body) <= MAX_ANSWER:
            chunk = response.read1(MAX_ANSWER + 1 - len(body))
            if not chunk:
                break
            body += chunk
            if time.monotonic() > deadline:
                raise TimeoutError(f"/query took longer than {timeout:g}s to answer")
    if len(body) > MAX_ANSWER:
        raise ValueError(f"/query answered more than {MAX_ANSWER} bytes")
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError(f"/query answered {type(answer).__name__}, not an object")
    return answer


def dp_siblings(identity_url: str, first: dict[str, Any], most: int = 256) -> list[dict[str, Any]]:
    """The identities of DP ranks 1, 2, ... of the instance whose DP rank 0 answers at
    `identity_url` (http://host:port) with `first`: each at the next port, until a port
    does not answer with a sibling (vLLM names DP rank d's engine `<base>_dp<d>`).
    None for an instance that is not data parallel."""
    if not first.get("data_parallel"):
        return []
    parts = urllib.parse.urlsplit(identity_url)
    base = str(first["engine_id"]).removesuffix("_dp0")
    found = []
    for rank in range(1, most):
        url = f"{parts.scheme}://{parts.hostname}:{(parts.port or 0) + rank}"
        try:
            identity = fetch_query(url)
        except (OSError, ValueError):
            break
        if identity.get("engine_id") != f"{base}_dp{rank}":
            break
        found.append(identity)
    return found
