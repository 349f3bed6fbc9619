"""A CPU worker asks Linux for the AMX tile state before vLLM's attention needs it.

Whether this machine has AMX is the hardware's business: torch's two calls are stood
in for, answering as a CPU with and without AMX would."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from kvpush.vllm.worker import ask_for_amx_tiles  # noqa: E402


@pytest.fixture
def cpu(monkeypatch):
    asked: list[bool] = []
    state = {"has_amx": True, "granted": True}
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: state["has_amx"])

    def init_amx() -> bool:
        asked.append(True)
        return state["granted"]

    monkeypatch.setattr(torch.cpu, "_init_amx", init_amx)
    return state, asked


def test_a_cpu_with_amx_is_asked_for_its_tiles(cpu, caplog):
    _, asked = cpu
    with caplog.at_level(logging.WARNING):
        ask_for_amx_tiles()
    assert asked == [True] and not caplog.records


def test_a_refusal_is_said_with_what_to_do(cpu, caplog):
    state, _ = cpu
    state["granted"] = False
    with caplog.at_level(logging.WARNING):
        ask_for_amx_tiles()
    assert "refused this process its tile state" in caplog.text
    assert "--dtype float32" in caplog.text


def test_a_cpu_without_amx_asks_nothing(cpu):
    state, asked = cpu
    state["has_amx"] = False
    ask_for_amx_tiles()
    assert asked == []
