"""How the device backends ship: lazy imports, what `kvpush backends` says, a device-free core."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvpush.errors import BackendError

ROOT = Path(__file__).parents[2]
DEVICE_WORDS = re.compile(r"cuda|neuron|trainium|inferentia|(?<![a-z])xla", re.IGNORECASE)
# Names the core must use because another project chose them.
# Other libraries' names that happen to contain a device word.
FOREIGN_NAMES = {
    "requires_piecewise_for_cudagraph",  # vLLM's KV connector API
    "set_xlabel",  # matplotlib's axes
}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_backends_import_probe_and_describe_themselves_without_torch():
    result = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "import kvpush_cuda.backend as c, kvpush_neuron.backend as n\n"
        "for b in (c, n):\n"
        "    print(b.kvpush_probe().present, b.kvpush_backend_info().missing)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["False ()", "False ()"]


def test_loading_every_backend_imports_no_torch():
    result = _python(
        "import sys\n"
        "from kvpush.backend.plugins import Backends\n"
        "Backends().probes()\n"
        "print(sorted(m for m in ('torch', 'torch_neuronx', 'torch_xla') if m in sys.modules))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_backends_json_shows_both_device_backends_complete():
    result = subprocess.run(
        [sys.executable, "-m", "kvpush", "backends", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    for name in ("cuda", "neuron"):
        assert rows[name]["mem_types"] == ["VRAM", "DRAM"]
        assert rows[name]["transfer_paths"] == ["direct", "staged"]
        assert rows[name]["not_implemented"] == []
    assert rows["neuron"]["device_types"] == ["neuron", "xla"]


def test_the_real_neuron_runtime_says_where_to_get_torch_neuronx():
    pytest.importorskip("torch")
    from kvpush_neuron.runtime import TorchNeuron

    runtime = TorchNeuron()
    assert runtime.started() is False and runtime.too_late() is None  # no /dev/neuron open
    if "torch_neuronx" in sys.modules:
        pytest.skip("torch-neuronx is installed here")
    with pytest.raises(BackendError, match=r"AWS Neuron package repository.*placeholders"):
        runtime.start()


def test_the_real_cuda_runtime_does_not_claim_host_tensors():
    torch = pytest.importorskip("torch")
    from kvpush_cuda.runtime import TorchCuda

    assert TorchCuda().device_index(torch.zeros(2)) is None


def test_no_requirement_pulls_neuron_placeholders_from_the_public_index():
    requirements = " ".join(metadata.requires("kvpush") or [])
    for name in ("torch-neuronx", "libneuronxla", "neuronx-cc", "aws-neuronx-runtime-discovery"):
        assert name not in requirements


def _mentions(tree: ast.AST) -> list[tuple[int, str]]:
    """Identifiers and string constants (docstrings and comments aside) naming a device."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [] if id(node) in docstrings else [node.value]
        found += [
            (getattr(node, "lineno", 0), n)
            for n in names
            if n not in FOREIGN_NAMES and DEVICE_WORDS.search(n)
        ]
    return found


def test_core_names_no_device_outside_the_hook_contract():
    offenders = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        if path.name == "hookspecs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        offenders += [
            f"{path.relative_to(ROOT)}:{line}: {name!r}" for line, name in _mentions(tree)
        ]
    assert not offenders, "device names in the core:\n" + "\n".join(offenders)


def test_the_device_name_check_sees_code_but_not_prose():
    code = '"""Works with CUDA."""\n# and Neuron\nif kind == "cuda":\n    import torch_xla\n'
    assert [name for _, name in _mentions(ast.parse(code))] == ["cuda", "torch_xla"]


def test_every_package_folder_ships_in_a_built_wheel():
    """An editable install finds subpackages by path; a wheel ships only those listed."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    assert found - listed == set(), f"package folders no wheel would ship: {sorted(found - listed)}"
