"""Fault injection for the data path: the NIXL agent and the device backends, made to
fail on chosen calls.

For tests and chaos drills; a Node has none unless built with `faults=`. Each call
the Node's data path makes is one of OPS:

  prepare   NixlAgent.prepare (descriptor lists, at pairing and for local blocks)
  post      NixlAgent.post (make and start a WRITE or READ)
  check     NixlAgent.done (a transfer's completion)
  release   NixlAgent.release (a finished or abandoned transfer's handle)
  stage     Backends.stage (device <-> host staging copies)
  fence     Backends.wait_fence (the engine's last write of the KV)

and may, with probability `rate`, fail in one of MODES:

  raise     as the real call fails: TransportError for NIXL, BackendError for a device
  hang      check and post: the transfer never completes (NIXL stuck); the others
            stall for `stall_s`, then go on

Decisions come from a seeded random source, so a failing run replays from its seed.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.errors import BackendError, ConfigError, TransportError
from kvpush.transport.agent import Transfer

OPS = ("prepare", "post", "check", "release", "stage", "fence")
MODES = ("raise", "hang")


@dataclass
class Faults:
    """Which calls fail, how often and how; and a count of what was injected."""

    seed: int = 0
    rate: float = 0.1
    ops: Sequence[str] = OPS
    modes: Sequence[str] = MODES
    stall_s: float = 0.05
    injected: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OPS)) + sorted(set(self.modes) - set(MODES))
        if unknown:
            raise ConfigError(f"unknown fault op(s) or mode(s) {unknown}; ops {OPS}, modes {MODES}")
        if not 0 <= self.rate <= 1:
            raise ConfigError(f"fault rate must be within [0, 1], got {self.rate}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()  # the Node's loop thread, and a test's reads

    def draw(self, op: str) -> str | None:
        """The mode `op` fails in this time, or None."""
        with self._lock:
            if op not in self.ops or self._rng.random() >= self.rate:
                return None
            mode = self._rng.choice(list(self.modes))
            self.injected[(op, mode)] += 1
            return mode

    def strike(self, op: str, error: Exception) -> None:
        """A synchronous call's fault, if `op` draws one: raise `error`, or stall."""
        mode = self.draw(op)
        if mode == "raise":
            raise error
        if mode == "hang":
            time.sleep(self.stall_s)

    def total(self) -> int:
        with self._lock:
            return sum(self.injected.values())


class FaultyAgent:
    """A NixlAgent whose data-path calls fail as `faults` draws; the rest pass through."""

    def __init__(self, agent: Any, faults: Faults) -> None:
        self._agent = agent
        self._faults = faults
        self._stuck: dict[int, Transfer] = {}  # transfers that will never complete

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def prepare(self, rows: Any, mem_type: str, peer: str | None = None) -> Any:
        self._faults.strike("prepare", TransportError("prep_xfer_dlist", "injected fault", peer))
        return self._agent.prepare(rows, mem_type, peer)

    def post(self, op: str, *args: Any, **kwargs: Any) -> Transfer:
        mode = self._faults.draw("post")
        if mode == "raise":
            raise TransportError(op, "injected fault: the post failed")
        transfer = self._agent.post(op, *args, **kwargs)
        if mode == "hang":
            transfer.finished = False
            self._stuck[id(transfer)] = transfer
        return transfer

    def done(self, transfer: Transfer) -> bool:
        mode = self._faults.draw("check")  # a stuck transfer, too, may end in an error
        if mode == "raise":
            # As a real failed transfer: its handle is gone with the error.
            self._agent._release_quietly(transfer)
            raise TransportError(f"{transfer.op} completion", "injected fault: the transfer failed")
        if mode == "hang":
            self._stuck[id(transfer)] = transfer
        if id(transfer) in self._stuck:
            return False
        return self._agent.done(transfer)

    def release(self, transfer: Transfer) -> None:
        self._stuck.pop(id(transfer), None)
        mode = self._faults.draw("release")
        if mode == "raise":
            self._agent._release_quietly(transfer)  # no handle leaks from a drill
            raise TransportError("release_xfer_handle", "injected fault: release failed")
        if mode == "hang":
            time.sleep(self._faults.stall_s)
        self._agent.release(transfer)


class FaultyBackends:
    """Backends whose staging and fence waits fail as `faults` draws."""

    def __init__(self, backends: Any, faults: Faults) -> None:
        self._backends = backends
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backends, name)

    def stage(self, kv: Any, block_ids: Sequence[int], direction: str) -> None:
        failed = BackendError(f"injected fault: staging {direction} failed")
        self._faults.strike("stage", failed)
        self._backends.stage(kv, block_ids, direction)

    def wait_fence(self, kv: Any, fence: Any) -> None:
        failed = BackendError("injected fault: waiting for the KV's fence failed")
        self._faults.strike("fence", failed)
        self._backends.wait_fence(kv, fence)
