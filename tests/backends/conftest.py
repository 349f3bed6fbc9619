"""Fixtures for the backend tests: fake devices installed and removed, two-process peers."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INTEGRATION = Path(__file__).parents[1] / "integration"


def _remote_peer_class() -> Any:
    # The two-process harness lives in tests/integration/conftest.py; load it under its
    # own name, since every conftest module is called "conftest".
    spec = importlib.util.spec_from_file_location(
        "kvpush_integration_harness", INTEGRATION / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemotePeer


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """start(role, engine_id, **init) -> a NodePeer in its own process, started in parallel
    with the others given to the same call: start(("both", "a", {...}), ("both", "b", {...}))."""
    remote_peer = _remote_peer_class()
    peers = []

    def start(*specs: tuple[str, str, dict]) -> list[Any]:
        started = []
        for role, engine_id, init in specs:
            peer = remote_peer()
            peers.append(peer)
            started.append(peer)
            init = {"lock_dir": str(tmp_path / "neuron-host"), **init}
            peer.send("init", kind="node", role=role, engine_id=engine_id, **init)
        for peer in started:
            peer.hello = peer.reply("init", timeout=180)
            peer.address = peer.hello["address"]
        return started

    yield start
    for peer in peers:
        peer.kill()


@pytest.fixture
def no_neuron_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process environment without Neuron settings; whatever a test sets is undone."""
    for name in ("NEURON_RT_MAP_HBM", "NEURON_RT_VISIBLE_CORES"):
        # setenv first: it records the value to restore. delenv of an unset variable
        # records nothing, and a value the backend set during the test would outlive it.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def fake_neuron(tmp_path: Path, no_neuron_env: None) -> Iterator[Any]:
    """factory(**FakeNeuron options) -> a fake Neuron installed as the backend's runtime."""
    from kvpush_neuron import runtime
    from kvpush_neuron.testing import FakeNeuron

    made = []

    def make(**options: Any) -> FakeNeuron:
        fake = FakeNeuron(lock_dir=options.pop("lock_dir", tmp_path / "cores"), **options)
        made.append(fake)
        runtime.set_runtime(fake)
        return fake

    previous = runtime.set_runtime(None)
    yield make
    for fake in made:
        fake.close()
    runtime.set_runtime(previous)


@pytest.fixture
def fake_cuda() -> Iterator[Any]:
    """factory(**FakeCuda options) -> a fake CUDA installed as the backend's runtime."""
    from kvpush_cuda import runtime
    from kvpush_cuda.testing import FakeCuda

    def make(**options: Any) -> FakeCuda:
        fake = FakeCuda(**options)
        runtime.set_runtime(fake)
        return fake

    previous = runtime.set_runtime(None)
    yield make
    runtime.set_runtime(previous)
