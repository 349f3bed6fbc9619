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
