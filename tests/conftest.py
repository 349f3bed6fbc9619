"""Shared fixtures. Tests needing something absent skip with the reason, loudly."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from kvpush.ports import ENV_PORTS, port_range

# `make test` runs two pytest-xdist workers (--dist loadgroup), each module one unit of
# work so that its servers start once. The end-to-end modules that use the session's
# prefill and decode share one worker, and so one set of those servers; these three
# bring their own and may run beside them.
E2E_ON_THEIR_OWN = {"test_ray_pd.py", "test_vllm_models.py", "test_vllm_soak.py"}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAS_NIXL = _has("nixl") or _has("nixl_cu13") or _has("nixl_cu12")


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker picks server ports from its own slice of the range, so
    that two workers never choose the same one before either binds it."""
    worker, workers = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and workers and ENV_PORTS not in os.environ:
        low, high = port_range()
        width = (high - low + 1) // int(workers)
        first = low + int(worker.removeprefix("gw")) * width
        os.environ[ENV_PORTS] = f"{first}-{first + width - 1}"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "e2e" and path.name not in E2E_ON_THEIR_OWN:
            group = "e2e-session-servers"
        else:
            group = f"{path.parent.name}/{path.name}"
        item.add_marker(pytest.mark.xdist_group(group))
    skip_nixl = pytest.mark.skip(reason="nixl is not installed: pip install nixl==1.5.1")
    for item in items:
        if "nixl" in item.keywords and not HAS_NIXL:
            item.add_marker(skip_nixl)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"kvpush: nixl {'available' if HAS_NIXL else 'MISSING: nixl tests will skip'}"]
