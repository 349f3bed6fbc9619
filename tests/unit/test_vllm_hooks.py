"""kvpush's reaches into vLLM: declared, version-gated, and loud when off."""

from __future__ import annotations

import logging

import pytest

from kvpush.errors import ConfigError
from kvpush.vllm import hooks


@pytest.fixture
def record(monkeypatch):
    fresh = hooks.Record()
    monkeypatch.setattr(hooks, "RECORD", fresh)
    return fresh


def test_every_hook_declares_versions_a_target_and_a_cost():
    assert set(hooks.HOOKS) == {
        "connector_registry", "caller_kv_role", "engine_inbox", "idle_wait", "step_notify",
        "park_workers", "reader_spin", "window_margin", "landings_before_schedule",
        "prompt_cut",
    }  # fmt: skip
    for hook in hooks.HOOKS.values():
        assert hook.verified and hook.reaches and hook.cost, hook


def test_on_an_unverified_vllm_the_risky_hooks_stay_off_and_say_what_it_costs(
    record, monkeypatch, caplog
):
    monkeypatch.setattr(hooks, "vllm_version", lambda: "0.40.1")
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert hooks.idle_wait_allowed(0.1) == 0.0
        assert hooks.ring_on_engine_inbox(lambda: None) is False
        assert not hooks.Parking.find().available
        assert hooks.prepare_step_notify() is False
        assert hooks.bound_reader_spin(0.002, executor_side=False) is False
        assert hooks.ScheduleHook.attach(lambda: None) is None
        with pytest.raises(ConfigError, match="prompt_cut hook is off"):
            hooks.allow_prompt_cut()
    states = record.snapshot()
    for name in ("idle_wait", "engine_inbox", "step_notify", "park_workers", "reader_spin"):
        assert states[name] == "off: vLLM 0.40.1 is not among 0.32, 0.33", states
        assert hooks.HOOKS[name].cost in caplog.text
    assert states["landings_before_schedule"] == "off: vLLM 0.40.1 is not among 0.32", states
    assert hooks.HOOKS["landings_before_schedule"].cost in caplog.text
    assert states["prompt_cut"] == "off: vLLM 0.40.1 is not among 0.32", states
    record.missed("idle_wait", "again")  # one warning per hook, not one per call
    assert caplog.text.count("hook idle_wait is off") == 1


def test_on_the_installed_vllm_the_idle_wait_attaches_and_is_listed(record, caplog):
    with caplog.at_level(logging.INFO, logger="kvpush"):
        assert hooks.idle_wait_allowed(0.1) == 0.1
        record.log_attached("scheduler")
    assert record.snapshot() == {"idle_wait": "attached"}
    assert "scheduler hooks attached: ['idle_wait']" in caplog.text


def test_doctor_finds_every_target_in_the_installed_vllm():
    rows = {row["hook"]: row for row in hooks.probe()}
    assert set(rows) == set(hooks.HOOKS)
    assert all(row["would_attach"] for row in rows.values()), rows


def test_an_operator_turns_a_hook_off_by_name_and_a_misspelt_name_is_an_error(
    record, monkeypatch, caplog
):
    monkeypatch.setenv(hooks.OFF_ENV, " park_workers, idle_wait ")
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert hooks.idle_wait_allowed(0.1) == 0.0
        assert not hooks.Parking.find().available
    assert record.snapshot() == {
        "idle_wait": f"off: turned off by {hooks.OFF_ENV}",
        "park_workers": f"off: turned off by {hooks.OFF_ENV}",
    }
    assert hooks.HOOKS["park_workers"].cost in caplog.text
    for wrong in ("park_worker", "connector_registry"):  # a typo; a hook that only reads
        monkeypatch.setenv(hooks.OFF_ENV, wrong)
        with pytest.raises(ConfigError, match=rf"can be turned off: \['{wrong}'\]"):
            hooks.idle_wait_allowed(0.1)
