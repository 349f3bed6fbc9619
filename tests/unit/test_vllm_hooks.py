"""kvpush's reaches into vLLM: declared, version-gated, and loud when off."""

from __future__ import annotations

import logging

import pytest

from kvpush.errors import ConfigError
from kvpush.vllm import hook_spec, hooks


@pytest.fixture
def record(monkeypatch):
    fresh = hooks.Record()
    monkeypatch.setattr(hooks, "RECORD", fresh)
    return fresh


def test_every_hook_declares_versions_a_target_and_a_cost():
    assert set(hooks.HOOKS) == {
        "connector_registry", "caller_kv_role", "engine_inbox", "idle_wait", "step_notify",
        "park_workers", "reader_spin", "window_margin", "landings_before_schedule",
        "prompt_cut", "engine_spin",
    }  # fmt: skip
    for hook in hooks.HOOKS.values():
        assert hook.verified and hook.reaches and hook.cost, hook


def test_on_an_unverified_vllm_the_risky_hooks_stay_off_and_say_what_it_costs(
    record, monkeypatch, caplog
):
    monkeypatch.setattr(hook_spec, "vllm_version", lambda: "0.40.1")
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
        assert states[name] == "off: vLLM 0.40.1 is not among 0.32.0, 0.33.0, 0.34.0", states
        assert hooks.HOOKS[name].cost in caplog.text
    assert states["landings_before_schedule"] == "off: vLLM 0.40.1 is not among 0.32.0", states
    assert hooks.HOOKS["landings_before_schedule"].cost in caplog.text
    assert states["prompt_cut"] == "off: vLLM 0.40.1 is not among 0.32.0", states
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
    # vLLM 0.32 has no engine spin to bound; every other hook attaches, matching 0.32.0.
    assert [name for name, row in rows.items() if not row["applies"]] == ["engine_spin"]
    applying = [row for row in rows.values() if row["applies"]]
    assert all(row["would_attach"] for row in applying), rows
    assert {row["matched"] for row in applying} == {"0.32.0"}


@pytest.mark.parametrize(
    ("version", "matched"),
    [("0.32.0", "0.32.0"), ("0.32.0+cpu", "0.32.0"), ("0.34.0", "0.34.0"), ("0.3", None),
     ("0.330", None), ("0.33.0rc1", None), ("0.32.1", None), ("unknown", None)],
)  # fmt: skip
def test_the_version_gate_compares_parsed_releases(version, matched):
    assert hook_spec.matched(hooks.HOOKS["idle_wait"], version) == matched


def test_the_engine_spin_is_bounded_where_vllm_has_it_and_loud_where_unverified(
    record, monkeypatch, caplog
):
    from vllm.v1.engine import core

    monkeypatch.setattr(core, "_INPUT_SPIN_DURATION_S", 1.0, raising=False)
    monkeypatch.setattr(hook_spec, "vllm_version", lambda: "0.34.0")
    assert hooks.bound_engine_spin(0.002) is True
    assert core._INPUT_SPIN_DURATION_S == 0.002
    assert record.snapshot() == {"engine_spin": "attached"}
    monkeypatch.setattr(core, "_INPUT_SPIN_DURATION_S", 1.0)
    monkeypatch.setattr(hooks, "RECORD", hooks.Record())  # another process
    monkeypatch.setattr(hook_spec, "vllm_version", lambda: "0.35.0")
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert hooks.bound_engine_spin(0.002) is False
    assert core._INPUT_SPIN_DURATION_S == 1.0
    assert hooks.HOOKS["engine_spin"].cost in caplog.text


def test_on_a_vllm_without_the_engine_spin_that_hook_stays_quiet(record, caplog):
    from vllm.v1.engine import core

    assert not hasattr(core, "_INPUT_SPIN_DURATION_S")  # vLLM 0.32, as installed here
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert hooks.bound_engine_spin(0.002) is False
    assert record.snapshot() == {} and "engine_spin" not in caplog.text


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
