"""kvpush's contract with a vLLM version, read from that version's source.

The source comes from a wheel (`pip download vllm==X --no-deps`) or a directory
holding the `vllm` package, and is parsed with `ast`: nothing of it is imported or
installed, so any version can be checked on any machine. Each contract item reads
a *shape* (a signature, the fields of a class, a few facts) and holds it against
what kvpush needs, giving `ok`, `changed` (what kvpush needs, and what is there)
or `missing`. A record (`record()`) keeps only the shapes and the wheel's sha256;
`check()` holds a record against kvpush as it is now, so CI checks each recorded
version with no download.

Items: every method of KVConnectorBase_V1 and SupportsHMA that KVPushConnector
implements or calls; every name kvpush imports from vLLM; every target of every
hook (kvpush.vllm.hooks); the scheduler's handling of WAITING_FOR_REMOTE_KVS and
kv_transfer_params and the step output kvpush reads; the KV cache spec classes
and fields kvpush.vllm.groups reads; the names kvpush registers under; and how
vLLM's own NIXL connector answers `kv_cache_access`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.vllm import hook_spec, hooks
from kvpush.vllm.source import (
    Source,
    fields,
    find_class,
    importable,
    mentions,
    methods,
    param_names,
    signature,
    top_names,
)

HERE = Path(__file__).parent
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SCHED = "vllm/v1/core/sched/scheduler.py"
OUTPUT = "vllm/v1/core/sched/output.py"
SPECS = "vllm/v1/kv_cache_interface.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py"

# Methods kvpush defines for the vLLMs that call them; an older base class lacks them.
NEWER_METHODS = {
    "supports_sleep_mode": "0.33",
    "unregister_kv_caches": "0.33",
    "restore_kv_caches": "0.33",
    "kv_cache_access": "0.34",
}


# -- kvpush's own side, read the same way --------------------------------------------------


def kvpush_connector() -> ast.ClassDef:
    cls = find_class(ast.parse((HERE / "connector.py").read_text()), "KVPushConnector")
    assert cls is not None
    return cls


def used_base_methods() -> dict[str, str]:
    """The base-class methods KVPushConnector implements or calls (super().x), each
    with kvpush's own signature ("" where it only calls it)."""
    cls = kvpush_connector()
    used = {name: signature(fn) for name, fn in methods(cls).items() if name[1:2] != "_"}
    used["__init__"] = signature(methods(cls)["__init__"])
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "super()":
            used.setdefault(node.attr, "")
    return {k: v for k, v in used.items() if not k.startswith("_") or k == "__init__"}


def vllm_imports() -> dict[str, list[str]]:
    """Every `from vllm.x import a, b` in kvpush's package: module file -> names."""
    wanted: dict[str, set[str]] = {}
    for path in sorted(HERE.parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                names = {a.name for a in node.names}
                wanted.setdefault(node.module or "", set()).update(names)
    return {module: sorted(names) for module, names in sorted(wanted.items())}


# Imports kvpush makes only where that vLLM has them (inside the code that needs them).
LAZY_IMPORTS = {"vllm.config.kv_transfer": "only vLLM 0.34 asks kv_cache_access"}


# -- the items ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    name: str
    read: Callable[[Source], Any]  # the shape, or None where it is missing
    need: Callable[[Any], Any]  # what kvpush needs of that shape: None if satisfied
    optional: str = ""  # why its absence is fine


def _base_method(name: str) -> Callable[[Source], Any]:
    def read(source: Source) -> Any:
        tree = source.tree(BASE)
        for cls_name in ("KVConnectorBase_V1", "SupportsHMA"):
            cls = find_class(tree, cls_name)
            fn = methods(cls).get(name) if cls is not None else None
            if fn is not None:
                return f"{cls_name}.{name}{signature(fn)}"
        return None

    return read


def _same_params(ours: str) -> Callable[[Any], Any]:
    def need(shape: str) -> Any:
        if ours and param_names(ours) != param_names(shape):
            return ours  # what kvpush implements: vLLM now calls it otherwise
        return None

    return need


def _facts(wanted: dict[str, Callable[[Source], bool]]) -> Callable[[Source], Any]:
    def read(source: Source) -> Any:
        shape = {fact: bool(test(source)) for fact, test in wanted.items()}
        return shape if any(shape.values()) else None  # every target gone: missing

    return read


def _all_true(shape: dict[str, bool]) -> Any:
    lacking = {fact: True for fact, ok in shape.items() if not ok}
    return lacking or None


def _has(path: str, cls: str | None, *names: str) -> Callable[[Source], bool]:
    """Whether module `path` (or its class `cls`) defines, assigns or uses each name."""

    def test(source: Source) -> bool:
        tree = source.tree(path)
        if tree is None:
            return False
        if cls is None:
            return all(n in top_names(tree) for n in names)
        node = find_class(tree, cls)
        return node is not None and all(n in mentions(node) | set(methods(node)) for n in names)

    return test


def _needs_fields(*wanted: str) -> Callable[[Any], Any]:
    def need(shape: list[str]) -> Any:
        lacking = [f for f in wanted if f not in shape]
        return list(wanted) if lacking else None

    return need


def _class_fields(path: str, name: str) -> Callable[[Source], Any]:
    return lambda source: fields(source.tree(path), name)


def _target_found(target: hook_spec.Target) -> Callable[[Source], bool]:
    """Whether a hook's target (kvpush.vllm.hook_spec.Target) is in a vLLM's source."""
    if target.kind == "fields":
        return lambda s: set(target.names) <= set(fields(s.tree(target.path), target.owner) or ())
    if target.kind == "near":
        call, beside = target.names
        return lambda s: _written_before_call(s.text(target.path) or "", call, beside)
    if target.kind == "order":
        return lambda s: _made_in_order(s, target)
    return _has(target.path, target.owner, *target.names)


def _written_before_call(text: str, call: str, beside: str) -> bool:
    at = text.find(call + "(")
    return at >= 0 and beside in text[max(0, at - 1500) : at]


def _made_in_order(source: Source, target: hook_spec.Target) -> bool:
    method, first, second = target.names
    cls = find_class(source.tree(target.path), target.owner or "")
    fn = methods(cls).get(method) if cls is not None else None
    text = ast.unparse(fn) if fn is not None else ""
    made, then = text.find(first), text.find(second)
    return 0 <= made < then


def _hook_facts(hook: hook_spec.Hook) -> dict[str, Callable[[Source], bool]]:
    return {label: _target_found(target) for label, target in hook.targets.items()}


def _scheduler_uses(name: str) -> Callable[[Source], Any]:
    """The Scheduler methods whose code uses `name`."""

    def read(source: Source) -> Any:
        cls = find_class(source.tree(SCHED), "Scheduler")
        if cls is None:
            return None
        return sorted(m for m, fn in methods(cls).items() if name in mentions(fn)) or None

    return read


def _returns(path: str, cls: str, method: str) -> Callable[[Source], Any]:
    def read(source: Source) -> Any:
        node = find_class(source.tree(path), cls)
        fn = methods(node).get(method) if node is not None else None
        if fn is None:
            return None
        returns = [r for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value]
        return [ast.unparse(r.value) for r in sorted(returns, key=lambda r: r.lineno)]

    return read


def _kvpush_answers_as_nixl(shape: list[str]) -> Any:
    """kvpush's kv_cache_access must carry every flag NIXL's device answer carries
    (the last return: the first is its host-staging answer, which kvpush never uses)."""
    fn = methods(kvpush_connector()).get("kv_cache_access")
    returned = ast.walk(fn) if fn is not None else ()
    mine = [ast.unparse(r.value) for r in returned if isinstance(r, ast.Return) and r.value]
    flags = set(re.findall(r"KVCacheAccess\.(\w+)", shape[-1]))
    have = set(re.findall(r"KVCacheAccess\.(\w+)", " ".join(mine or ())))
    return None if flags <= have else {"kvpush answers": mine, "NIXL on devices": shape[-1]}


def items() -> list[Item]:
    found = [
        Item(f"base.{name}", _base_method(name), _same_params(ours), _newer(name))
        for name, ours in sorted(used_base_methods().items())
    ]
    for module, names in vllm_imports().items():
        found.append(
            Item(
                f"import {module}",
                lambda s, m=module, n=names: importable(s, m, n),
                _needs_fields(*names),
                LAZY_IMPORTS.get(module, ""),
            )
        )
    for name, hook in hooks.HOOKS.items():
        found.append(
            Item(f"hook {name}", _facts(_hook_facts(hook)), _all_true, _hook_optional(name))
        )
    for name, path, wanted in CLASS_FIELDS:
        wanted = tuple(sorted({*wanted, *kvpush_reads(STEP_VARIABLES.get(name, ()))}))
        found.append(Item(name, _class_fields(path, name), _needs_fields(*wanted)))
    for uses, wanted in SCHEDULER_USES:
        found.append(Item(f"Scheduler uses {uses}", _scheduler_uses(uses), _needs_fields(*wanted)))
    found += [
        Item("RequestStatus.WAITING_FOR_REMOTE_KVS", _waiting_status, _needs_fields(WAITING)),
        Item(
            "Request: reads no external KV",
            _class_fields("vllm/v1/request.py", "Request"),
            _either("skip_reading_external_kv", "skip_reading_prefix_cache"),
        ),
        Item(
            "vllm.general_plugins entry point group",
            lambda s: "vllm.general_plugins" in (s.text("vllm/plugins/__init__.py") or "") or None,
            lambda shape: None,
        ),
        Item(
            "KVConnectorFactory.register_connector",
            lambda s: _method_sig(s, FACTORY, "KVConnectorFactory", "register_connector"),
            _same_params("(cls, name, module_path, class_name)"),
        ),
        Item("KVPushConnector is not a built-in name", _name_free, lambda free: None),
        Item(
            "NIXL's kv_cache_access",
            _returns(NIXL, "NixlBaseConnector", "kv_cache_access"),
            _kvpush_answers_as_nixl,
            "vLLM before 0.34 does not ask",
        ),
    ]
    return found


WAITING = "WAITING_FOR_REMOTE_KVS"
# The classes kvpush reads (kvpush.vllm.scheduler, groups, connector) and the
# fields it needs of each. CachedRequestData's resumed_req_ids is read where it
# exists: vLLM 0.34 re-sends a resumed request among the new ones instead.
CLASS_FIELDS = (
    ("SchedulerOutput", OUTPUT, ("scheduled_new_reqs", "scheduled_cached_reqs",
                                 "num_scheduled_tokens", "total_num_scheduled_tokens",
                                 "finished_req_ids")),
    ("NewRequestData", OUTPUT, ("req_id", "block_ids", "num_computed_tokens")),
    ("CachedRequestData", OUTPUT, ("req_ids", "new_block_ids", "num_computed_tokens")),
    ("KVCacheConfig", SPECS, ("kv_cache_groups", "num_blocks")),
    ("KVCacheGroupSpec", SPECS, ("kv_cache_spec", "layer_names")),
    ("FullAttentionSpec", SPECS, ("block_size",)),
    ("SlidingWindowSpec", SPECS, ("block_size", "sliding_window", "extra_retained_tokens")),
    ("MambaSpec", SPECS, ("block_size", "num_speculative_blocks")),
    ("UniformTypeKVCacheSpecs", SPECS, ("kv_cache_specs",)),
)  # fmt: skip
# The names kvpush.vllm.scheduler gives vLLM's step objects: every attribute it reads
# of them plainly (not through getattr, which copes with its absence) is needed too.
STEP_VARIABLES = {
    "SchedulerOutput": ("out", "scheduler_output"),
    "NewRequestData": ("new",),
    "CachedRequestData": ("cached",),
}


def kvpush_reads(variables: tuple[str, ...]) -> set[str]:
    """The attributes kvpush's scheduler reads plainly of variables so named."""
    tree = ast.parse((HERE / "scheduler.py").read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in variables
    }


# Where vLLM's Scheduler handles what kvpush relies on: a request waiting for remote
# KV, and the kv_transfer_params a finished request hands back.
SCHEDULER_USES = (
    (WAITING, ("schedule", "_update_from_kv_xfer_finished")),
    ("kv_transfer_params", ("add_request", "update_from_output")),
)


def _waiting_status(source: Source) -> Any:
    status = fields(source.tree("vllm/v1/request.py"), "RequestStatus") or ()
    return [WAITING] if WAITING in status else None


def _name_free(source: Source) -> Any:
    text = source.text(FACTORY)
    if text is None:
        return None
    return {"KVPushConnector built in": "KVPushConnector" in text}


def _newer(method: str) -> str:
    since = NEWER_METHODS.get(method)
    return f"vLLM {since} and later call it; kvpush defines it for them" if since else ""


def _hook_optional(name: str) -> str:
    return "only vLLM 0.34 has it" if name == "engine_spin" else ""


def _either(*names: str) -> Callable[[Any], Any]:
    return lambda shape: None if any(n in shape for n in names) else {"one of": list(names)}


def _method_sig(source: Source, path: str, cls: str, method: str) -> str | None:
    node = find_class(source.tree(path), cls)
    fn = methods(node).get(method) if node is not None else None
    return f"{cls}.{method}{signature(fn)}" if fn is not None else None


# -- records and checks ------------------------------------------------------------------


def record(path: str | Path) -> dict[str, Any]:
    """The shapes every item reads from one vLLM's source, and where they came from."""
    source = Source(path)
    shapes = {item.name: item.read(source) for item in items()}
    return {
        "vllm": source.version(),
        "wheel": source.path.name,
        "sha256": source.sha256(),
        "shapes": shapes,
    }


def check(recorded: dict[str, Any]) -> list[dict[str, Any]]:
    """Each item's status against kvpush as it is now: ok, changed or missing."""
    rows = []
    shapes = recorded["shapes"]
    for item in items():
        shape = shapes.get(item.name)
        row: dict[str, Any] = {"item": item.name, "shape": shape}
        if shape is None:
            row["status"] = "missing"
            row["fine"] = bool(item.optional)
            row["why"] = item.optional
        else:
            wanted = item.need(shape)
            row["status"] = "ok" if wanted is None else "changed"
            row["fine"] = wanted is None
            if wanted is not None:
                row["old"], row["new"] = wanted, shape
        rows.append(row)
    return rows


def passes(rows: list[dict[str, Any]]) -> bool:
    return all(row["fine"] for row in rows)


RECORDS = Path(__file__).parents[2] / "tests" / "vllm_contracts"  # in a checkout


def write_record(wheel: str | Path, folder: str | Path = RECORDS) -> Path:
    """Record one wheel's contract surface as folder/<version>.json (re-recording a
    version overwrites it)."""
    recorded = record(wheel)
    path = Path(folder) / f"{recorded['vllm']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return path


def side_by_side(checked: dict[str, list[dict[str, Any]]]) -> str:
    """One line per item, one column per version: ok, changed or missing; then, for
    each item not ok, what kvpush needs and what that version has."""
    versions = list(checked)
    names = [row["item"] for row in next(iter(checked.values()))]
    width = max(len(n) for n in names) + 2
    lines = [f"{'item':<{width}}" + "".join(f"{v:<10}" for v in versions)]
    for i, name in enumerate(names):
        cells = [_cell(checked[v][i]) for v in versions]
        lines.append(f"{name:<{width}}" + "".join(f"{c:<10}" for c in cells))
    lines.append("")
    for version in versions:
        for row in checked[version]:
            if row["status"] == "changed":
                lines.append(f"{version} {row['item']}: changed, kvpush needs {row['old']}")
                lines.append(f"{'':<{len(version)}} has {row['new']}")
            elif row["status"] == "missing":
                lines.append(f"{version} {row['item']}: missing ({row['why'] or 'needed'})")
    verdicts = ", ".join(f"{v}: {'passes' if passes(checked[v]) else 'FAILS'}" for v in versions)
    lines.append(f"verdict: {verdicts}")
    return "\n".join(lines)


def _cell(row: dict[str, Any]) -> str:
    return row["status"] + ("" if row["fine"] or row["status"] == "ok" else "!")
