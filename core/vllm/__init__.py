"""kvpush inside vLLM: the KVPushConnector and its registration.

Importing this package does not import vLLM; `kvpush.vllm.connector` does.
"""

CONNECTOR_NAME = "KVPushConnector"
CONNECTOR_MODULE = "kvpush.vllm.connector"
