"""Reading a decode leg's kv_transfer_params (the two-leg contract of
kvpush.identities, docs/routing.md): whether kvpush can serve it, the producer it
names, and completing one that names its producer only by an endpoint.

Plain values in and out: the vLLM adapter (kvpush.vllm.scheduler) hands its
requests' params here and acts on the answers.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpush.engine.steps import Announce
from kvpush.errors import ProtocolError
from kvpush.identities import EPOCH_SEPARATOR, InstanceIdentity, decode_params
from kvpush.layout import tp_problem
from kvpush.protocol.messages import check_transfer_id
from kvpush.vllm.bootstrap import HOST_PORT, producer_endpoint
from kvpush.vllm.config import producer_allowed
from kvpush.vllm.transfers import api_kind, api_request_id


class Resolver(Protocol):
    """What answers for an endpoint (kvpush.vllm.bootstrap.BootstrapResolver)."""

    def producer(self, address: str, engine_id: str) -> InstanceIdentity | None: ...


def learn_producer(
    request_id: str, params: dict[str, Any], allowed: tuple[str, ...], resolver: Resolver
) -> str | None:
    """Complete a leg that names its producer only by an endpoint: a Mooncake-mode
    router's bootstrap server, or the echo's remote_host and remote_port (all that
    vllm-router's NIXL push mode keeps of it). Returns the endpoint it was learnt
    from ("" if there was nothing to learn), or None while the endpoint is being
    asked. A leg without a transfer id takes the one its prefill leg's instance
    named (both legs carry the router's X-Request-Id). LegError (kvpush.vllm.
    bootstrap) where the endpoint itself is refused."""
    if "remote_addresses" in params:
        return ""
    address = producer_endpoint(params, allowed)
    if address is None:
        return ""  # nothing to learn from: decode_leg_problem says why
    engine = str(params.get("remote_engine_id") or "")
    identity = resolver.producer(address, engine)
    if identity is None:
        return None
    transfer_id = params.get("transfer_id") or named_by_prefill(request_id, params)
    params.update(decode_params(transfer_id, identity))
    return address


def named_by_prefill(request_id: str, params: dict[str, Any]) -> str:
    """The transfer id a prefill instance named for the API request this decode leg
    belongs to (kvpush.vllm.scheduler names a leg that brought none): the same
    derivation from our own request id, as a router giving both legs one
    X-Request-Id makes them alike; or, should the ids differ, from the
    remote_request_id the router says it used."""
    mine = api_request_id(request_id)
    theirs = params.get("remote_request_id")
    if isinstance(theirs, str) and theirs and not mine.endswith(theirs):
        return api_kind(mine) + theirs
    return mine


def announce(transfer_id: str, params: dict[str, Any]) -> Announce:
    """The producer a (completed) decode leg names: ranks, engine, boots, network."""
    return Announce(
        transfer_id,
        tuple(params["remote_addresses"]),
        str(params.get("remote_engine_id") or ""),
        tuple(str(params.get("remote_epoch") or "").split(EPOCH_SEPARATOR)),
        str(params.get("remote_network") or ""),
    )


def decode_leg_problem(
    params: dict[str, Any], mode: str, world: int, allowed: tuple[str, ...]
) -> tuple[str, str] | None:
    """Why a decode leg's kv_transfer_params cannot be served by kvpush, as (a short
    reason for metrics, a message for people), or None. `mode`: this instance's
    transfer mode; `world`: its TP size; `allowed`: the producers this decode may
    dial (allowed_producers)."""
    missing = [k for k in ("transfer_id", "remote_addresses") if k not in params]
    if missing:
        return "not_kvpush_params", (
            f"kv_transfer_params lack {missing} (keys: {sorted(params)}): the prefill "
            "instance is not running KVPushConnector (an upstream NixlConnector, say), and "
            "a KVPushConnector decode instance cannot pair with it"
        )
    try:
        check_transfer_id(params["transfer_id"] if isinstance(params["transfer_id"], str) else "")
    except ProtocolError as exc:
        return "bad_transfer_id", str(exc)
    theirs = params.get("transfer_mode", "push")
    if theirs != mode:
        return "mode_mismatch", (
            f"transfer mode mismatch: the prefill instance is in {theirs} mode, this one in {mode}"
        )
    addresses = params["remote_addresses"]
    if (
        not isinstance(addresses, list)
        or not addresses
        or not all(isinstance(a, str) and HOST_PORT.fullmatch(a) for a in addresses)
    ):
        return "bad_addresses", (
            f"remote_addresses must list one side-channel host:port per tensor-parallel "
            f"rank of the prefill instance, got {str(addresses)[:200]}"
        )
    problem = tp_problem(len(addresses), world, 0)
    if problem:
        return "tp_mismatch", problem
    refused = [a for a in addresses if not producer_allowed(a, allowed)]
    if refused:
        return "producer_not_allowed", (
            f"the decode leg names producer {refused[0]}, which allowed_producers does not list"
        )
    return None
