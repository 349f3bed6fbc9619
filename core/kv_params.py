"""The kv_transfer_params of kvpush's two-leg contract (docs/routing.md), built in
one place for everyone who writes them: the router, the prefill instance's echo,
and a decode instance completing a leg from a bootstrap server.

The prefill echo also carries upstream NixlConnector's fields (remote_block_ids,
remote_host, remote_port, remote_request_id, tp_size, ...), with upstream's types:
routers built for NixlConnector read them, and some forward the echo to decode only
when they are there (vllm-router's NIXL mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def decode_params(transfer_id: str, identity: dict[str, Any]) -> dict[str, Any]:
    """A decode leg's kv_transfer_params: take `transfer_id`'s KV from the prefill
    instance `identity` (GET /query's answer)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "transfer_mode": identity["transfer_mode"],
        "remote_engine_id": identity["engine_id"],
        "remote_epoch": identity["epoch"],
        "remote_addresses": list(identity["addresses"]),
        "tp_size": identity["tp_size"],
        "remote_block_size": int(identity.get("block_size", 0)),
        "remote_block_pages": bool(identity.get("block_pages", True)),
        "remote_dp_rank": identity.get("dp_rank", 0),
        "remote_data_parallel": bool(identity.get("data_parallel", False)),
    }


def prefill_echo(
    transfer_id: str,
    identity: dict[str, Any],
    block_ids: Sequence[int],
    request_id: str,
    num_tokens: int,
    engine_transfer_id: str = "",
) -> dict[str, Any]:
    """What a prefill instance answers in kv_transfer_params: the decode leg's params,
    plus upstream NixlConnector's fields. `remote_host`/`remote_port` name this
    instance's identity endpoint (as upstream's name the endpoint serving every
    rank's handshake): a decode handed only those finds the rest there.
    `request_id` is the id a router that matches legs by X-Request-Id knows it by;
    `engine_transfer_id` the transfer this answer's KV is held under (a retried leg's
    is not the first attempt's: kvpush.vllm.transfers)."""
    host, _, port = str(identity["endpoint"]).rpartition(":")
    return {
        **decode_params(transfer_id, identity),
        "remote_block_ids": [[int(b) for b in block_ids]],  # one list per KV cache group
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port),
        "pp_size": 1,
        "dcp_size": 1,
        "remote_num_tokens": int(num_tokens),
        "remote_transfer_id": engine_transfer_id,
    }


def identity_from_decode_params(params: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill identity a decode leg's kv_transfer_params name, in GET /query's
    shape (None if they name none)."""
    try:
        return {
            "engine_id": params["remote_engine_id"],
            "epoch": params["remote_epoch"],
            "transfer_mode": params["transfer_mode"],
            "addresses": list(params["remote_addresses"]),
            "tp_size": params["tp_size"],
            "block_size": int(params.get("remote_block_size", 0)),
            "block_pages": bool(params.get("remote_block_pages", True)),
            "dp_rank": int(params.get("remote_dp_rank", 0)),
            "data_parallel": bool(params.get("remote_data_parallel", False)),
        }
    except (KeyError, TypeError, ValueError):
        return None
