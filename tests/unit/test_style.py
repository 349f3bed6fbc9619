"""The tree stays ruff-clean (lint and format), and the protocol package stays sans-I/O."""

from __future__ import annotations

import ast
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


# What the protocol and engine packages may not import: they are sans-I/O (events
# in, actions out), so the environment, clocks, randomness, logging and sockets
# belong to their callers; and the engine package is the engine's contract, not
# vLLM's, so vLLM belongs to kvpush.vllm.
IO_MODULES = {
    "os",
    "logging",
    "time",
    "socket",
    "threading",
    "random",
    "secrets",
    "select",
    "asyncio",
    "subprocess",
    "vllm",
    "torch",
}


@pytest.mark.parametrize("package", ["protocol", "engine"])
def test_the_sans_io_packages_do_no_io(package):
    offenders = []
    for path in sorted((ROOT / "core" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [
                f"{path.name}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in IO_MODULES
            ]
    assert not offenders, offenders


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (no packages here): two of one name
    stop the whole run at collection, which a one-directory run does not show."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path
