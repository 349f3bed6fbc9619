"""Whether two workers may pair, decided from their hellos alone."""

from __future__ import annotations

from kvpush.errors import RegionError
from kvpush.layout import pairing_split
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
    if local.identity.world != remote.identity.world:
        return (
            f"tensor-parallel sizes differ: {local.identity.world} here, "
            f"{remote.identity.world} on the peer (only equal sizes pair)"
        )
    if local.identity.rank != remote.identity.rank:
        return (
            f"rank mismatch: rank {local.identity.rank} here was reached by the peer's "
            f"rank {remote.identity.rank}"
        )
    try:
        pairing_split(local.layout, remote.layout)
    except RegionError as exc:
        return str(exc)
    return None
