"""Shared fixtures. Tests needing something absent skip with the reason, loudly."""

from __future__ import annotations

import importlib.util

import pytest


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAS_NIXL = _has("nixl") or _has("nixl_cu13") or _has("nixl_cu12")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_nixl = pytest.mark.skip(reason="nixl is not installed: pip install nixl==1.5.1")
    for item in items:
        if "nixl" in item.keywords and not HAS_NIXL:
            item.add_marker(skip_nixl)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"kvpush: nixl {'available' if HAS_NIXL else 'MISSING: nixl tests will skip'}"]
