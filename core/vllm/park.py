"""Let an idle worker process sleep instead of spinning for the next step.

vLLM's multiprocess executor hands each step to its workers through a shared-memory
queue whose readers spin (sched_yield) for a second after every read before they
fall back to sleeping on a socket (`SpinCondition.busy_loop_s` in vLLM's
shm_broadcast). That keeps step latency low under load, but while every request
waits for a transfer the scheduler steps only when the doorbell rings
(kvpush.vllm.wake), and a worker that spins through those waits costs a whole core:
on a machine whose cores prefill and decode share, prefill's.

So when the scheduler says it is about to wait, the worker marks its queue as read
long ago; its next read then sleeps on the queue's socket, which the scheduler's next
write wakes at once. This reaches into vLLM's private queue object. It is looked
for once, from the frames that call register_kv_caches (the worker's busy loop owns
the queue); if vLLM's shape differs, or the executor is not multiprocess (GPUs with
one worker run it in the engine process, with no queue at all), parking does nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


class Parking:
    def __init__(self, spin: Any | None) -> None:
        self._spin = spin

    @classmethod
    def find(cls) -> Parking:
        """The calling worker's step queue, from the frames above this call."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            spin = getattr(getattr(owner, "rpc_broadcast_mq", None), "_spin_condition", None)
            if hasattr(spin, "last_read") and hasattr(spin, "busy_loop_s"):
                return cls(spin)
            frame = frame.f_back
        log.debug("kvpush: no multiprocess step queue found; idle workers are vLLM's to park")
        return cls(None)

    @property
    def available(self) -> bool:
        return self._spin is not None

    def park(self) -> None:
        """Sleep on the socket, not spin, while waiting for the next step."""
        if self._spin is not None:
            self._spin.last_read = float("-inf")
