"""The GPU tests run the CUDA backend on a real GPU; elsewhere they skip and say why.

They need torch with CUDA and kvpush installed, not NIXL: the two-process tests move
bytes over CUDA IPC or through host memory, by the descriptor tables the core builds.
"""

from __future__ import annotations

import glob
import importlib.util

import pytest


def _why_no_gpu() -> str | None:
    # The driver's /proc entries answer without importing torch (seconds) everywhere else.
    if not glob.glob("/proc/driver/nvidia/gpus/*"):
        return "no NVIDIA GPU here (/proc/driver/nvidia/gpus is empty)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use the GPU (a CPU build, or a driver mismatch)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "tests/gpu/" in item.nodeid]
    if not gpu_items:
        return
    reason = _why_no_gpu()
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))
