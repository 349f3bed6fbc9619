"""The address an instance advertises by default, where it listens, and the refusal
of a loopback address that leads elsewhere. Route tables are given as text: nothing
here reads or changes the machine's."""

from __future__ import annotations

import logging

import pytest

from kvpush import addresses
from kvpush.addresses import choose_host, default_interface, loopback_problem
from kvpush.errors import ConfigError
from kvpush.identities import InstanceIdentity, decode_params, identity_from_decode_params
from kvpush.vllm.config import ConnectorConfig

HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"
# A subnet route, a default route on eth1 (metric 100) and one on eth0 (metric 50),
# and a default route that is down.
TABLE = "\n".join([
    HEADER,
    "eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0",
    "eth1\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0",
    "eth0\t00000000\t010000C0\t0003\t0\t0\t50\t00000000\t0\t0\t0",
    "tun0\t00000000\t00000000\t0000\t0\t0\t1\t00000000\t0\t0\t0",
])  # fmt: skip
NO_DEFAULT = HEADER + "\neth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0"
INTERFACES = {"eth0": "192.0.2.7", "eth1": "192.168.0.9"}


def _no_routes() -> str:
    raise AssertionError("the routing table was read although VLLM_HOST_IP is set")


def test_vllm_host_ip_wins():
    chosen = choose_host({"VLLM_HOST_IP": "10.1.2.3"}, _no_routes, INTERFACES.get)
    assert chosen == "10.1.2.3"


def test_the_default_routes_interface_with_the_lowest_metric():
    assert default_interface(TABLE) == "eth0"
    assert choose_host({}, lambda: TABLE, INTERFACES.get) == "192.0.2.7"


def test_no_default_route_is_loopback_said_once(caplog, monkeypatch):
    monkeypatch.setattr(addresses, "_said", set())
    with caplog.at_level(logging.WARNING, logger="kvpush.addresses"):
        assert choose_host({}, lambda: NO_DEFAULT, INTERFACES.get) == "127.0.0.1"
        assert choose_host({}, lambda: "", INTERFACES.get) == "127.0.0.1"
    said = [r.getMessage() for r in caplog.records if "no default route" in r.getMessage()]
    assert len(said) == 1, said
    assert "advertising 127.0.0.1" in said[0] and "VLLM_HOST_IP" in said[0]


def test_a_default_interface_without_an_address_is_loopback_too(monkeypatch):
    monkeypatch.setattr(addresses, "_said", set())
    assert choose_host({}, lambda: TABLE, {}.get) == "127.0.0.1"


def test_the_real_interface_address_is_read_without_a_connection():
    assert addresses.interface_address("lo") == "127.0.0.1"
    assert addresses.interface_address("no-such-interface0") is None


def test_an_unset_host_is_chosen_and_listens_everywhere(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    config = ConnectorConfig.from_extra({})
    assert (config.host, config.listen) == ("10.1.2.3", "0.0.0.0")


def test_a_set_host_is_where_it_listens(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    config = ConnectorConfig.from_extra({"host": "10.9.9.9"})
    assert (config.host, config.listen) == ("10.9.9.9", "10.9.9.9")
    with pytest.raises(ConfigError, match="host must be an address peers can dial"):
        ConnectorConfig.from_extra({"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra({"listen": "0.0.0.0"})


def test_a_loopback_address_from_another_network_is_refused_with_the_reason():
    problem = loopback_problem("127.0.0.1:38503", "theirs", "ours")
    assert problem is not None
    assert "side channel at 127.0.0.1:38503, a loopback address" in problem
    assert "another host (or network namespace)" in problem
    assert "'host' setting (kv_connector_extra_config) or $VLLM_HOST_IP" in problem
    assert loopback_problem("[::1]:7", "theirs", "ours") is not None
    assert loopback_problem("localhost:7", "theirs", "ours") is not None


@pytest.mark.parametrize(
    ("peer", "theirs", "ours"),
    [
        ("127.0.0.1:1", "same", "same"),  # one network: its loopback is ours
        ("127.0.0.1:1", "", "ours"),  # a leg that does not say: the dial tells
        ("10.0.0.5:1", "theirs", "ours"),  # a routable address
    ],
)
def test_what_is_not_refused(peer, theirs, ours):
    assert loopback_problem(peer, theirs, ours) is None


def test_an_identity_carries_its_network_to_the_decode_leg():
    identity = InstanceIdentity(
        engine_id="e", epoch="x", transfer_mode="push", tp_size=1,
        addresses=["127.0.0.1:1"], network=addresses.network_id(),
    )  # fmt: skip
    params = decode_params("t", identity)
    assert params["remote_network"] == addresses.network_id()
    assert identity_from_decode_params(params).network == addresses.network_id()
