"""Shared fixtures. Tests needing something absent skip with the reason, loudly."""

from __future__ import annotations

import importlib.util
import os
from pathlib import PurePosixPath

import pytest

from kvpush.ports import ENV_PORTS, port_range

# End-to-end modules that start every server they use; the others share the session's
# prefill and decode (tests/e2e/conftest.py).
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs two pytest-xdist workers. Each module is one unit of work, so
    that its servers start once; the end-to-end modules on the session's prefill and
    decode are one unit together, so that those start once too."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = PurePosixPath(nodeid.split("::", 1)[0])
            if module.parent.name == "e2e" and module.name not in E2E_ON_THEIR_OWN:
                return "e2e on the session's servers"
            return str(module)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_nixl = pytest.mark.skip(reason="nixl is not installed: pip install nixl==1.5.1")
    for item in items:
        if "nixl" in item.keywords and not HAS_NIXL:
            item.add_marker(skip_nixl)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"kvpush: nixl {'available' if HAS_NIXL else 'MISSING: nixl tests will skip'}"]
