"""CPU time of a server's whole process tree, from /proc through psutil."""

from __future__ import annotations

import psutil


def tree_cpu_seconds(pid: int) -> float:
    """User + system seconds used so far by `pid` and every process below it."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
