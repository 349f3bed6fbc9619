"""A vLLM release's Python source, read without importing it: from a wheel (a zip)
or a directory above `vllm/`, parsed with `ast` (kvpush.vllm.contract reads its
contract items through these)."""

from __future__ import annotations

import ast
import hashlib
import re
import zipfile
from pathlib import Path


class Source:
    """The `vllm` package's Python files, from a wheel or a directory above `vllm/`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._trees: dict[str, ast.Module | None] = {}
        if self.path.is_dir():
            self._zip = None
        else:
            self._zip = zipfile.ZipFile(self.path)

    def text(self, name: str) -> str | None:
        try:
            if self._zip is not None:
                return self._zip.read(name).decode()
            return (self.path / name).read_text()
        except (KeyError, FileNotFoundError):
            return None

    def tree(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            text = self.text(name)
            self._trees[name] = ast.parse(text) if text is not None else None
        return self._trees[name]

    def version(self) -> str:
        text = self.text("vllm/_version.py") or ""
        found = re.search(r"(?:__version__|version)\s*(?::\s*str)?\s*=\s*['\"]([^'\"]+)", text)
        return found.group(1) if found else "unknown"

    def sha256(self) -> str:
        if self._zip is None:
            return ""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


# -- reading shapes out of syntax trees -------------------------------------------------


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Parameter names, kinds and defaults, without annotations, and the decorators
    that change how vLLM calls it (classmethod, staticmethod, property)."""
    args = ast.parse(f"def f({ast.unparse(fn.args)}): pass").body[0].args  # a copy
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    kinds = [ast.unparse(d) for d in fn.decorator_list]
    kinds = [k for k in kinds if k in ("classmethod", "staticmethod", "property")]
    return "".join(f"@{k} " for k in kinds) + f"({ast.unparse(args)})"


def param_names(sig: str) -> list[str]:
    """The parameter names of a signature() string, with * and ** kept."""
    inner = sig[sig.index("(") + 1 : sig.rindex(")")]
    fn = ast.parse(f"def f({inner}): pass").body[0]
    args = fn.args
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    names += [f"*{args.vararg.arg}"] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    names += [f"**{args.kwarg.arg}"] if args.kwarg else []
    return names


def fields(tree: ast.Module | None, name: str) -> list[str] | None:
    """A class's annotated fields and the `self.x` it assigns, its bases' in the same
    module first; None if the module has no such class."""
    cls = find_class(tree, name)
    if cls is None:
        return None
    found: list[str] = []
    for base in cls.bases:
        inherited = fields(tree, ast.unparse(base)) if isinstance(base, ast.Name) else None
        found += inherited or []
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.append(node.target.id)
        elif isinstance(node, ast.Assign) and node in cls.body:  # enum members, constants
            found += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found += [node.attr] if ast.unparse(node.value) == "self" else []
    found += [m for m, fn in methods(cls).items() if "property" in signature(fn)]
    return sorted(set(found))


def top_names(tree: ast.Module | None) -> set[str]:
    """What a module defines or imports at its top level."""
    names: set[str] = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING and fallbacks
            names |= top_names(ast.Module(body=node.body, type_ignores=[]))
    return names


def mentions(node: ast.AST | None) -> set[str]:
    """Every name and attribute a piece of code uses."""
    found: set[str] = set()
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Attribute):
            found.add(sub.attr)
        elif isinstance(sub, ast.Name):
            found.add(sub.id)
    return found


def module_file(source: Source, module: str) -> str:
    path = module.replace(".", "/")
    return f"{path}.py" if source.text(f"{path}.py") is not None else f"{path}/__init__.py"


def importable(source: Source, module: str, names: list[str]) -> list[str] | None:
    """Which of `names` `from module import ...` finds: defined there, or a submodule."""
    defined = top_names(source.tree(module_file(source, module)))
    base = module.replace(".", "/")
    found = [
        n
        for n in names
        if n in defined or source.text(f"{base}/{n}.py") or source.text(f"{base}/{n}/__init__.py")
    ]
    return sorted(found) or None
