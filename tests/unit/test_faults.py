"""The data-path fault injector: what it draws, and how each wrapped call fails."""

from __future__ import annotations

import pytest

from kvpush.errors import BackendError, ConfigError, TransportError
from kvpush.node.faults import Faults, FaultyAgent, FaultyBackends
from kvpush.transport.agent import Transfer


class _Agent:
    """Records what reached the real agent."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def post(self, op, *args, **kwargs) -> Transfer:
        self.calls.append("post")
        return Transfer(object(), op, "peer", 8, finished=True)

    def done(self, transfer: Transfer) -> bool:
        self.calls.append("done")
        return True

    def release(self, transfer: Transfer) -> None:
        self.calls.append("release")

    def _release_quietly(self, transfer: Transfer) -> None:
        self.calls.append("release_quietly")

    def metadata(self) -> bytes:
        return b"passed through"


def test_unknown_ops_modes_and_rates_are_refused_by_name():
    with pytest.raises(ConfigError, match="'flush'"):
        Faults(ops=("post", "flush"))
    with pytest.raises(ConfigError, match="'explode'"):
        Faults(modes=("explode",))
    with pytest.raises(ConfigError, match="rate"):
        Faults(rate=1.5)


def test_a_seed_replays_the_same_faults():
    runs = [Faults(seed=7, rate=0.3), Faults(seed=7, rate=0.3)]
    draws = [[faults.draw("post") for _ in range(50)] for faults in runs]
    assert draws[0] == draws[1] and set(draws[0]) == {None, "raise", "hang"}
    assert sum(runs[0].injected.values()) == sum(d is not None for d in draws[0])
    assert Faults(rate=0.0).draw("post") is None
    assert Faults(rate=1.0, ops=("stage",)).draw("post") is None  # not an op it fails


def test_a_hung_post_never_completes_until_released():
    agent = _Agent()
    faulty = FaultyAgent(agent, Faults(rate=1.0, ops=("post",), modes=("hang",)))
    transfer = faulty.post("WRITE")
    assert transfer.finished is False  # the bytes may have moved; NIXL never says so
    assert [faulty.done(transfer) for _ in range(3)] == [False] * 3
    faulty.release(transfer)
    assert agent.calls == ["post", "release"]
    assert faulty.metadata() == b"passed through"


def test_a_failed_check_raises_as_nixl_does_and_frees_the_handle():
    agent = _Agent()
    faulty = FaultyAgent(agent, Faults(rate=1.0, ops=("check",), modes=("raise",)))
    with pytest.raises(TransportError, match="injected fault"):
        faulty.done(Transfer(object(), "READ", "peer", 8))
    assert agent.calls == ["release_quietly"]


def test_device_calls_fail_as_a_backend_does():
    class _Backends:
        def stage(self, kv, block_ids, direction):
            raise AssertionError("a failed staging call must not reach the device")

    faulty = FaultyBackends(_Backends(), Faults(rate=1.0, ops=("stage",), modes=("raise",)))
    with pytest.raises(BackendError, match="staging to_device"):
        faulty.stage(None, [1], "to_device")
