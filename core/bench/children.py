"""The benchmarks' helper processes: they die with the bench, and a bench waiting on
one hears at once when it is gone.

A bench killed by its caller (a test's timeout, Ctrl-C twice, `kill -9`) must not
leave a sender spinning on a core for the rest of the machine's day, and a bench whose
sender died must say so then, not after its whole result timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpush.errors import KVPushError

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


def start(name: str, target: Callable[..., Any], *args: Any) -> mp.process.BaseProcess:
    """Start `target(*args)` in a fresh (spawned) process that the kernel kills when
    the bench that started it dies."""
    process = mp.get_context("spawn").Process(
        target=_orphan_proof, args=(os.getpid(), target, args), name=name, daemon=True
    )
    process.start()
    return process


def _orphan_proof(bench: int, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # Linux only, and only where libc answers: elsewhere the child outlives a
    # killed bench as before, which is no reason to refuse to measure.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The bench may have died while this process was still importing.
    if os.getppid() != bench:
        os._exit(1)
    target(*args)


def take(inbox: Any, what: str, timeout: float, watched: Sequence[mp.process.BaseProcess]) -> Any:
    """The next item of `inbox` (a multiprocessing queue) within `timeout` seconds.

    Raises KVPushError naming what was awaited: as soon as a watched process has failed
    (its own error, if it raised, is on stderr above) or all of them have ended without
    answering, else at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return inbox.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            pass
        failed = [p for p in watched if p.exitcode not in (None, 0)]
        if failed or all(p.exitcode is not None for p in watched):
            # An answer put just before its sender ended may still be on its way.
            try:
                return inbox.get(timeout=_POLL_S)
            except queue.Empty:
                ended = ", ".join(f"{p.name} (code {p.exitcode})" for p in failed or watched)
                raise KVPushError(f"bench {ended} ended before {what}") from None
        if time.monotonic() >= deadline:
            running = ", ".join(p.name for p in watched if p.exitcode is None)
            raise KVPushError(f"no {what} in {timeout:g}s ({running} still running)")


def stop(processes: Sequence[mp.process.BaseProcess], grace: float = 30.0) -> None:
    """Wait up to `grace` seconds for each to end, then kill what is left."""
    for process in processes:
        process.join(grace)
        if process.is_alive():
            process.kill()
            process.join(5)
