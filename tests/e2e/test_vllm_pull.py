"""Pull mode on real vLLM, and the fail policy."""

from __future__ import annotations

import pytest
from conftest import (
    DECODE_TIMERS,
    WRONG_KV,
    assert_request_shapes_match,
    assert_shared_prefixes_match,
    assert_streams_match,
    assert_unseeded_stream_is_decodes_own,
    extra_pair,
    perturbed_copy,
    prompt,
)

from kvpush.demo.servers import MODEL_NAME

# Servers take minutes to start on 2 cores; the first test pays for the session.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def pull_pair(cluster):
    with extra_pair(cluster, "pull", mode="pull", **DECODE_TIMERS) as url:
        yield url


def test_pull_outputs_equal_a_single_instance(cluster, pull_pair, client):
    single = cluster.servers["single"].url
    for n in (1, 128, 129, 333, 700):
        assert client.tokens(pull_pair, prompt(n, 50 + n)) == client.tokens(
            single, prompt(n, 50 + n)
        )
    body = {"model": MODEL_NAME, "prompt": prompt(260, 3), "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    assert client.stream_text(pull_pair, "/v1/completions", body) == client.stream_text(
        single, "/v1/completions", body
    )
    _pull_drained(cluster, client)


def _pull_drained(cluster, client) -> None:
    for name in ("pull_prefill", "pull_decode"):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_pull_n_list_prompts_min_tokens_and_logprobs_equal_a_single_instance(
    cluster, pull_pair, client
):
    assert_request_shapes_match(client, cluster.servers["single"].url, pull_pair)
    _pull_drained(cluster, client)


def test_pull_streams_take_their_first_token_from_prefill_and_equal_a_single_instance(
    cluster, pull_pair, client
):
    single = cluster.servers["single"].url
    assert_streams_match(client, single, pull_pair, seed=600)
    assert_unseeded_stream_is_decodes_own(client, pull_pair)
    assert client.metric(pull_pair, "kvpush_first_token_unusable_total") == 0
    # Three shapes end at their first token: decode's legs were read to their end.
    assert client.metric(pull_pair, "kvpush_decode_legs_drained_total") >= 3
    _pull_drained(cluster, client)


def test_pull_prompts_sharing_a_prefix_cached_on_decode_equal_a_single_instance(
    cluster, pull_pair, client
):
    assert_shared_prefixes_match(client, cluster.servers["single"].url, pull_pair, seed=400)
    _pull_drained(cluster, client)


def _decode_leg_params(client, cluster, prefill: str, transfer_id: str) -> dict:
    identity = client.http.get(cluster.identity_url(prefill) + "/query").json()
    return {
        "do_remote_prefill": True, "transfer_id": transfer_id,
        "transfer_mode": identity["transfer_mode"], "remote_engine_id": identity["engine_id"],
        "remote_epoch": identity["epoch"], "remote_addresses": identity["addresses"],
        "tp_size": identity["tp_size"],
    }  # fmt: skip


def test_pull_behind_a_sequential_orchestrator_without_transfer_ids(cluster, pull_pair, client):
    prefill, decode = cluster.servers["pull_prefill"].url, cluster.servers["pull_decode"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    for n in (129, 450):
        echo, tokens = client.sequential(prefill, decode, prompt(n, 2100 + n))
        assert echo["transfer_mode"] == "pull"
        assert tokens == client.tokens(cluster.servers["single"].url, prompt(n, 2100 + n)), n
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + 2


def test_pull_sequential_legs_from_a_prefill_with_other_kv_weights_change_decode_output(
    cluster, pull_pair, client
):
    """The negative control for the sequential flow in pull mode: decode reads the KV."""
    wrong = perturbed_copy(cluster.model, cluster.workdir / "model-other-kv-pull")
    cluster.add_server("pull_prefill_other_kv", "kv_producer", core=0, mode="pull", model=wrong)
    try:
        cluster.start("pull_prefill_other_kv")
        other = cluster.servers["pull_prefill_other_kv"].url
        decode, single = cluster.servers["pull_decode"].url, cluster.servers["single"].url
        for n in (129, 450):
            _, got = client.sequential(other, decode, prompt(n, 2200 + n), **WRONG_KV)
            assert got != client.tokens(single, prompt(n, 2200 + n)), f"decode ignored the KV ({n})"
    finally:
        cluster.servers.pop("pull_prefill_other_kv").stop()


def test_fail_policy_turns_a_lost_transfer_into_an_error(cluster, pull_pair, client):
    params = _decode_leg_params(client, cluster, "pull_prefill", "xfer-never-prefilled")
    response = client.complete(
        cluster.servers["pull_decode"].url, prompt(90), kv_transfer_params=params
    )
    assert response.status_code >= 500
    assert client.wait_drained(cluster.identity_url("pull_decode"))["receiving"] == 0
    # vLLM says only "Internal server error"; decode's trace keeps kvpush's reason,
    # which a router that knows decode's identity endpoint hands the client.
    traces = client.http.get(cluster.identity_url("pull_decode") + "/kvpush/trace").json()
    named = [t for t in traces if t["transfer_id"] == "xfer-never-prefilled"]
    assert any("watchdog_expired" in t.get("error", "") for t in named), named


def test_push_prefill_and_pull_decode_refuse_to_pair(cluster, pull_pair, client):
    params = _decode_leg_params(client, cluster, "prefill", "xfer-mode-mismatch")
    decode = cluster.servers["pull_decode"]
    response = client.complete(decode.url, prompt(30), kv_transfer_params=params)
    assert response.status_code >= 500
    assert "transfer mode mismatch: the prefill instance is in push mode" in decode.log_tail(400)


def test_a_router_refuses_a_push_prefill_with_a_pull_decode_before_either_works(
    cluster, pull_pair, client
):
    """Both identities known (the router is given each identity port): the pair is
    refused with both sides' modes, and neither instance is sent the request."""
    decode = cluster.servers["pull_decode"].url
    before = client.metric(decode, "vllm:request_success_total")
    url = cluster.start_router(["prefill"], ["pull_decode"], mode="push", name="mismatched")
    try:
        response = client.complete(url, prompt(30, 77))
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["type"] == "pairing_error"
        assert "transfer modes differ: prefill push, decode pull" in error["message"]
    finally:
        cluster.stop_router("mismatched")
    assert client.metric(decode, "vllm:request_success_total") == before
