"""A server's whole process tree: the CPU it used, the memory and files it holds, and
which cores it may run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import psutil


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_seconds(pid: int) -> float:
    """User + system seconds used so far by `pid` and every process below it."""
    total = 0.0
    for process in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def tree_footprint(pid: int) -> tuple[int, int]:
    """Resident bytes and open file descriptors of `pid` and every process below it
    (shared pages count once per process: a trend, not an exact total)."""
    rss = fds = 0
    for process in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            rss += process.memory_info().rss
            fds += process.num_fds()
    return rss, fds


def pin_tree(pid: int, cpus: Iterable[int]) -> int:
    """Bind every thread of every process under `pid` to `cpus`, as if the server
    had those cores to itself (a separate host); the number of threads bound."""
    allowed = set(cpus)
    bound = 0
    for process in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
            for tid in os.listdir(f"/proc/{process.pid}/task"):
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.sched_setaffinity(int(tid), allowed)
                    bound += 1
    return bound


def parse_cpus(spec: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus
