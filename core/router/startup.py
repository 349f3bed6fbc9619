"""What the router says as it starts: each instance with the identity it learned
(or why it could not), and where it listens. The first thing an operator reads when
requests do not behave: a wrong port or an unreachable host shows here, not in the
first client's error."""

from __future__ import annotations

import logging

from kvpush.router.instances import Instance, bracketed

# What an instance without a known identity costs, by role, in push mode.
UNKNOWN_COSTS = {
    "prefill": "until it is learned (here or from a first answer), a request's legs run one "
    "after the other: no overlap, the first token later",
    "decode": "pairs with it are not checked before requests are sent, and a failed KV load "
    "reaches the client as vLLM's bare error",
}


def introduction(instance: Instance, problem: str | None, mode: str) -> tuple[int, str]:
    """The start-up line for `instance` (its log level and text), `problem` being why
    its identity could not be learned, if it could not."""
    where = f"kvpush router: {instance.role} instance {instance.url}"
    cost = UNKNOWN_COSTS[instance.role] if mode == "push" or instance.role == "decode" else ""
    if problem is not None:
        return logging.WARNING, f"kvpush router: {problem}" + (f"; {cost}" if cost else "")
    identity = instance.any_identity()
    if identity is None:
        text = f"{where}: no identity= given" + (f"; {cost}" if cost else "")
        return logging.INFO, text
    parts = [
        f"engine {identity.engine_id}",
        f"{identity.transfer_mode} mode",
        f"TP {identity.tp_size}",
        f"block size {identity.block_size}" if identity.block_size else "block size not said",
    ]
    if len(instance.ranks) > 1:
        parts.append(f"DP ranks {', '.join(map(str, sorted(instance.ranks)))}")
    return logging.INFO, f"{where}: {', '.join(parts)} (from {instance.identity_url})"


def listening(host: str, port: int, mode: str, prefill: int, decode: int) -> str:
    return (
        f"kvpush router: listening on http://{bracketed(host)}:{port} ({mode} mode, "
        f"{prefill} prefill and {decode} decode instances)"
    )
