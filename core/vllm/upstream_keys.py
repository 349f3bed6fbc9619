"""Settings a user of vLLM's own NixlConnector brings along, and what kvpush calls them.

An unknown kv_connector_extra_config key is refused (kvpush.vllm.config); the error
says what the key most likely meant: kvpush's name for an upstream setting, or the
known key closest in spelling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpush.errors import ConfigError, did_you_mean

HOST_STAGING = 'device_options {"staging": "host"}'

#: NixlConnector's kv_connector_extra_config keys (vLLM 0.32-0.34), and kvpush's answer.
UPSTREAM_EXTRA: dict[str, str] = {
    "backends": "kvpush calls it 'nixl_backends' (e.g. [\"UCX\"])",
    "kv_buffer_device": (
        "a top-level --kv-transfer-config field upstream, not an extra key; to copy KV "
        f"through host memory, kvpush takes {HOST_STAGING}"
    ),
    "kv_lease_duration": "kvpush's lease is 'lease_s' (seconds; heartbeats extend it)",
    "push_registration_timeout": (
        "kvpush's is 'registration_ttl_s' (how long prefill keeps a decode's claim)"
    ),
    "decoder_kv_blocks_ttl": "kvpush's decode waits at most 'max_wait_s' for a transfer",
    "engine_ttl": "kvpush drops a silent peer after 'silence_s'",
    "num_threads": "kvpush's handshakes run on each worker's one NIXL thread: no setting",
    "enforce_handshake_compat": "kvpush's handshake always compares both sides' layouts",
    "kv_recompute_threshold": "kvpush has no equivalent: every prompt's KV is pushed",
    "bidirectional_kv_xfer": "kvpush has no equivalent: KV moves prefill to decode only",
}


def unknown_keys(unknown: Iterable[str], known: Iterable[str]) -> str:
    """The error for keys KVPushConnector does not read, each with what it most likely meant."""
    unknown, known = sorted(unknown), sorted(known)
    hints = [_hint(key, known) for key in unknown]
    said = "".join(f"; {hint}" for hint in hints if hint)
    return (
        f"unknown kv_connector_extra_config key(s) {unknown} for KVPushConnector{said}; "
        f"known: {known}"
    )


def _hint(key: str, known: list[str]) -> str:
    if key in UPSTREAM_EXTRA:
        return f"{key!r} is upstream NixlConnector's: {UPSTREAM_EXTRA[key]}"
    close = did_you_mean(key, known)
    return f"{key!r}{close}" if close else ""


def check_buffer_device(
    kv_buffer_device: str, device_type: str, device_options: Mapping[str, Any]
) -> None:
    """Refuse upstream's way of staging KV through host memory where kvpush would
    ignore it. kvpush registers the device cache itself, so kv_buffer_device "cpu" on
    a GPU would move KV directly while its author believes it staged."""
    if kv_buffer_device != "cpu" or device_type == "cpu":
        return
    if device_options.get("staging") == "host":
        return
    raise ConfigError(
        f'kv_buffer_device "cpu" is upstream NixlConnector\'s host staging, which kvpush '
        f"does not read: on {device_type} its KV would move directly. Set "
        f"kv_connector_extra_config {HOST_STAGING} to stage through host memory, or "
        "drop kv_buffer_device for the direct path"
    )
