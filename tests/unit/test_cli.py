"""The kvpush command line, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_doctor_shows_a_hook_the_user_turned_off_as_off_and_no_cost_where_none_applies(
    capsys, monkeypatch
):
    """An engine started from this shell would leave idle_wait off: doctor says so,
    with its cost; engine_spin has nothing to reach in vLLM 0.32, so nothing to miss."""
    from kvpush.cli import main
    from kvpush.vllm.hooks import HOOKS

    monkeypatch.setenv("KVPUSH_VLLM_HOOKS_OFF", "idle_wait")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("idle_wait ")]
    assert lines[at].endswith(": off (KVPUSH_VLLM_HOOKS_OFF)"), lines[at]
    assert lines[at + 1].split() == ["costs:", *HOOKS["idle_wait"].cost.split()]
    [at] = [i for i, line in enumerate(lines) if line.startswith("engine_spin ")]
    assert ": n/a" in lines[at]
    assert at + 1 == len(lines) or not lines[at + 1].lstrip().startswith("costs:"), lines
    assert all(": ok" in line for line in lines if line.startswith("engine_inbox "))


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


# -- usage errors: one line, exit 2, naming the input --------------------------------

ROUTER = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
BAD_INVOCATIONS = [
    (["bench", "transfer", "--sizes", "1MB"], "'1MB' is not a number"),
    (["bench", "transfer", "--runs", "0"], "--runs: '0' must be at least 1"),
    (["bench", "transfer", "--sizes", ","], "',' is an empty list"),
    (["bench", "protocol", "--in-flight", "1,abc"], "'abc' is not an integer"),
    (["bench", "protocol", "--repeat", "-2"], "--repeat: '-2'"),
    (["bench", "protocol", "--decode-step-ms", "nan"], "'nan' is not a finite number"),
    (["bench", "serve", "--lengths", "abc"], "--lengths: 'abc' is not an integer"),
    (["bench", "serve", "--lengths", "1024,-5"], "'-5' must be at least 1"),
    (["bench", "serve", "--rates", "0"], "--rates: '0' must be more than 0"),
    (["bench", "serve", "--requests", "-1"], "--requests: '-1'"),
    (["bench", "serve", "--kv-extra", "{bad"], "--kv-extra: '{bad' is not JSON"),
    (["bench", "serve", "--kv-extra", "[1]"], "'[1]' is not a JSON object"),
    (["bench", "serve", "--kv-extra", '{"stagng": 1}'], "['stagng']"),
    (["bench", "serve", "--kv-extra", '{"backends": ["UCX"]}'], "'nixl_backends'"),
    (["bench", "serve", "--kv-extra", '{"device_options": {"stagng": 1}}'], "'staging'"),
    (["bench", "serve", "--kv-extra", '{"host": "0.0.0.0"}'], "'0.0.0.0'"),
    (["bench", "serve", "--prefill-cpus", "abc"], "'abc' is not a CPU list"),
    (["bench", "serve", "--decode-cpus", "99999"], "'99999': this machine has CPUs"),
    (["bench", "serve", "--model", "/no/such/model"], "'/no/such/model' is not a directory"),
    (["bench", "serve", "--slo-ttft-ms", "-1"], "--slo-ttft-ms: '-1'"),
    (["bench", "handoff", "--step-tokens", "0"], "--step-tokens: '0'"),
    (["bench", "inflight", "--in-flight", "2,0"], "--in-flight: '0' must be at least 1"),
    (["bench", "inflight", "--cpus", "x"], "'x' is not a CPU list"),
    (["bench", "soak", "--requests", "-3"], "--requests: '-3'"),
    (["bench", "soak", "--disconnect-share", "1.5"], "'1.5' must be in [0, 1]"),
    (["bench", "soak", "--kv-extra", '{"leese_s": 3}'], "did you mean 'lease_s'?"),
    ([*ROUTER, "--port", "99999"], "--port: '99999' must be in [1, 65535]"),
    ([*ROUTER, "--port", "http"], "--port: 'http' is not an integer"),
    ([*ROUTER, "--timeout", "0"], "--timeout: '0' must be more than 0"),
    ([*ROUTER, "--health-interval", "-1"], "--health-interval: '-1'"),
    (["demo", "--max-tokens", "0"], "--max-tokens: '0'"),
    (["doctor", "--vllm-wheel", "/no/such.whl"], "'/no/such.whl' is not a file"),
    (["nosuchcommand"], "'nosuchcommand'"),
]


@pytest.mark.parametrize(
    "argv, named", BAD_INVOCATIONS, ids=[" ".join(argv)[:60] for argv, _ in BAD_INVOCATIONS]
)
def test_a_bad_value_is_a_one_line_usage_error_naming_it(argv, named, capsys, monkeypatch):
    import kvpush.demo.main as demo
    import kvpush.router.app as app
    from kvpush.bench import handoff, inflight, protocol, serve_report, soak, transfer
    from kvpush.cli import main

    def started(*args, **kwargs):
        raise AssertionError(f"{argv} was accepted and started running")

    # A value let through must fail here, not start servers or a router that never ends.
    for module, name in ((app, "run"), (demo, "main")):
        monkeypatch.setattr(module, name, started)
    for module in (handoff, inflight, protocol, serve_report, soak, transfer):
        monkeypatch.setattr(module, "main", started)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvpush") and "error:" in err[0] and named in err[0], err[0]


def test_a_record_that_is_not_json_is_an_error_not_a_traceback(tmp_path, capsys):
    from kvpush.cli import main

    (tmp_path / "bad.json").write_text("not json")
    assert main(["doctor", "--vllm-record", str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not a contract record" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`kvpush backends | head -1`: the pipe is closed before kvpush writes."""
    import os

    read, write = os.pipe()
    os.close(read)
    exe = shutil.which("kvpush") or ""
    command = [exe] if exe else [sys.executable, "-m", "kvpush"]
    try:
        result = subprocess.run(
            [*command, "backends"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


def test_version_names_the_installed_release():
    from importlib import metadata

    result = _kvpush("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvpush {metadata.version('kvpush')}"


def _parsers(parser, prefix="kvpush"):
    import argparse

    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{prefix} {name}")


def test_every_command_has_a_description_and_shows_its_defaults():
    from kvpush.cli import build_parser

    for name, parser in _parsers(build_parser()):
        assert parser.description and "\n" not in parser.description.strip(), name
        text = parser.format_help()
        for action in parser._actions:
            if action.nargs == 0 or action.default in (None, [], "==SUPPRESS=="):
                continue
            shown = str(action.default)
            assert f"default: {shown}" in " ".join(text.split()), (name, action.dest)


def test_help_lists_the_exit_codes():
    result = _kvpush("--help")
    assert result.returncode == 0
    for code in ("0 ", "1 ", "2 ", "130", "141", "143"):
        assert f"\n  {code}" in result.stdout, code


def test_the_inflight_bench_refuses_settings_it_cannot_measure_with():
    from kvpush.bench.inflight import Settings
    from kvpush.errors import KVPushError

    for bad in ({"in_flight": ()}, {"lengths": ()}, {"reps": 0}, {"slope": (2048, 512)}):
        with pytest.raises(KVPushError):
            Settings(**bad)
