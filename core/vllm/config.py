"""KVPushConnector settings, read from kv_connector_extra_config and validated.

Every key is listed here; an unknown key or a bad value is a ConfigError naming it,
raised when vLLM builds the connector, before any request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.errors import ConfigError
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.handshake import ROLES
from kvpush.transport.agent import AgentConfig

log = logging.getLogger(__name__)

ENV_SECRET = "KVPUSH_SECRET"
# vLLM's kv_role for each kvpush role: kv_producer -> producer, and so on.
KV_ROLES = {f"kv_{role}": role for role in ROLES}

_PROTOCOL_KEYS = {f.name for f in dataclasses.fields(ProtocolConfig)} - {"mode"}


GRANULARITIES = ("request", "layer", "chunk")


@dataclass(frozen=True)
class ConnectorConfig:
    """What kv_connector_extra_config may hold (all optional).

    mode: "push" (default) or "pull".
    host: address peers reach this instance's side channel on (default 127.0.0.1;
        use the host's routable address across machines).
    port: side-channel port of the first worker; TP rank r of DP rank d listens on
        port + d * tp_size + r (0: any free).
    identity_port: where this instance serves GET /query, its kvpush identity for
        routers (0: any free port; the prefill echo's remote_host and remote_port
        name it); DP rank d serves its own on identity_port + d.
    bootstrap_port: where this instance serves Mooncake's bootstrap GET /query, for
        routers built for MooncakeConnector (0: not served; kvpush.vllm.bootstrap).
        DP rank 0 serves it for every DP rank (with DP > 1 it asks the others at
        their identity ports, so identity_port must be set too).
    secret: shared secret for message authentication (default $KVPUSH_SECRET).
    push_granularity: when a producer's KV leaves for decode (push mode):
        "request": all of it once the prompt's last step ends;
        "layer": in that last step, each layer as the forward pass writes it;
        "chunk" (default): also, with chunked prefill, each earlier step's completed
        blocks as that step ends, so the last step moves only its own (the same as
        "layer" for a prompt computed in one step; docs/protocol.md).
    idle_wait_s: longest an engine step that has nothing to compute but transfers to
        wait for sleeps until a transfer ends, a request or abort reaches the engine,
        or this many seconds pass (default 0.1; 0 turns the wait off). Only a ring
        that cannot arrive waits the bound out: a worker on another host (multi-node
        TP), or an engine without vLLM's request queue (in-process, offline).
    park_workers: let an idle worker sleep on its step queue instead of spinning
        through those waits (default true; reaches into vLLM's private queue).
    nixl_backends: NIXL backends to use (default: the device backend's choice).
    ucx_error_handling: "none" (default, fastest here) or "peer".
    device_options: passed to the device backend (e.g. {"staging": "host"}).
    Protocol timers (seconds): lease_s, registration_ttl_s, watchdog_s, heartbeat_s,
        write_grace_s, landing_s, max_wait_s, tombstone_s, orphan_grace_s.
    """

    mode: str = "push"
    host: str = "127.0.0.1"
    port: int = 0
    identity_port: int = 0
    bootstrap_port: int = 0
    secret: str | None = None
    push_granularity: str = "chunk"
    idle_wait_s: float = 0.1
    park_workers: bool = True
    nixl_backends: tuple[str, ...] = ()
    ucx_error_handling: str = "none"
    device_options: dict[str, Any] = field(default_factory=dict)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)

    @property
    def layerwise(self) -> bool:
        """Push the last step's KV layer by layer (any granularity but "request")."""
        return self.push_granularity != "request"

    @property
    def progressive(self) -> bool:
        """Push earlier chunks' KV before the last step (push mode only)."""
        return self.push_granularity == "chunk" and self.protocol.mode == "push"

    @property
    def agent(self) -> AgentConfig:
        return AgentConfig(ucx_error_handling=self.ucx_error_handling)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        if "layerwise" in extra:
            raise ConfigError(
                "kv_connector_extra_config key 'layerwise' was replaced by "
                "push_granularity: 'layer' (layerwise true), 'request' (false), or 'chunk'"
            )
        plain = {f.name for f in dataclasses.fields(cls)} - {"protocol"}
        unknown = sorted(set(extra) - plain - _PROTOCOL_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KVPushConnector; "
                f"known: {sorted(plain | _PROTOCOL_KEYS)}"
            )
        timers = {k: extra.pop(k) for k in list(extra) if k in _PROTOCOL_KEYS}
        values = {k: _checked(k, v) for k, v in extra.items()}
        mode = values.get("mode", "push")
        protocol = ProtocolConfig.from_mapping({"mode": mode, **timers})
        return cls(**values, protocol=protocol)


def _checked(key: str, value: Any) -> Any:
    """One value, type-checked, in the form the dataclass holds."""
    expected = {
        "mode": str,
        "host": str,
        "port": int,
        "identity_port": int,
        "bootstrap_port": int,
        "secret": str,
        "push_granularity": str,
        "park_workers": bool,
        "ucx_error_handling": str,
    }
    if key in expected:
        kind = expected[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{key} must be a {kind.__name__}, got {value!r}")
    if key == "idle_wait_s":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 <= value <= 1:
            raise ConfigError(f"idle_wait_s must be a number of seconds in [0, 1], got {value!r}")
        return float(value)
    if key == "push_granularity" and value not in GRANULARITIES:
        raise ConfigError(f"push_granularity must be one of {GRANULARITIES}, got {value!r}")
    if key == "mode" and value not in ("push", "pull"):
        raise ConfigError(f"mode must be 'push' or 'pull', got {value!r}")
    if key in ("port", "identity_port", "bootstrap_port") and not 0 <= value < 65536:
        raise ConfigError(f"{key} must be a TCP port (0-65535), got {value}")
    if key == "ucx_error_handling" and value not in ("none", "peer"):
        raise ConfigError(f"ucx_error_handling must be 'none' or 'peer', got {value!r}")
    if key == "nixl_backends":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"nixl_backends must be a list of names, got {value!r}")
        return tuple(value)
    if key == "device_options" and not isinstance(value, dict):
        raise ConfigError(f"device_options must be an object, got {value!r}")
    return value


_warned_no_secret = False


def load_secret(configured: str | bytes | None = None, required: bool = False) -> bytes:
    """The shared secret: configured value, else $KVPUSH_SECRET, else none (warned once)."""
    global _warned_no_secret
    value = configured if configured is not None else os.environ.get(ENV_SECRET)
    if isinstance(value, str):
        value = value.encode()
    if value:
        return value
    if required:
        raise ConfigError(f"no shared secret: set {ENV_SECRET} or the 'secret' setting")
    if not _warned_no_secret:
        _warned_no_secret = True
        log.warning(
            "kvpush: no shared secret (%s); control messages are integrity-checked but "
            "anyone who can reach the side channel can forge them",
            ENV_SECRET,
        )
    return b""


def rank_port(base: int, offset: int) -> int:
    """The port of the engine part `offset` places after the first: base + offset, or
    0 (any free port) when no base is configured."""
    return base + offset if base else 0
