"""Whether two workers may pair: from their hellos, then from their KV layouts."""

from __future__ import annotations

from kvpush.errors import RegionError
from kvpush.layout import KVLayout, plan
from kvpush.protocol.messages import Hello

# What a worker does in a pairing; the one list of them (vLLM's kv_role names map
# onto these in kvpush.vllm.config).
ROLES = ("producer", "consumer", "both")


def pairing_problem(local: Hello, remote: Hello) -> str | None:
    """Why `local` (this side) must not pair with `remote`, or None if they may.

    Transfer mode is part of the check, so a push worker and a pull worker refuse
    each other with a message naming both modes, rather than waiting on messages the
    other will never send.
    """
    if local.mode != remote.mode:
        return (
            f"transfer mode mismatch: this worker ({local.identity.label()}) is in "
            f"{local.mode} mode, the peer ({remote.identity.label()}) in {remote.mode} mode"
        )
    if remote.role not in ROLES:
        return f"the peer has unknown role {remote.role!r}"
    if local.role == remote.role and local.role != "both":
        return f"both sides are {local.role}s; a {local.role} pairs with the other role"
    for consumer, producer in ((local, remote), (remote, local)):
        if consumer.role == "producer" or producer.role == "consumer":
            continue
        if producer.silence_s and 3 * consumer.heartbeat_s > producer.silence_s:
            return (
                f"the consumer heartbeats every {consumer.heartbeat_s} s, but the producer "
                f"drops a consumer silent for {producer.silence_s} s: set heartbeat_s to at "
                "most a third of the producer's silence_s"
            )
    # Which ranks pair, across TP sizes too, the layouts' shards say (layout_problem).
    return None


def unexpected_producer(hello: Hello, engine: str, epoch: str) -> str | None:
    """Why the producer that said `hello` is not the one a decode leg names (engine
    `engine` in boot `epoch`; "" for either: any), or None."""
    identity = hello.identity
    if engine and identity.engine_id != engine:
        return f"the producer is engine {identity.engine_id!r}; the decode leg names {engine!r}"
    if epoch and identity.epoch != epoch:
        return (
            f"the producer restarted: it is in boot {identity.epoch!r}, the decode leg "
            f"names boot {epoch!r}"
        )
    return None


def layout_problem(
    local: KVLayout, remote: KVLayout, digest: str, local_produces: bool
) -> str | None:
    """Why the peer's layout (sent after its hello named its `digest`) cannot pair
    with ours, or None. `local_produces`: we are the producer side of this link."""
    if remote.digest() != digest:
        return "the peer's KV layout is not the one its hello named"
    try:
        plan(local, remote) if local_produces else plan(remote, local)
    except RegionError as exc:
        return str(exc)
    return None
