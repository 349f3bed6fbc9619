"""vLLM plugin: makes "KVPushConnector" usable in --kv-transfer-config by name.

Registered under the `vllm.general_plugins` entry point, which vLLM calls in every
process it starts; registering twice is harmless (kvpush.vllm.hooks).
"""

from __future__ import annotations


def register() -> None:
    from kvpush.vllm.hooks import register_connector

    register_connector()
