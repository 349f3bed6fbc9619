"""The kvpush command line, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _kvpush(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kvpush") or ""
    command = [exe] if exe else [sys.executable, "-m", "kvpush"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


def test_backends_json_lists_every_builtin_with_source_and_presence():
    result = _kvpush("backends", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert {"host", "cuda", "neuron"} <= rows.keys()
    assert rows["host"]["present"] is True
    assert rows["host"]["mem_types"] == ["DRAM"]
    for name in ("host", "cuda", "neuron"):
        assert rows[name]["source"] == "built-in"
        assert isinstance(rows[name]["present"], bool)
        assert rows[name]["detail"]


def test_backends_text_output_reads_as_a_table():
    result = _kvpush("backends")
    assert result.returncode == 0
    assert result.stdout.splitlines()[0].split()[0] in {"cuda", "host", "neuron"}


def test_unknown_backend_in_env_is_a_clear_cli_error(monkeypatch):
    monkeypatch.setenv("KVPUSH_BACKENDS", "host,nope")
    result = _kvpush("backends")
    assert result.returncode == 2
    assert "unknown backend(s) ['nope']" in result.stderr


def test_folders_are_not_importable_under_their_own_names():
    for name in ("core", "backends"):
        result = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True
        )
        assert result.returncode != 0
        assert "ImportError" in result.stderr, result.stderr


def test_secret_prints_a_new_secret_each_time(capsys):
    from kvpush import cli

    printed = []
    for _ in range(2):
        assert cli.main(["secret"]) == 0
        printed.append(capsys.readouterr().out.strip())
    assert printed[0] != printed[1] and all(len(p) >= 32 for p in printed)


def test_doctor_lists_every_vllm_hook_with_its_versions_and_cost():
    result = _kvpush("doctor", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["hook"]: row for row in json.loads(result.stdout)}
    assert {"engine_inbox", "idle_wait", "park_workers"} <= rows.keys()
    for row in rows.values():
        assert row["verified"] and row["cost_when_off"] and row["vllm"] != "unknown"


def test_router_loop_reaches_the_server_and_an_unknown_one_is_refused(monkeypatch):
    import kvpush.router.app as app
    from kvpush.cli import main

    seen = []
    monkeypatch.setattr(app, "run", lambda config, host, port, loop: seen.append(loop))
    spec = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert main(spec) == 0 and main([*spec, "--loop", "asyncio"]) == 0
    assert seen == ["auto", "asyncio"]
    result = _kvpush(*spec, "--loop", "trio")
    assert result.returncode == 2 and "invalid choice: 'trio'" in result.stderr
