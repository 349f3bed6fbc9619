"""Module size budgets that only go down.

`tests/size_budgets.txt` lists each module allowed past the default size with its line budget.
A module may not outgrow its budget; a budget that is loose (the module shrank well below it)
must be lowered; and a budget may only be raised, or a module newly listed, with a note on its
row saying why, which the table's git history is read to check.
"""

from __future__ import annotations

import subprocess
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TABLE = "tests/size_budgets.txt"
DEFAULT_LINES = 550
# The protocol's machines are read most; none of their modules may be long.
HARD_LIMITS = {"core/protocol/": 450}
# A budget this far above its module's size has been outgrown downwards: lower it.
SLACK_LINES = 25


def parse(text: str) -> dict[str, tuple[int, str]]:
    """Rows of `path budget [why: note]`; blank lines and `#` comments are skipped."""
    rows: dict[str, tuple[int, str]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        head, _, note = line.partition("why:")
        fields = head.split()
        if len(fields) != 2 or not fields[1].isdigit():
            raise ValueError(f"{TABLE}:{number}: expected `path lines [why: note]`, got {raw!r}")
        if fields[0] in rows:
            raise ValueError(f"{TABLE}:{number}: {fields[0]} is listed twice")
        rows[fields[0]] = (int(fields[1]), note.strip())
    return rows


def unexplained_raises(
    old: dict[str, tuple[int, str]], new: dict[str, tuple[int, str]]
) -> list[str]:
    """Rows of `new` whose budget went up from `old` (or from the default, for a new row)
    without a note that `old` did not already have."""
    found = []
    for path, (budget, note) in new.items():
        before, old_note = old.get(path, (DEFAULT_LINES, ""))
        if budget > before and (not note or note == old_note):
            found.append(f"{path}: {before} -> {budget} with no new `why:` note")
    return found


def lines_of(path: Path) -> int:
    return path.read_text().count("\n")


def modules() -> list[Path]:
    return sorted((ROOT / "core").rglob("*.py")) + sorted((ROOT / "backends").rglob("*.py"))


def table_history() -> list[str]:
    """The table's text at each commit that changed it, oldest first, then the working copy."""
    try:
        shas = subprocess.run(
            ["git", "log", "--format=%H", "--reverse", "--", TABLE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        versions = [
            subprocess.run(
                ["git", "show", f"{sha}:{TABLE}"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for sha in shas
        ]
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"the size-budget check reads {TABLE}'s git history and could not: {exc}")
    return versions + [(ROOT / TABLE).read_text()]


def test_every_module_is_within_its_budget():
    budgets = parse((ROOT / TABLE).read_text())
    over = []
    for path in modules():
        name = str(path.relative_to(ROOT))
        budget = budgets.get(name, (DEFAULT_LINES, ""))[0]
        for prefix, limit in HARD_LIMITS.items():
            if name.startswith(prefix):
                budget = min(budget, limit)
        if lines_of(path) > budget:
            over.append(f"{name}: {lines_of(path)} lines, budget {budget}")
    assert not over, over


def test_budgets_follow_their_modules_down():
    budgets = parse((ROOT / TABLE).read_text())
    stale = []
    for name, (budget, _) in budgets.items():
        path = ROOT / name
        if not path.exists():
            stale.append(f"{name}: listed, but there is no such module")
        elif budget - lines_of(path) > SLACK_LINES:
            stale.append(f"{name}: {lines_of(path)} lines, budget {budget}: lower it")
    assert not stale, stale


def test_a_budget_is_raised_only_with_a_note_saying_why():
    versions = [parse(text) for text in table_history()]
    raised = []
    for old, new in pairwise(versions):  # the first version is the baseline
        raised += unexplained_raises(old, new)
    assert not raised, raised


def test_the_raise_check_catches_a_silent_raise_and_a_silent_new_row():
    old = {"core/a.py": (600, "")}
    assert unexplained_raises(old, {"core/a.py": (610, "")})
    assert unexplained_raises(old, {"core/a.py": (600, ""), "core/b.py": (560, "")})
    assert not unexplained_raises(old, {"core/a.py": (590, "")})
    assert not unexplained_raises(old, {"core/a.py": (620, "the wire format grew a field")})
    with pytest.raises(ValueError, match="expected"):
        parse("core/a.py six hundred")
