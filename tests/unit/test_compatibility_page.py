"""docs/compatibility.md cannot drift from the suite: every test it names exists, and
every refusal it quotes is the code's own text."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = (ROOT / "docs" / "compatibility.md").read_text()
ROWS = [line for line in PAGE.splitlines() if line.startswith("| ") and "---" not in line][1:]
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
