"""The identity contract: what GET /query answers, read in one place, refused by name."""

from __future__ import annotations

import pytest

from kvpush.identities import (
    IdentityError,
    InstanceIdentity,
    decode_params,
    identity_from_decode_params,
    parse_identity,
    prefill_echo,
)

ANSWER = {
    "kvpush": True, "engine_id": "engine-p", "epoch": "b0-b1", "transfer_mode": "push",
    "tp_size": 2, "addresses": ["10.0.0.5:7100", "10.0.0.5:7101"], "endpoint": "10.0.0.5:8998",
    "block_size": 64, "ranks": [{"rank": 0, "address": "10.0.0.5:7100", "epoch": "b0"}],
}  # fmt: skip


def test_an_answer_reads_as_a_typed_identity_and_back():
    identity = parse_identity(ANSWER)
    assert (identity.tp_size, identity.block_size, identity.ranks[0].epoch) == (2, 64, "b0")
    assert parse_identity(identity.to_query()) == identity


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({**ANSWER, "tp_size": "2"}, "tp_size"),
        ({**ANSWER, "addresses": "10.0.0.5:7100"}, "addresses"),
        ({k: v for k, v in ANSWER.items() if k != "epoch"}, "epoch"),
        ({**ANSWER, "kvpush": False}, "not a kvpush identity"),
        ([ANSWER], "not a kvpush identity"),
    ],
)
def test_an_answer_that_is_not_an_identity_is_refused_naming_what_is_wrong(answer, named):
    with pytest.raises(IdentityError, match=named):
        parse_identity(answer, "http://p:8998/query's answer")


def test_a_decode_leg_names_the_identity_it_was_built_from():
    identity = parse_identity(ANSWER)
    named = identity_from_decode_params(decode_params("xfer-1", identity))
    assert named is not None
    assert (named.engine_id, named.addresses, named.block_size) == (
        "engine-p", identity.addresses, 64,
    )  # fmt: skip
    echo = prefill_echo("xfer-1", identity, [[3, 4]], "req-1", 100)
    assert (echo["remote_host"], echo["remote_port"]) == ("10.0.0.5", 8998)
    assert echo["remote_block_ids"] == [[3, 4]]


def test_params_in_the_wrong_types_name_no_identity():
    params = decode_params("xfer-1", parse_identity(ANSWER))
    assert identity_from_decode_params({**params, "tp_size": "two"}) is None
    assert identity_from_decode_params({"do_remote_prefill": True}) is None
    assert isinstance(identity_from_decode_params(params), InstanceIdentity)
