"""vLLM plugin: makes "KVPushConnector" usable in --kv-transfer-config by name.

Registered under the `vllm.general_plugins` entry point, which vLLM calls in every
process it starts; registering twice is harmless.
"""

from __future__ import annotations

from kvpush.vllm import CONNECTOR_MODULE, CONNECTOR_NAME


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises on a name it already has, built-ins included.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
