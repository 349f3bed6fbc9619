"""docs/compatibility.md cannot drift from the suite: every test it names exists, and
every refusal it quotes is the code's own text."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = (ROOT / "docs" / "compatibility.md").read_text()
SHAPES = PAGE.split("\n## ")[0]  # the table of deployment shapes; versions have their own
ROWS = [line for line in SHAPES.splitlines() if line.startswith("| ") and "---" not in line][1:]
CODE = "\n".join(p.read_text() for p in (ROOT / "core").rglob("*.py"))


def test_every_named_test_exists_with_its_parameter():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([\w-]+)\])?`", PAGE)
    assert len(named) >= 10
    for path, function, param in named:
        source = (ROOT / path).read_text()
        assert f"def {function}(" in source, (path, function)
        if param and param not in ("push", "pull"):
            assert f'"{param}"' in source, (path, function, param)


def test_every_refusal_quoted_is_the_codes_text():
    quoted = [m for row in ROWS for m in re.findall(r"refused: `([^`]+)`", row)]
    assert quoted
    for text in quoted:
        assert text in CODE, text


def test_every_row_says_how_it_was_checked_or_that_it_was_not():
    for row in ROWS:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4, row
        assert (
            cells[3] and (cells[3].startswith(("e2e", "NIXL", "layout")) or cells[3] in ("—",))
        ) or "not in the e2e suite" in cells[3], row


def test_the_version_table_lists_every_recorded_vllm_and_how_it_was_checked():
    versions = PAGE.split("## vLLM versions")[1].split("\n## ")[0]
    rows = [line for line in versions.splitlines() if line.startswith("| 0.")]
    recorded = sorted(p.stem for p in (ROOT / "tests" / "vllm_contracts").glob("*.json"))
    assert sorted(row.split("|")[1].strip() for row in rows) == recorded
    for row in rows:
        version, e2e, read, gpu = (c.strip() for c in row.strip("|").split("|"))
        sha = json.loads((ROOT / "tests" / "vllm_contracts" / f"{version}.json").read_text())
        assert read.startswith("yes") and sha["sha256"][:8] in read, row
        assert e2e and gpu, row
