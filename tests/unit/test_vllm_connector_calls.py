"""KVPushConnector's answers to the calls newer vLLMs make of a connector: how its KV
cache may be allocated (0.34), releasing that cache (0.33 sleep, 0.34 weight
updates), and a decode leg whose match vLLM drops (prompt logprobs)."""

from __future__ import annotations

import enum
import logging
from types import SimpleNamespace

import pytest
from test_vllm_scheduler import _decode_params, _request, _side

from kvpush.vllm.connector import KVPushConnector
from kvpush.vllm.metadata import KVPushHandshake, KVPushWorkerMeta


class KVCacheAccess(enum.IntFlag):
    """vLLM 0.34's flags (vllm.config.kv_transfer), as its source has them; the
    contract check (tests/vllm_contracts/0.34.0.json) holds the real ones."""

    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()

    def needs_single_chunk(self) -> bool:
        exports = KVCacheAccess.EXPORTS_FD | KVCacheAccess.EXPORTS_FABRIC
        return bool(self & (KVCacheAccess.REGISTERS | exports))


@pytest.fixture
def access(monkeypatch):
    from vllm.config import kv_transfer

    monkeypatch.setattr(kv_transfer, "KVCacheAccess", KVCacheAccess, raising=False)
    return KVCacheAccess


@pytest.mark.parametrize("buffer_device", ["cuda", "cpu", "neuron"])
def test_a_gpu_kv_cache_is_never_spread_over_allocations_nixl_cannot_register(
    access, buffer_device
):
    """vLLM 0.34's growable cache may back one segment by several physical
    allocations unless the connector says it registers the cache; kvpush registers
    the device cache whatever kv_buffer_device says, so it must always say so, and
    carry what NIXL's own connector says on devices it registers."""
    config = SimpleNamespace(kv_buffer_device=buffer_device)
    answer = KVPushConnector.kv_cache_access(config)
    assert answer.needs_single_chunk()
    assert access.LEGACY_IPC not in answer  # that would turn the growable cache off
    nixl_on_devices = access.REGISTERS | access.EXPORTS_FABRIC
    assert answer & nixl_on_devices == nixl_on_devices


def test_releasing_the_kv_cache_is_the_workers_and_the_scheduler_learns_the_new_boot():
    """vLLM calls unregister_kv_caches and restore_kv_caches on its workers
    (tests/integration/test_worker_kv_release.py drives them): a worker's new boot
    reaches the scheduler in a step's worker metadata, and its identity says so."""
    side = _side()
    with pytest.raises(RuntimeError, match="worker-side"):
        _connector(side).unregister_kv_caches()
    before = side.identity()
    rebooted = KVPushHandshake(0, 1, before.addresses[0], "e-new", "agent-new")
    output = SimpleNamespace(
        finished_sending=set(), finished_recving=set(),
        kv_connector_worker_meta=KVPushWorkerMeta(handshakes={0: rebooted}),
    )  # fmt: skip
    side.update_connector_output(output)
    after = side.identity()
    assert before.epoch != after.epoch == "e-new"
    assert after.ranks[0].agent == "agent-new" and after.addresses == before.addresses


def _connector(side):
    made = object.__new__(KVPushConnector)
    made._scheduler, made._worker, made._shape = side, None, side.shape
    return made


@pytest.mark.parametrize("flag", ["skip_reading_external_kv", "skip_reading_prefix_cache"])
def test_a_decode_leg_whose_match_vllm_drops_frees_the_producers_kv_at_once(flag, caplog):
    """vLLM computes the prompt of a request asking for prompt logprobs itself (0.34
    says so as skip_reading_external_kv, 0.32 and 0.33 as skip_reading_prefix_cache):
    the producer is told at once, not when the request ends, and it is counted."""
    side = _side()
    request = _request("d1", 300, _decode_params())
    setattr(request, flag, True)
    made = _connector(side)
    made.on_new_request(request)
    (announce,) = side.ledger.take_plan().announces
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert made.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.ledger.take_plan().aborts == [announce.transfer_id]
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert not side.ledger.knows("d1")
    assert side.stats() == {"recomputed": {"prompt_logprobs": 1}}
    assert "prompt logprobs" in caplog.text
    # vLLM asks again while the request waits: nothing more is announced or claimed.
    assert made.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.ledger.take_plan().announces == []


def test_a_decode_leg_vllm_loads_is_matched_as_before():
    side = _side()
    request = _request("d1", 300, _decode_params())
    made = _connector(side)
    made.on_new_request(request)
    tokens, load_async = made.get_num_new_matched_tokens(request, 0)
    assert tokens and load_async is True
    assert side.ledger.knows("d1") and side.ledger.take_plan().aborts == []


def test_on_vllms_cpu_build_a_seed_the_client_did_not_send_is_not_taken(monkeypatch):
    """A CPU generator cannot rewind, so a CPU instance's identity says no router
    may mint a seed for it; an accelerator's counter-based generator can."""
    from vllm.platforms import current_platform

    from kvpush.vllm.compat import seeds_rewind

    assert current_platform.device_type == "cpu" and seeds_rewind() is False
    monkeypatch.setattr(type(current_platform), "device_type", "gpu", raising=False)
    assert seeds_rewind() is True
