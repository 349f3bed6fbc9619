"""Shared fixtures. Tests needing something absent skip with the reason, loudly."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import PurePosixPath

import netns
import pytest

from kvpush.ports import ENV_PORTS, port_range

# Minutes each end-to-end module took in a serial run on an AVX2 machine here (a fresh
# clone of 4c8d32f, server starts included), less what later commits took out (Ray's
# measured alone, with three deployments; push's estimated without its API-key pair,
# whose test moved onto overload's). Only their order matters: `make test` runs two
# pytest-xdist workers, each module whole on one (--dist loadfile) in the order
# collected; under xdist the longest come first, so that the two workers finish
# together rather than one waiting on the other.
E2E_MINUTES = {
    "test_vllm_models.py": 9.2, "test_ray_pd.py": 5.0, "test_vllm_router.py": 5.3,
    "test_vllm_push.py": 3.3, "test_vllm_soak.py": 7.5, "test_vllm_xpyd.py": 3.4,
    "test_vllm_tensor_parallel.py": 3.4, "test_vllm_pull.py": 3.0,
    "test_bench_serve.py": 2.8, "test_vllm_preemption.py": 2.4,
    "test_vllm_upstream.py": 2.0, "test_vllm_overload.py": 1.6,
    "test_vllm_block_sizes.py": 1.1, "test_vllm_progressive.py": 1.0,
    "test_vllm_security.py": 1.0, "test_vllm_two_hosts.py": 5.5,
    "test_vllm_first_token.py": 3.1, "test_vllm_readme.py": 1.5,
}  # fmt: skip


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAS_NIXL = _has("nixl") or _has("nixl_cu13") or _has("nixl_cu12")


def pytest_configure(config: pytest.Config) -> None:
    """Every vLLM server of the run shares one cache (what vLLM learns of a model's
    class, once per class rather than once per module's work directory); the first
    process makes it, xdist's workers inherit it, and it goes with the run.

    Under xdist, each worker picks server ports from its own slice of the range, so
    that two workers never choose the same one before either binds it."""
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="kvpush-vllm-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("VLLM_CACHE_ROOT"), True))
    worker, workers = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and workers and ENV_PORTS not in os.environ:
        low, high = port_range()
        width = (high - low + 1) // int(workers)
        first = low + int(worker.removeprefix("gw")) * width
        os.environ[ENV_PORTS] = f"{first}-{first + width - 1}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a stable sort: each module stays whole
        items.sort(key=lambda item: -E2E_MINUTES.get(PurePosixPath(item.path).name, 0.0))
    skip_nixl = pytest.mark.skip(reason="nixl is not installed: pip install nixl==1.5.1")
    for item in items:
        if "nixl" in item.keywords and not HAS_NIXL:
            item.add_marker(skip_nixl)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"kvpush: nixl {'available' if HAS_NIXL else 'MISSING: nixl tests will skip'}"]


@pytest.fixture
def two_hosts() -> Iterator[netns.TwoHosts]:
    """Two simulated hosts (tests/netns.py), removed with every process started in
    them however the test ends; skips, naming why, where namespaces cannot be made."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    hosts = netns.TwoHosts()
    try:
        yield hosts.start()
    finally:
        hosts.close()


# Seconds each module took, by the worker that ran it: E2E_MINUTES is kept from these.
MODULE_SECONDS: dict[tuple[str, str], float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    gateway = getattr(getattr(report, "node", None), "gateway", None)  # xdist's controller
    worker = gateway.id if gateway is not None else os.environ.get("PYTEST_XDIST_WORKER", "-")
    MODULE_SECONDS[worker, report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not MODULE_SECONDS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.section("slowest modules, and each worker's total")
    slowest = sorted(MODULE_SECONDS.items(), key=lambda item: -item[1])[:12]
    for (worker, module), seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {worker} {module}")
    for worker in sorted({w for w, _ in MODULE_SECONDS}):
        total = sum(s for (w, _), s in MODULE_SECONDS.items() if w == worker)
        terminalreporter.write_line(f"{total:8.1f}s {worker} in all")
