"""kvpush's Ray Serve LLM connector backend: how it shapes the two legs. (The whole
P/D application runs on a local Ray cluster in tests/e2e/test_ray_pd.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.llm", reason="Ray Serve LLM is not installed: pip install -e .[ray]")

from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

from kvpush.ray_serve import KVPushBackend

PEER = {"kvpush_bootstrap": "http://10.0.0.5:18998", "engine_id": "kvpush-p"}


def _backend(mode: str) -> KVPushBackend:
    transfer = {"kv_connector": "KVPushConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"mode": mode}}  # fmt: skip
    # data_parallel_rank pins the port offset without a Serve replica around it.
    config = SimpleNamespace(
        engine_kwargs={"kv_transfer_config": transfer, "data_parallel_rank": 0}
    )
    return KVPushBackend(config)


def _request(**extra) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=[5, 6, 7], max_tokens=20, **extra)


def test_push_binds_the_prefill_replica_and_sends_both_legs_at_once():
    push, pull = _backend("push"), _backend("pull")
    assert push.requires_peer_binding and push.concurrent_handoff
    assert not pull.requires_peer_binding and not pull.concurrent_handoff


def test_both_legs_name_one_transfer_and_decode_names_the_prefill_bootstrap_server():
    backend = _backend("push")
    request = _request(n=2, seed=3, temperature=0.8, min_tokens=4, logprobs=2)
    prefill = backend.prepare_prefill_request(request=request, peer=PEER)
    decode = backend.prepare_decode_request(request=request, peer=PEER, prefill_response=None)
    tid = prefill.kv_transfer_params["transfer_id"]
    assert prefill.kv_transfer_params["do_remote_decode"] is True
    assert decode.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
        "remote_engine_id": "kvpush-p", "remote_bootstrap_addr": "http://10.0.0.5:18998",
    }  # fmt: skip
    # The prefill leg is cut to its prompt, the decode leg is the client's request.
    assert (prefill.max_tokens, prefill.n, prefill.min_tokens) == (1, 1, 0)
    assert prefill.logprobs is None and prefill.seed is None
    assert prefill.prompt == [5, 6, 7] and not prefill.stream
    assert (decode.max_tokens, decode.n, decode.min_tokens) == (20, 2, 4)


def test_a_prefill_replica_that_published_no_bootstrap_address_is_named():
    backend = _backend("push")
    with pytest.raises(ValueError, match="no kvpush bootstrap address"):
        backend.prepare_decode_request(request=_request(), peer={}, prefill_response=None)


def test_pull_forwards_the_prefill_answers_echo():
    backend = _backend("pull")
    echo = {"do_remote_prefill": True, "transfer_id": "ray-x", "remote_addresses": ["h:1"]}
    decode = backend.prepare_decode_request(
        request=_request(), peer=None, prefill_response=SimpleNamespace(kv_transfer_params=echo)
    )
    assert decode.kv_transfer_params == echo


def test_share_secret_gives_both_deployments_one_new_secret_each_time():
    from kvpush.ray_serve import share_secret

    config = {"prefill_config": {"runtime_env": {"env_vars": {"A": "1"}}}, "decode_config": {}}
    secret = share_secret(config)
    assert config["prefill_config"]["runtime_env"]["env_vars"] == {
        "A": "1",
        "KVPUSH_SECRET": secret,
    }
    assert config["decode_config"]["runtime_env"]["env_vars"] == {"KVPUSH_SECRET": secret}
    assert share_secret(config) != secret and len(secret) >= 32
