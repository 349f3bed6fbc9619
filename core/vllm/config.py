"""KVPushConnector settings, read from kv_connector_extra_config and validated.

Every key is listed here; an unknown key or a bad value is a ConfigError naming it,
raised when vLLM builds the connector, before any request.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.addresses import choose_host, wildcard
from kvpush.errors import ConfigError
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.handshake import ROLES
from kvpush.transport.agent import WRITE_ORDERS, AgentConfig
from kvpush.vllm.upstream_keys import unknown_keys

log = logging.getLogger(__name__)

ENV_SECRET = "KVPUSH_SECRET"
ENV_SECRET_FILE = "KVPUSH_SECRET_FILE"
ENV_INSECURE = "KVPUSH_INSECURE"
MIN_SECRET_BYTES = 16
# Never the value: vLLM may have logged it with its arguments already.
INLINE_SECRET = (
    "kv_connector_extra_config key 'secret' is refused: vLLM logs its arguments at "
    f"start-up and `ps` shows them. Give the secret in ${ENV_SECRET}, or in a file "
    f"named by ${ENV_SECRET_FILE} or the 'secret_file' setting (`kvpush secret` prints "
    "a new one; replace one that was set inline, as vLLM may have logged it)"
)
# KVPUSH_INSECURE's spellings; anything else is refused rather than guessed at.
FLAG_ON = ("1", "true", "yes")
FLAG_OFF = ("0", "false", "no", "")
# vLLM's kv_role for each kvpush role: kv_producer -> producer, and so on.
KV_ROLES = {f"kv_{role}": role for role in ROLES}

_PROTOCOL_KEYS = {f.name for f in dataclasses.fields(ProtocolConfig)} - {"mode"}


GRANULARITIES = ("request", "layer", "chunk")


@dataclass(frozen=True)
class ConnectorConfig:
    """What kv_connector_extra_config may hold (all optional).

    mode: "push" (default) or "pull".
    host: address peers reach this instance on, advertised in its identity (default:
        $VLLM_HOST_IP, else the address of the interface the default route leaves by,
        else 127.0.0.1; kvpush.addresses.choose_host).
    port: side-channel port of the first worker; TP rank r of DP rank d listens on
        port + d * tp_size + r (0: any free).
    identity_port: where this instance serves GET /query, its kvpush identity for
        routers (0: any free port; the prefill echo's remote_host and remote_port
        name it); DP rank d serves its own on identity_port + d.
    bootstrap_port: where this instance serves Mooncake's bootstrap GET /query, for
        routers built for MooncakeConnector (0: not served; kvpush.vllm.bootstrap).
        DP rank 0 serves it for every DP rank (with DP > 1 it asks the others at
        their identity ports, so identity_port must be set too).
    secret_file: a file holding the deployment's shared secret, which authenticates
        every side-channel message and gates the NIXL metadata that opens the KV cache
        to a peer (default: $KVPUSH_SECRET, else $KVPUSH_SECRET_FILE; `kvpush secret`
        prints a new one). The secret itself is no setting: vLLM logs its arguments
        and `ps` shows them.
    insecure: run without a secret (default false; or $KVPUSH_INSECURE=1): anyone
        who can reach an instance's API or side channel can then read and write its
        KV cache. Without a secret and without this, the instance refuses to start.
    allowed_producers: the producers a decode instance may dial, as host, host:port
        or CIDR network entries (default: any; a decode leg names its producer, so
        restrict this wherever clients reach decode's API directly).
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
    reader_spin_s: how long a reader of vLLM's step and result queues spins after a
        read before it sleeps on the queue's socket (vLLM: 1 s, hard-coded). A decode
        serving a request a second otherwise spins a core between requests
        (default 0.002; 1 keeps vLLM's; reaches into vLLM's private queues).
    nixl_backends: NIXL backends to use (default: the device backend's choice).
    ucx_error_handling: "none" (default, fastest here) or "peer".
    write_order: how one decode's WRITEs are posted: "oldest_first", one at a time,
        the oldest request's first; "side_by_side", each as it is ready; "auto"
        (default), oldest_first where UCX carries them over TCP (docs/two-hosts.md).
    device_options: passed to the device backend (e.g. {"staging": "host"}).
    Protocol timers (seconds): lease_s, registration_ttl_s, watchdog_s, heartbeat_s,
        write_grace_s, landing_s, max_wait_s, tombstone_s, orphan_grace_s, silence_s.
    """

    mode: str = "push"
    host: str = ""  # "": chosen at construction (choose_host)
    port: int = 0
    identity_port: int = 0
    bootstrap_port: int = 0
    secret_file: str | None = None
    insecure: bool = False
    allowed_producers: tuple[str, ...] = ()
    push_granularity: str = "chunk"
    idle_wait_s: float = 0.1
    park_workers: bool = True
    reader_spin_s: float = 0.002
    nixl_backends: tuple[str, ...] = ()
    ucx_error_handling: str = "none"
    write_order: str = "auto"
    device_options: dict[str, Any] = field(default_factory=dict)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    # Where every listener binds (side channels, identity and bootstrap endpoints); no
    # setting of its own. A `host` the operator set is the interface they chose for
    # kvpush: listening there alone keeps the endpoints (the identity endpoint's
    # routes change state too) off the other interfaces of a multi-homed host. A
    # chosen `host` binds every interface, as vLLM's API server does by default:
    # routers name the identity endpoint by the host of the instance's API URL,
    # which may be any of its addresses (localhost on one host, a cluster network
    # that is not the default route's), and peers dial the advertised address.
    listen: str = ""

    def __post_init__(self) -> None:
        if not self.host:
            object.__setattr__(self, "host", choose_host())
            object.__setattr__(self, "listen", self.listen or wildcard(self.host))
        elif not self.listen:
            object.__setattr__(self, "listen", self.host)

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
        return AgentConfig(ucx_error_handling=self.ucx_error_handling, write_order=self.write_order)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        if "layerwise" in extra:
            raise ConfigError(
                "kv_connector_extra_config key 'layerwise' was replaced by "
                "push_granularity: 'layer' (layerwise true), 'request' (false), or 'chunk'"
            )
        if "secret" in extra:
            raise ConfigError(INLINE_SECRET)
        plain = {f.name for f in dataclasses.fields(cls)} - {"protocol", "listen"}
        unknown = set(extra) - plain - _PROTOCOL_KEYS
        if unknown:
            raise ConfigError(unknown_keys(unknown, plain | _PROTOCOL_KEYS))
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
        "secret_file": str,
        "insecure": bool,
        "push_granularity": str,
        "park_workers": bool,
        "ucx_error_handling": str,
        "write_order": str,
    }
    if key in expected:
        kind = expected[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{key} must be a {kind.__name__}, got {value!r}")
    if key in ("idle_wait_s", "reader_spin_s"):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 <= value <= 1:
            raise ConfigError(f"{key} must be a number of seconds in [0, 1], got {value!r}")
        return float(value)
    if key == "push_granularity" and value not in GRANULARITIES:
        raise ConfigError(f"push_granularity must be one of {GRANULARITIES}, got {value!r}")
    if key == "host" and value.strip("[]") in ("", "0.0.0.0", "::"):
        raise ConfigError(
            f"host must be an address peers can dial, got {value!r}: kvpush listens on "
            "every interface by itself when host is not set"
        )
    if key == "mode" and value not in ("push", "pull"):
        raise ConfigError(f"mode must be 'push' or 'pull', got {value!r}")
    if key in ("port", "identity_port", "bootstrap_port") and not 0 <= value < 65536:
        raise ConfigError(f"{key} must be a TCP port (0-65535), got {value}")
    if key == "ucx_error_handling" and value not in ("none", "peer"):
        raise ConfigError(f"ucx_error_handling must be 'none' or 'peer', got {value!r}")
    if key == "write_order" and value not in WRITE_ORDERS:
        raise ConfigError(f"write_order must be one of {WRITE_ORDERS}, got {value!r}")
    if key == "nixl_backends":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"nixl_backends must be a list of names, got {value!r}")
        return tuple(value)
    if key == "allowed_producers":
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"allowed_producers must be a list of hosts, got {value!r}")
        return tuple(check_allowed(v) for v in value)
    if key == "device_options" and not isinstance(value, dict):
        raise ConfigError(f"device_options must be an object, got {value!r}")
    return value


def load_secret(config: ConnectorConfig) -> bytes:
    """The deployment's shared secret: the `secret_file` setting, else $KVPUSH_SECRET,
    else $KVPUSH_SECRET_FILE. None at all is a ConfigError unless the operator chose
    to run insecure (then b"", with a warning)."""
    chose_insecure = insecure(config)  # a bad $KVPUSH_INSECURE stops every start
    value, source = _secret_source(config)
    if value:
        if len(value) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the shared secret from {source} is {len(value)} bytes; use at least "
                f"{MIN_SECRET_BYTES} (`kvpush secret` prints one)"
            )
        return value
    if not chose_insecure:
        raise ConfigError(
            f"no shared secret: set {ENV_SECRET} (or {ENV_SECRET_FILE}, or the "
            "'secret_file' setting) to the same value on every prefill and decode instance; "
            "`kvpush secret` prints a new one. To run without one, set 'insecure': true "
            f"(or {ENV_INSECURE}=1): anyone who can reach an instance can then read and "
            "write its KV cache"
        )
    log.warning(
        "kvpush: INSECURE: no shared secret ('insecure' is set): anyone who can reach "
        "this instance's API or side channel can read and write its KV cache"
    )
    return b""


def insecure(config: ConnectorConfig) -> bool:
    """Whether the operator chose to run without a secret."""
    return env_flag(ENV_INSECURE) or config.insecure


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Environment variable `name` (of `environ`, default the process's) as a boolean:
    "1", "true", "yes" on; "0", "false", "no", empty or unset off, in any case. Any
    other value is a ConfigError: "off" or "enabled" must not be taken for either."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in FLAG_ON:
        return True
    if value in FLAG_OFF:
        return False
    choices = ", ".join(repr(v) for v in FLAG_ON + FLAG_OFF)
    raise ConfigError(f"{name}={raw!r} is not a boolean: use one of {choices}")


def _secret_source(config: ConnectorConfig) -> tuple[bytes, str]:
    if config.secret_file:
        return _read_secret(config.secret_file), f"the file {config.secret_file}"
    if os.environ.get(ENV_SECRET):
        return os.environ[ENV_SECRET].encode(), f"${ENV_SECRET}"
    if os.environ.get(ENV_SECRET_FILE):
        path = os.environ[ENV_SECRET_FILE]
        return _read_secret(path), f"the file {path} (${ENV_SECRET_FILE})"
    return b"", ""


def _read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as secret:
            value = secret.read(4097).strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the shared secret file {path}: {exc}") from exc
    if not value:
        raise ConfigError(f"the shared secret file {path} is empty")
    return value


def new_secret() -> str:
    """A fresh shared secret for a deployment."""
    return secrets.token_urlsafe(32)


def check_allowed(entry: str) -> str:
    """An allowed_producers entry, checked: a host, host:port, or a CIDR network."""
    try:
        ipaddress.ip_network(entry, strict=False)
        return entry
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,253}(:\d{1,5})?", entry):
        raise ConfigError(f"allowed_producers entry {entry!r} is not a host, host:port or network")
    return entry


def producer_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    """Whether `address` (host:port, or a URL's host and port) is one `allowed` lets a
    decode dial; an empty `allowed` lets any."""
    if not allowed:
        return True
    host = address.rpartition(":")[0].strip("[]")
    for entry in allowed:
        if entry in (address, host):
            return True
        try:
            network = ipaddress.ip_network(entry, strict=False)
            if ipaddress.ip_address(host) in network:
                return True
        except ValueError:
            continue
    return False


def rank_port(base: int, offset: int) -> int:
    """The port of the engine part `offset` places after the first: base + offset, or
    0 (any free port) when no base is configured."""
    return base + offset if base else 0
