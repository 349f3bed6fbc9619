"""Where a page lists router flags, connector keys, hooks or metrics, the list is the
code's: each test reads the names from the code when it runs, so a flag, key, hook
or metric added, renamed or dropped without its page fails here."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvpush.cli import build_parser
from kvpush.errors import ConfigError
from kvpush.metrics import Metrics
from kvpush.protocol.config import ProtocolConfig
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.hooks import HOOKS

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / name).read_text()


def section(text: str, heading: str) -> str:
    """The part of a page under `heading` (a whole heading line), up to the next
    heading of the same or a higher level."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = len(lines)
    for i in range(start + 1, len(lines)):
        hashes = len(lines[i]) - len(lines[i].lstrip("#"))
        if 0 < hashes <= level and lines[i][hashes : hashes + 1] == " ":
            end = i
            break
    return "\n".join(lines[start + 1 : end])


def table(text: str) -> list[list[str]]:
    """The cells of each body row of the Markdown tables in `text`."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    body = [r for r in rows if not re.fullmatch(r"\|[-| :]+\|", r.strip())]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", r.strip()[1:-1])] for r in body]
    return [c for c in cells if c and not c[0].startswith(("key", "flag", "hook", "metric"))]


def first_code(cell: str) -> str:
    """The first `code` span of a cell."""
    match = re.search(r"`([^`]+)`", cell)
    assert match, cell
    return match.group(1)


# -- kvpush router's flags (configuration.md) vs its parser (kvpush.cli) -------------


def router_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["router"]


def router_rows() -> list[list[str]]:
    return table(section(page("configuration.md"), "## `kvpush router`"))


def test_configuration_lists_every_router_flag_and_no_other():
    flags = {
        option
        for action in router_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    listed = [first_code(row[0]).split()[0] for row in router_rows()]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == flags


def test_configuration_gives_each_router_flags_default():
    actions = {a.option_strings[-1]: a for a in router_parser()._actions if a.option_strings}
    for row in router_rows():
        action = actions[first_code(row[0]).split()[0]]
        if action.required:
            assert "required" in row[1], row
        elif isinstance(action.default, bool):
            continue  # a switch: its row says what it turns off
        else:
            default = action.default
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert f"`{shown}`" in row[1], (row, default)


# -- kv_connector_extra_config keys (configuration.md) vs ConnectorConfig ----------------


def connector_keys() -> dict[str, object]:
    """Each key kv_connector_extra_config takes, with its default, as
    ConnectorConfig.from_extra reads them: the dataclass's fields (less the protocol
    timers' holder and `listen`, which is no setting) and the protocol timers."""
    keys: dict[str, object] = {}
    for config, skip in ((ConnectorConfig, {"protocol", "listen"}), (ProtocolConfig, {"mode"})):
        for f in dataclasses.fields(config):
            if f.name in skip:
                continue
            if f.default is not dataclasses.MISSING:
                keys[f.name] = f.default
            else:
                keys[f.name] = f.default_factory()  # type: ignore[misc]
    return keys


def connector_rows() -> list[list[str]]:
    return table(section(page("configuration.md"), "## `kv_connector_extra_config`"))


def test_configuration_lists_every_connector_key_and_no_other():
    listed = [first_code(row[0]) for row in connector_rows()]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == set(connector_keys())
    # and the set is the one from_extra accepts: each key at its default passes
    for key, default in connector_keys().items():
        if default in (None, ""):  # no value of its own: chosen at start-up, or unset
            continue
        value = list(default) if isinstance(default, tuple) else default
        ConnectorConfig.from_extra({key: value})
    with pytest.raises(ConfigError, match="no_such_key"):
        ConnectorConfig.from_extra({"no_such_key": 1})


def test_configuration_gives_each_connector_keys_default():
    """A default written as a plain literal (`60`, `"push"`, `true`, `{}`) is the
    code's; one written in words (an environment variable, "any") is read by eye."""
    keys = connector_keys()
    checked = 0
    for row in connector_rows():
        cell = row[1].strip()
        literal = cell.strip("`") if re.fullmatch(r"`?[^`\s]+`?", cell) else None
        if literal is None:
            continue
        try:
            value = json.loads(literal)
        except json.JSONDecodeError:
            continue
        default = keys[first_code(row[0])]
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, (row[0], value, default)
        checked += 1
    assert checked >= 15


# -- vLLM hooks (architecture.md) vs kvpush.vllm.hooks.HOOKS -------------------------


def hook_rows() -> list[list[str]]:
    return table(section(page("architecture.md"), "### vLLM hooks"))


def test_architecture_lists_every_vllm_hook_and_no_other():
    listed = [first_code(row[0]) for row in hook_rows()]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == set(HOOKS)


def test_architecture_says_which_hooks_change_vllms_state_and_where_they_hold():
    for row in hook_rows():
        hook = HOOKS[first_code(row[0])]
        assert row[2] == ("yes" if hook.risky else "no"), (hook.name, row[2])
        only = re.search(r"\((\d+\.\d+) only\)", row[0])
        releases = {".".join(v.split(".")[:2]) for v in hook.verified}
        if only:
            assert releases == {only.group(1)}, (hook.name, hook.verified)
        else:
            assert len(releases) > 1, (hook.name, "say which release it holds on")


def test_every_hook_a_page_turns_off_exists():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    for path in pages:
        for names in re.findall(r"KVPUSH_VLLM_HOOKS_OFF=([\w,]+)", path.read_text()):
            for name in names.split(","):
                assert name in HOOKS, (path.name, name)


# -- router metrics (routing.md) vs what the router's code records -------------------


def router_metric_names() -> set[str]:
    """The names the router's /metrics exports: every metric its modules record
    (`metrics.<method>("name", ...)`, and the spans table `SPANS`), recorded once in a
    fresh Metrics and read back from its Prometheus text, so the exported names
    (a counter's `_total`, say) are the code's too."""
    recorded: list[tuple[str, str]] = []
    for path in sorted((ROOT / "core" / "router").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "metrics"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                recorded.append((node.func.attr, node.args[0].value))
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "SPANS" for t in node.targets
            ):
                for name, *_ in ast.literal_eval(node.value):
                    recorded.append(("observe", name))
    assert recorded
    metrics = Metrics()
    for method, name in recorded:
        record = getattr(metrics, method)
        if method == "observe":
            record(name, 0.0)
        else:
            record(name, 1.0)
    text = metrics.prometheus(prefix="kvpush_")
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def metric_rows() -> list[list[str]]:
    routing = page("routing.md")
    heading = next(line for line in routing.splitlines() if line.startswith("### Router metrics"))
    return table(section(routing, heading))


def test_routing_lists_every_router_metric_and_no_other():
    listed = [first_code(row[0]).split("{")[0] for row in metric_rows()]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == router_metric_names()


def instance_metric_names() -> set[str]:
    """The names kvpush adds to vLLM's /metrics (kvpush.vllm.stats), read from its
    source so that this test needs no vLLM import."""
    tree = ast.parse((ROOT / "core" / "vllm" / "stats.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    names = {f"vllm:kvpush_{key}_total" for key in values["COUNTS"]}
    names |= {name for name, _ in values["_BY_REASON_METRICS"].values()}
    source = (ROOT / "core" / "vllm" / "stats.py").read_text()
    names |= set(re.findall(r'name="(vllm:kvpush_\w+)"', source))
    return names


def test_every_metric_a_user_page_names_is_exported():
    """A metric a user is told to watch is one a /metrics serves: `vllm:kvpush_*` by
    each vLLM instance, `kvpush_*` by the router. (protocol.md names the Node's
    own counters, which no /metrics serves, as the protocol's internals.)"""
    router = router_metric_names()
    instance = instance_metric_names()
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    for path in pages:
        if path.name == "protocol.md":
            continue
        text = path.read_text()
        for name in re.findall(r"vllm:kvpush_\w+", text):
            assert name in instance, (path.name, name)
        for name in re.findall(r"(?<![\w:])kvpush_\w+_(?:total|seconds)\b", text):
            assert name in router, (path.name, name)


def test_configuration_lists_every_instance_metric():
    listed = set(re.findall(r"vllm:kvpush_\w+", section(page("configuration.md"), "## Metrics")))
    assert listed == instance_metric_names()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_every_link_into_a_page_names_a_heading_it_has():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    anchors = {
        path.name: {
            slug(line.lstrip("#"))
            for line in path.read_text().splitlines()
            if re.match(r"#{1,6} ", line)
        }
        for path in pages
    }
    for path in pages:
        for target, anchor in re.findall(
            r"\]\((?:docs/)?([\w-]+\.md)?#([\w-]+)\)", path.read_text()
        ):
            assert anchor in anchors[target or path.name], (path.name, target, anchor)


def test_coming_from_nixlconnector_maps_every_upstream_key_the_code_knows():
    """Each NixlConnector setting the config check names (kvpush.vllm.upstream_keys) has
    a row in vllm-gpu.md's mapping, and each kvpush key a row offers is a real one."""
    from kvpush.vllm.upstream_keys import UPSTREAM_EXTRA

    rows = table(section(page("vllm-gpu.md"), "## Coming from NixlConnector"))
    upstream = {name for row in rows for name in re.findall(r"`\"?(\w+)", row[0])}
    assert set(UPSTREAM_EXTRA) <= upstream, set(UPSTREAM_EXTRA) - upstream
    keys = set(connector_keys())
    offered = {
        name
        for row in rows
        for name in re.findall(r"`\"?(\w+)\"?(?::|`)", row[1])
        if name.endswith(("_s", "_backends")) or name in ("host", "port", "identity_port")
    }
    assert offered and offered <= keys, offered - keys
