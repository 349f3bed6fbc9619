"""The tree stays ruff-clean (lint and format), so CI catches what review would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed: pip install -e .[test]")
    return [exe]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command):
    result = subprocess.run(_ruff() + command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
