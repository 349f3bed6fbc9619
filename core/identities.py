"""The contract between kvpush's connector, its router and the Ray backend: an
instance's identity, and the kv_transfer_params of the two-leg contract
(docs/routing.md).

A kvpush identity endpoint answers `GET /query` with an InstanceIdentity (engine id,
boot epoch, side-channel addresses per TP rank, TP size, block size, mode, ...); a
bootstrap server answers Mooncake's shape, one entry per data-parallel rank, each
with the kvpush identity inside (`mooncake_query`). `fetch_query` is the one
bounded client, and `parse_identity` the one reader: an answer that is not a kvpush
identity is refused there, naming the field.

The kv_transfer_params are built here for everyone who writes them: the router,
the prefill instance's echo, and a decode instance completing a leg from a
bootstrap server. The prefill echo also carries upstream NixlConnector's fields
(remote_block_ids, remote_host, remote_port, remote_request_id, tp_size, ...), with
upstream's types: routers built for NixlConnector read them, and some forward the
echo to decode only when they are there (vllm-router's NIXL mode).
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpush.errors import KVPushError

TIMEOUT_S = 3.0
MAX_ANSWER = 1 << 20  # bytes: a thousand DP ranks' identities fit
EPOCH_SEPARATOR = "-"  # between the ranks' boots in an epoch (remote_epoch)


class IdentityError(KVPushError):
    """An answer that is not a kvpush identity."""


class RankIdentity(msgspec.Struct, frozen=True):
    """One tensor-parallel rank's worker: its side channel, boot and NIXL agent."""

    rank: int
    address: str  # host:port of its side channel, "" for a pure consumer
    epoch: str = ""
    agent: str = ""


class InstanceIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """A kvpush instance (one data-parallel rank of it) as `GET /query` answers it."""

    engine_id: str
    epoch: str  # this boot's: every rank's, joined by "-"
    transfer_mode: str  # "push" | "pull"
    tp_size: int
    addresses: list[str]  # each TP rank's side channel, in rank order
    endpoint: str = ""  # host:port of its identity endpoint
    block_size: int = 0  # tokens per block (0: not said)
    block_pages: bool = True  # a peer of another block size may take its blocks as pages
    kv_groups: int = 1  # KV cache groups a transfer carries (hybrid models)
    kv_states: int = 0  # of them, recurrent-state groups (kvpush.vllm.groups)
    dp_rank: int = 0
    data_parallel: bool = False
    # Whether its engine can take a sampling seed the client did not send: its
    # generators rewind (kvpush.router.first_token).
    seeds_rewind: bool = False
    # Where its loopback addresses lead (kvpush.addresses.network_id): a decode
    # elsewhere refuses a loopback side-channel address rather than dial its own.
    network: str = ""
    ranks: list[RankIdentity] = []
    kvpush: bool = True

    def to_query(self) -> dict[str, Any]:
        """As JSON carries it."""
        return msgspec.to_builtins(self)


def parse_identity(answer: Any, where: str = "the answer") -> InstanceIdentity:
    """`answer` (decoded JSON) as an InstanceIdentity; IdentityError naming what is
    wrong if it is not one."""
    if not isinstance(answer, dict) or not answer.get("kvpush"):
        raise IdentityError(f"{where} is not a kvpush identity")
    try:
        return msgspec.convert(answer, InstanceIdentity)
    except msgspec.ValidationError as exc:
        raise IdentityError(f"{where} is not a kvpush identity: {exc}") from None


def mooncake_query(identities: list[InstanceIdentity]) -> dict[str, Any]:
    """This instance as Mooncake's bootstrap `GET /query` answers it: one entry per
    data-parallel rank (each rank is its own engine, `<engine id>_dp<rank>`)."""
    answer = {}
    for identity in identities:
        workers = {str(r): {"0": f"tcp://{a}"} for r, a in enumerate(identity.addresses)}
        answer[str(identity.dp_rank)] = {
            "engine_id": identity.engine_id,
            "worker_addr": workers,
            "kvpush": identity.to_query(),
        }
    return answer


class _Unredirected(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: an identity endpoint answers where it was asked, and
    one that could send the asker elsewhere could make it fetch any URL."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_Unredirected)


def fetch_query(address: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """A bootstrap server's GET /query answer (at most MAX_ANSWER bytes of it), read
    within about `timeout` seconds in all: the socket's timeout bounds each read
    only, and a server trickling a byte at a time would otherwise hold a query
    thread for as long as it liked."""
    deadline = time.monotonic() + timeout
    with _NO_REDIRECTS.open(address.rstrip("/") + "/query", timeout=timeout) as response:
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


def dp_siblings(
    identity_url: str, first: InstanceIdentity, most: int = 256
) -> list[InstanceIdentity]:
    """The identities of DP ranks 1, 2, ... of the instance whose DP rank 0 answers at
    `identity_url` (http://host:port) with `first`: each at the next port, until a port
    does not answer with a sibling (vLLM names DP rank d's engine `<base>_dp<d>`).
    None for an instance that is not data parallel."""
    if not first.data_parallel:
        return []
    parts = urllib.parse.urlsplit(identity_url)
    base = first.engine_id.removesuffix("_dp0")
    found = []
    for rank in range(1, most):
        url = f"{parts.scheme}://{parts.hostname}:{(parts.port or 0) + rank}"
        try:
            identity = parse_identity(fetch_query(url), url)
        except (OSError, ValueError, IdentityError):
            break
        if identity.engine_id != f"{base}_dp{rank}":
            break
        found.append(identity)
    return found


def decode_params(transfer_id: str, identity: InstanceIdentity) -> dict[str, Any]:
    """A decode leg's kv_transfer_params: take `transfer_id`'s KV from the prefill
    instance `identity`."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "transfer_mode": identity.transfer_mode,
        "remote_engine_id": identity.engine_id,
        "remote_epoch": identity.epoch,
        "remote_addresses": list(identity.addresses),
        "tp_size": identity.tp_size,
        "remote_block_size": identity.block_size,
        "remote_block_pages": identity.block_pages,
        "remote_kv_groups": identity.kv_groups,
        "remote_kv_states": identity.kv_states,
        "remote_dp_rank": identity.dp_rank,
        "remote_data_parallel": identity.data_parallel,
        "remote_seeds_rewind": identity.seeds_rewind,
        "remote_network": identity.network,
    }


# In a prefill answer's kv_transfer_params: the leg stopped before its prompt's last
# token (a recurrent-state model: kvpush.vllm.groups), so its one generated token is
# not the prompt's next, and a router must not stream it as the first.
PROMPT_CUT = "kvpush_prompt_cut"
# In a prefill answer's kv_transfer_params: what lets the router have prefill let go
# of the KV when the decode leg fails before decode took it (kvpush.vllm.release).
# For the router alone: it is never relayed to a client. It goes back to the prefill
# instance's identity endpoint, at RELEASE_PATH.
RELEASE_TOKEN = "release_token"
RELEASE_PATH = "/kvpush/release"


def prefill_echo(
    transfer_id: str,
    identity: InstanceIdentity,
    groups: Sequence[Sequence[int]],
    request_id: str,
    num_tokens: int,
    engine_transfer_id: str = "",
    release_token: str | None = None,
) -> dict[str, Any]:
    """What a prefill instance answers in kv_transfer_params: the decode leg's params,
    plus upstream NixlConnector's fields. `remote_host`/`remote_port` name this
    instance's identity endpoint (as upstream's name the endpoint serving every
    rank's handshake): a decode handed only those finds the rest there.
    `request_id` is the id a router that matches legs by X-Request-Id knows it by;
    `engine_transfer_id` the transfer this answer's KV is held under (a retried leg's
    is not the first attempt's: kvpush.vllm.transfers); `release_token` the token
    that releases it (none on an instance without a secret)."""
    host, _, port = identity.endpoint.rpartition(":")
    release = {RELEASE_TOKEN: release_token} if release_token else {}
    return {
        **decode_params(transfer_id, identity),
        "remote_block_ids": [[int(b) for b in group] for group in groups],
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port),
        "pp_size": 1,
        "dcp_size": 1,
        "remote_num_tokens": int(num_tokens),
        "remote_transfer_id": engine_transfer_id,
        **release,
    }


def identity_from_decode_params(params: dict[str, Any]) -> InstanceIdentity | None:
    """The prefill identity a decode leg's kv_transfer_params name (None if they name
    none, or not in kvpush's types)."""
    named = {
        "kvpush": True,
        "engine_id": params.get("remote_engine_id"),
        "epoch": params.get("remote_epoch"),
        "transfer_mode": params.get("transfer_mode"),
        "addresses": params.get("remote_addresses"),
        "tp_size": params.get("tp_size"),
        "block_size": params.get("remote_block_size", 0),
        "block_pages": params.get("remote_block_pages", True),
        "kv_groups": params.get("remote_kv_groups", 1),
        "kv_states": params.get("remote_kv_states", 0),
        "dp_rank": params.get("remote_dp_rank", 0),
        "data_parallel": params.get("remote_data_parallel", False),
        "seeds_rewind": params.get("remote_seeds_rewind", False),
        "network": params.get("remote_network", ""),
    }
    try:
        return parse_identity(named)
    except IdentityError:
        return None
