"""KVPushConnector under Ray Serve LLM's prefill/decode pattern (`build_pd_openai_app`).

Ray's P/D orchestrator (the decode replica) asks a *connector backend*, looked up by
the `kv_connector` name in Ray's registry, how to shape the two legs and whether it
may send them at once. Unregistered, KVPushConnector gets Ray's default: NIXL's
sequential shape, which kvpush serves too (the prefill instance names the transfer),
but only one after the other. Registered, this backend lets push mode do what it is
for: Ray binds the prefill replica first, both legs carry one transfer id derived
from Ray's request id, and the decode leg names the prefill replica's bootstrap
server (kvpush.vllm.bootstrap), so decode registers its blocks while prefill
computes. Pull mode keeps the sequential hand-off and forwards the prefill's echo.
Built with `build_pd_app`, the decode replicas are kvpush's own
(kvpush.ray_stream), and a streaming client's first token comes from prefill.

    import kvpush.ray_serve
    kvpush.ray_serve.register()          # in the driver, before building the app
    config = {...}                       # KVPushConnector in both kv_transfer_configs
    kvpush.ray_serve.share_secret(config)  # one secret for this deployment's replicas
    app = kvpush.ray_serve.build_pd_app(config)   # or Ray's build_pd_openai_app

`register()` writes to Ray's internal registry (`ray.llm._internal`), and
`build_pd_app` swaps the decode class Ray's builder names: Ray 2.60 has no public
way to do either.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import ray
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend

from kvpush.ports import free_port
from kvpush.ray_stream import PREFILL_ANSWER, KVPushDecodeServer, as_body, seed_of, serves
from kvpush.router import first_token
from kvpush.router.legs import prefill_leg
from kvpush.vllm.config import ENV_SECRET, new_secret

CONNECTOR = "KVPushConnector"


def share_secret(pd_config: dict[str, Any], secret: str | None = None) -> str:
    """Give a P/D app config's prefill and decode replicas one shared secret (a new one
    unless given), in each replica's environment ($KVPUSH_SECRET): a kvpush instance
    refuses to start without one. The secret."""
    secret = secret or new_secret()
    for key in ("prefill_config", "decode_config"):
        runtime = pd_config[key].setdefault("runtime_env", {})
        runtime.setdefault("env_vars", {})[ENV_SECRET] = secret
    return secret


def register() -> None:
    """Make Ray Serve LLM shape KVPushConnector's legs with this backend."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    if not KVConnectorBackendFactory.is_registered(CONNECTOR):
        KVConnectorBackendFactory.register_backend(CONNECTOR, f"{__name__}:KVPushBackend")


def build_pd_app(pd_config: dict[str, Any]) -> Any:
    """Ray's `build_pd_openai_app`, its decode replicas kvpush's own
    (kvpush.ray_stream.KVPushDecodeServer): a streaming client's first token comes
    from the prefill leg. Ray 2.60's builder names its decode class inside; it is
    swapped there for this one call. Data-parallel decode keeps Ray's. Call
    register() first, as for Ray's builder."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder

    ray_own = builder.PDDecodeServer
    builder.PDDecodeServer = KVPushDecodeServer
    try:
        return builder.build_pd_openai_app(pd_config)
    finally:
        builder.PDDecodeServer = ray_own


class KVPushBackend(BaseConnectorBackend):
    """Ray's view of KVPushConnector: push binds the peer and hands off at once."""

    _peer: dict[str, Any] | None = None  # what a prefill replica publishes
    # Set by kvpush's decode replica (kvpush.ray_stream), which then opens a streaming
    # client's answer with the prefill leg's token: both legs sample it alike.
    first_token: bool = False

    @property
    def _push(self) -> bool:
        return self._extra().get("mode", "push") == "push"

    @property
    def requires_peer_binding(self) -> bool:  # type: ignore[override]
        return self._push

    @property
    def concurrent_handoff(self) -> bool:  # type: ignore[override]
        return self._push

    def setup(self) -> None:
        """Before the engine starts: a routable side channel, and (push) a bootstrap
        server and engine id of this replica's own for decode legs to name."""
        extra = self._extra()
        host = ray.util.get_node_ip_address()
        extra.setdefault("host", host)
        if extra.get("identity_port"):
            # A base, like every port a deployment's replicas share a config for.
            extra["identity_port"] = int(extra["identity_port"]) + self._compute_port_offset()
        if not self._push:
            return
        # Decode legs learn the port from this replica's metadata, so any free one
        # does; a configured bootstrap_port is a base, offset per replica.
        base = int(extra.get("bootstrap_port") or 0)
        port = base + self._compute_port_offset() if base else free_port()
        extra["bootstrap_port"] = port
        engine_id = self.kv_transfer_config.setdefault("engine_id", f"kvpush-{uuid.uuid4().hex}")
        self._peer = {"kvpush_bootstrap": f"http://{host}:{port}", "engine_id": engine_id}

    def replica_metadata(self) -> dict[str, Any]:
        return dict(self._peer or {})

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        # The client's request cut to its prompt, as kvpush router cuts it; or, for
        # a first token from prefill, kept whole for one token with decode's seed.
        body, transfer_id = request.model_dump(), _transfer_id(request)
        if self._first_token(request):
            body["seed"] = _seed(request, transfer_id)
            leg = first_token.prefill_leg(body, transfer_id)
        else:
            leg = prefill_leg(body, transfer_id)
        leg["kv_transfer_params"]["do_remote_prefill"] = False
        return type(request).model_validate(leg)

    def prepare_decode_request(
        self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any | None
    ) -> Any:
        decode = request.model_copy(deep=True)
        if prefill_response is not None:  # sequential (pull): the echo names it all
            decode.kv_transfer_params = prefill_response.kv_transfer_params
            if self._first_token(request):  # prefill's token opens the stream
                decode.seed = _seed(request, _transfer_id(request))
                answer = {PREFILL_ANSWER: prefill_response.model_dump()}
                decode.kv_transfer_params = {**(decode.kv_transfer_params or {}), **answer}
            return decode
        if not peer or "kvpush_bootstrap" not in peer:
            raise ValueError(
                "the prefill replica published no kvpush bootstrap address: is "
                "KVPushConnector in push mode on the prefill deployment too?"
            )
        transfer_id = _transfer_id(request)
        decode.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": peer["engine_id"],
            "remote_bootstrap_addr": peer["kvpush_bootstrap"],
        }
        if self._first_token(request):
            decode.seed = _seed(request, transfer_id)
        return decode

    def _first_token(self, request: Any) -> bool:
        """Whether the client's first token comes from the prefill leg."""
        return self.first_token and serves(request)

    def _extra(self) -> dict[str, Any]:
        return self.kv_transfer_config.setdefault("kv_connector_extra_config", {})


def _seed(request: Any, transfer_id: str) -> int | None:
    """The client's seed; for a sampled request without one (served only where the
    engine's generators rewind: kvpush.ray_stream.serves), the one both legs take
    from the transfer id."""
    seed = getattr(request, "seed", None)
    if seed is not None or not first_token.needs_seed(as_body(request)):
        return seed
    return seed_of(transfer_id)


def _transfer_id(request: Any) -> str:
    """One per Ray request, alike for both legs: the two prepare calls are separate
    and keep no state between them."""
    return "ray-" + hashlib.sha256(str(request.request_id).encode()).hexdigest()[:32]
