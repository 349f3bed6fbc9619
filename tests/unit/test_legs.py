"""A decode leg's kv_transfer_params read without vLLM (kvpush.legs): whether kvpush
can serve the leg, the producer it names, and completing a leg that names its
producer only by an endpoint. These run where vLLM is not installed."""

from __future__ import annotations

import pytest

from kvpush.identities import InstanceIdentity
from kvpush.legs import announce, decode_leg_problem, learn_producer, named_by_prefill
from kvpush.vllm.bootstrap import LegError


def _params(**override):
    params = {
        "do_remote_prefill": True, "transfer_id": "xfer-1", "transfer_mode": "push",
        "remote_engine_id": "engine-p", "remote_epoch": "e0-e1",
        "remote_addresses": ["10.0.0.5:7100", "10.0.0.5:7101"], "tp_size": 2,
    }  # fmt: skip
    return {**params, **override}


def test_a_leg_kvpush_can_serve_has_no_problem():
    assert decode_leg_problem(_params(), "push", 2, ()) is None
    assert decode_leg_problem(_params(), "push", 1, ("10.0.0.0/8",)) is None  # 2 into 1


@pytest.mark.parametrize(
    ("params", "mode", "world", "allowed", "reason", "says"),
    [
        ({"do_remote_prefill": True, "remote_block_ids": [[1]]}, "push", 2, (),
         "not_kvpush_params", "cannot pair with it"),
        (_params(transfer_id=""), "push", 2, (), "bad_transfer_id", "invalid transfer id"),
        (_params(transfer_id=7), "push", 2, (), "bad_transfer_id", "invalid transfer id"),
        (_params(transfer_mode="pull"), "push", 2, (), "mode_mismatch",
         "the prefill instance is in pull mode, this one in push"),
        (_params(remote_addresses=[]), "push", 2, (), "bad_addresses",
         "one side-channel host:port per"),
        (_params(remote_addresses="10.0.0.5:7100"), "push", 2, (), "bad_addresses",
         "one side-channel host:port per"),
        (_params(remote_addresses=["10.0.0.5"] * 2), "push", 2, (), "bad_addresses",
         "one side-channel host:port per"),
        (_params(), "push", 3, (), "tp_mismatch", "3"),
        (_params(), "push", 2, ("192.168.0.0/16",), "producer_not_allowed",
         "10.0.0.5:7100, which allowed_producers does not list"),
    ],
)  # fmt: skip
def test_a_leg_kvpush_cannot_serve_is_refused_naming_why(
    params, mode, world, allowed, reason, says
):
    found = decode_leg_problem(params, mode, world, allowed)
    assert found is not None
    assert found[0] == reason and says in found[1]


def test_the_announce_names_each_rank_its_boot_the_engine_and_the_network():
    named = announce("t-1", _params(remote_network="net-a"))
    assert named.transfer_id == "t-1"
    assert named.producers == ("10.0.0.5:7100", "10.0.0.5:7101")
    assert named.epochs == ("e0", "e1") and named.engine == "engine-p"
    assert named.network == "net-a"


def test_the_transfer_a_leg_without_one_claims_is_the_one_its_prefill_leg_named():
    # Both legs carry one X-Request-Id: the same derivation on both sides.
    assert named_by_prefill("cmpl-rid42-0-1a2b3c4d", {}) == "cmpl-rid42"
    # The router used other ids: the remote_request_id it names decides.
    mine = named_by_prefill("cmpl-unrelated-0-12341234", {"remote_request_id": "rid42"})
    assert mine == "cmpl-rid42"


class _Resolver:
    def __init__(self, identity: InstanceIdentity | None) -> None:
        self.identity = identity
        self.asked: list[tuple[str, str]] = []

    def producer(self, address: str, engine_id: str) -> InstanceIdentity | None:
        self.asked.append((address, engine_id))
        return self.identity


_PRODUCER = InstanceIdentity(
    engine_id="engine-p", epoch="e9", transfer_mode="push", tp_size=1,
    addresses=["10.0.0.5:7100"], endpoint="10.0.0.5:8000",
)  # fmt: skip


def test_a_leg_naming_its_producer_only_by_an_endpoint_is_completed_from_its_answer():
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 8000,
              "remote_engine_id": "engine-p", "remote_request_id": "rid42"}  # fmt: skip
    resolver = _Resolver(_PRODUCER)
    learnt = learn_producer("cmpl-rid42-0-99aa99aa", params, (), resolver)
    assert learnt == "http://10.0.0.5:8000"
    assert resolver.asked == [("http://10.0.0.5:8000", "engine-p")]
    assert params["remote_addresses"] == ["10.0.0.5:7100"]
    assert params["remote_epoch"] == "e9" and params["transfer_id"] == "cmpl-rid42"
    assert decode_leg_problem(params, "push", 1, ()) is None


def test_a_leg_whose_endpoint_is_still_being_asked_waits_and_one_naming_ranks_is_not_asked():
    by_endpoint = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://10.0.0.5:8998"}
    assert learn_producer("r1", by_endpoint, (), _Resolver(None)) is None
    assert "remote_addresses" not in by_endpoint
    resolver = _Resolver(_PRODUCER)
    assert learn_producer("r1", _params(), (), resolver) == ""
    assert resolver.asked == []


@pytest.mark.parametrize(
    ("params", "allowed", "reason"),
    [
        ({"remote_bootstrap_addr": "ftp://10.0.0.5:1"}, (), "bad_bootstrap_addr"),
        ({"remote_host": "bad host!", "remote_port": 80}, (), "bad_addresses"),
        ({"remote_host": "10.0.0.5", "remote_port": 8000}, ("10.9.0.0/16",),
         "producer_not_allowed"),
    ],
)  # fmt: skip
def test_an_endpoint_kvpush_may_not_ask_is_refused_before_it_is_asked(params, allowed, reason):
    resolver = _Resolver(_PRODUCER)
    with pytest.raises(LegError) as caught:
        learn_producer("r1", {"do_remote_prefill": True, **params}, allowed, resolver)
    assert caught.value.reason == reason and resolver.asked == []
