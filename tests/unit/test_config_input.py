"""Connector settings are checked where they come in: device_options keys against
what each backend declares, unknown keys with what they most likely meant."""

from __future__ import annotations

import logging

import pytest

from kvpush.backend import BackendInfo, hookimpl
from kvpush.backend import plugins as plugins_module
from kvpush.backend.plugins import Backends
from kvpush.errors import ConfigError
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.upstream_keys import check_buffer_device


@pytest.fixture
def backends():
    return Backends(["host", "cuda", "neuron"])


@pytest.mark.parametrize(
    "device_type, known",
    [
        ("cuda", "['dims', 'pin_staging', 'staging', 'tokens_per_block']"),
        ("neuron", "['core_offset', 'dims', 'staging', 'tokens_per_block', 'visible_cores']"),
        ("cpu", "['tokens_per_block']"),
    ],
)
def test_an_unknown_device_option_is_refused_naming_the_known_ones(backends, device_type, known):
    # A typo must not pick a transfer path: {"stagng": "host"} would move KV directly.
    with pytest.raises(ConfigError) as caught:
        backends.prepare_process(device_type, 0, {"stagng": "host"})
    message = str(caught.value)
    assert "unknown device_options key(s) 'stagng'" in message
    assert message.endswith(f"known: {known}")


def test_a_misspelt_device_option_gets_a_did_you_mean(backends):
    with pytest.raises(ConfigError, match=r"'stagng' \(did you mean 'staging'\?\)"):
        backends.check_device_options({"stagng": "host"}, "cuda")


def test_every_declared_option_passes_and_any_backend_counts_without_a_device_type(backends):
    backends.check_device_options({"staging": "host", "pin_staging": False}, "cuda")
    backends.check_device_options({"visible_cores": "0", "core_offset": 2}, "neuron")
    backends.check_device_options({"visible_cores": "0", "pin_staging": True})
    with pytest.raises(ConfigError, match="'pinstaging'"):
        backends.check_device_options({"pinstaging": True})


def test_cuda_pin_staging_takes_a_boolean_only(backends):
    with pytest.raises(ConfigError, match="pin_staging must be true or false, got 'false'"):
        backends.prepare_process("cuda", 0, {"staging": "host", "pin_staging": "false"})


class _Undeclared:
    """A third-party backend written before backends declared their options."""

    @hookimpl
    def kvpush_backend_info(self) -> BackendInfo:
        return BackendInfo("legacy", ("legacydev",), ("DRAM",), ("direct",))


def test_a_backend_declaring_no_options_gets_every_key_with_one_warning(
    backends, caplog, monkeypatch
):
    monkeypatch.setattr(plugins_module, "_unchecked_warned", set())
    backends.add(_Undeclared(), "legacy")
    with caplog.at_level(logging.WARNING, logger="kvpush.backend.plugins"):
        backends.prepare_process("legacydev", 0, {"anything": 1})
        backends.prepare_process("legacydev", 0, {"anything": 1, "else": 2})
    warnings = [r.getMessage() for r in caplog.records if "legacy" in r.getMessage()]
    assert len(warnings) == 1 and "unchecked" in warnings[0]


@pytest.mark.parametrize(
    "key, hint",
    [
        ("backends", "kvpush calls it 'nixl_backends'"),
        ("kv_buffer_device", 'device_options {"staging": "host"}'),
        ("kv_lease_duration", "'lease_s'"),
        ("leese_s", "'leese_s' (did you mean 'lease_s'?)"),
        ("identity_prot", "did you mean 'identity_port'?"),
    ],
)
def test_an_unknown_key_says_what_it_most_likely_meant(key, hint):
    with pytest.raises(ConfigError) as caught:
        ConnectorConfig.from_extra({key: 1})
    message = str(caught.value)
    assert message.startswith(f"unknown kv_connector_extra_config key(s) ['{key}']")
    assert hint in message and "known: [" in message


def test_a_key_close_to_nothing_gets_no_guess():
    with pytest.raises(ConfigError) as caught:
        ConnectorConfig.from_extra({"zzzz": 1})
    assert "did you mean" not in str(caught.value)


def test_upstreams_host_staging_is_refused_where_kvpush_would_move_kv_directly():
    with pytest.raises(ConfigError, match=r'device_options \{"staging": "host"\}'):
        check_buffer_device("cpu", "cuda", {})
    with pytest.raises(ConfigError, match="on neuron"):
        check_buffer_device("cpu", "neuron", {"staging": "off"})
    check_buffer_device("cpu", "cuda", {"staging": "host"})  # both say the same
    check_buffer_device("cpu", "cpu", {})  # vLLM's CPU build: the cache is host memory
    check_buffer_device("cuda", "cuda", {})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_is_refused_as_it_would_be_advertised(host):
    with pytest.raises(ConfigError, match="address peers can dial"):
        ConnectorConfig.from_extra({"host": host})
