"""What the `kvpush` command line accepts: value types that turn a bad value into a
usage error naming it, and the parser every command is built with.

A type raises argparse.ArgumentTypeError; argparse then names the option, and
Parser.error prints that one line and exits 2, instead of a traceback from deep in
a benchmark minutes later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

USAGE_ERROR = 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help, unless it has none worth showing (a flag,
    None, an empty list) or its help says it already; epilogs as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = action.nargs == 0  # --json, --no-first-token: the default is not using it
        if flag or "default" in text or action.default in (None, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """argparse, with defaults in every help and a usage error as one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def command(commands: Any, name: str, summary: str, **kwargs: Any) -> Parser:
    """A subcommand whose one-line summary shows in its parent's list and its own help."""
    return commands.add_parser(name, help=summary, description=summary, **kwargs)


def _number(text: str, kind: Callable[[str], float], what: str) -> float:
    try:
        value = kind(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (either bound may be open)."""
    return _ranged(int, "an integer", low, high)


def number(
    low: float | None = None, high: float | None = None, above: float | None = None
) -> Callable[[str], float]:
    """A finite number in [low, high], or above `above` (exclusive)."""
    return _ranged(float, "a number", low, high, above)


def _ranged(
    kind: Callable[[str], Any],
    what: str,
    low: float | None,
    high: float | None,
    above: float | None = None,
) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = _number(text, kind, what)
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{text!r} must be more than {above:g}")
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"at least {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text!r} must be {span}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


#: A TCP port a server listens on (0 would be any free one: not what a user means).
port = integer(1, 65535)
count = integer(1)  # how many: at least one
optional_count = integer(0)  # 0 meaning none
seconds = number(above=0)  # a duration that must pass
optional_seconds = number(0)  # 0 meaning off or at once
share = number(0, 1)  # a fraction


def listing(item: Callable[[str], Any]) -> Callable[[str], tuple]:
    """A comma-separated list of `item`s, at least one."""

    def parse(text: str) -> tuple:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} is an empty list")
        return tuple(item(part) for part in parts)

    parse.__name__ = "list"
    return parse


def names(known: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of names, each one of `known`."""
    known = tuple(known)

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            shown = unknown or [text]
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, shown))}; choose from {', '.join(known)}"
            )
        return chosen

    parse.__name__ = "list of names"
    return parse


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, e.g. '{"idle_wait_s": 0}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({{...}})")
    return value


def cpus(text: str) -> str:
    """A CPU list as taskset reads it (0, 0-3, 0,2,4), of CPUs this machine has."""
    try:
        chosen = [cpu for part in text.split(",") for cpu in _cpu_range(part)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list (0, 0-3, 0,2)") from None
    have = os.cpu_count() or 1
    if not chosen or max(chosen) >= have:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has CPUs 0-{have - 1}")
    return text


def _cpu_range(part: str) -> range:
    first, _, last = part.strip().partition("-")
    return range(int(first), int(last or first) + 1)


def directory(text: str) -> str:
    """A directory that exists (a local model)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def existing_file(text: str) -> str:
    """A file that exists (a wheel, a record)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return text


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def bit_rate(text: str) -> int:
    """A link rate as tc writes it, e.g. `300mbit`, `1gbit`: bits a second."""
    spelled = text.strip().lower()
    unit = next((u for u in sorted(_RATE_UNITS, key=len, reverse=True) if spelled.endswith(u)), "")
    try:
        rate = float(spelled[: -len(unit)]) if unit else 0.0
    except ValueError:
        rate = 0.0
    if not (math.isfinite(rate) and rate * _RATE_UNITS.get(unit, 0) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate such as 300mbit or 1gbit")
    return int(rate * _RATE_UNITS[unit])


bit_rate.__name__ = "rate"
