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
write wakes.

That wake-up is not guaranteed: parked readers were seen to wait out vLLM's recheck
interval, five seconds (SHM_READER_RECHECK_INTERVAL_MS), as single prefill steps of
5.0 s. The likely cause, read from the code, not observed: the writer's notify
socket keeps one message in flight (a send high-water mark of 1), and ZeroMQ learns
that the previous one left only when it next processes its commands, which it
throttles; two steps written close together can lose the second notify. vLLM's own
readers spin through such bursts and never rely on that notify; a parked one does.
So parking also shortens that interval to PARKED_RECHECK_MS, and the first step that
is not parked puts vLLM's back.

This reaches into vLLM's private queue objects. They are looked for once, from the
frames that call register_kv_caches (the worker's busy loop owns the queue); if
vLLM's shape differs, or the executor is not multiprocess (GPUs with one worker run
it in the engine process, with no queue at all), parking does nothing.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from kvpush.vllm.frames import find_caller

log = logging.getLogger(__name__)

# A lost notify costs a parked worker at most this; an idle parked worker wakes this
# often to look (about 100 cheap checks a second, and only while parked).
PARKED_RECHECK_MS = 10
_RECHECK = "SHM_READER_RECHECK_INTERVAL_MS"


class Parking:
    def __init__(self, spin: Any | None, queue_module: ModuleType | None = None) -> None:
        self._spin = spin
        self._module = queue_module if hasattr(queue_module, _RECHECK) else None
        self._vllm_recheck = getattr(self._module, _RECHECK, None)

    @classmethod
    def find(cls) -> Parking:
        """The calling worker's step queue, from the frames above this call."""
        owner = find_caller(lambda o: _spin_condition(o) is not None)
        if owner is None:
            log.debug("kvpush: no multiprocess step queue found; idle workers are vLLM's to park")
            return cls(None)
        spin = _spin_condition(owner)
        module = sys.modules.get(type(spin).__module__)
        if not hasattr(module, _RECHECK):
            log.warning(
                "kvpush: vLLM's step queue has no %s; a parked worker may miss a "
                "step's wake-up for vLLM's whole recheck interval",
                _RECHECK,
            )
        return cls(spin, module)

    @property
    def available(self) -> bool:
        return self._spin is not None

    def park(self) -> None:
        """Sleep on the socket, not spin, while waiting for the next step; look again
        every PARKED_RECHECK_MS in case that step's notify was lost."""
        if self._spin is None:
            return
        self._spin.last_read = float("-inf")
        if self._module is not None:
            setattr(self._module, _RECHECK, min(PARKED_RECHECK_MS, self._vllm_recheck))

    def unpark(self) -> None:
        """A step with work came: vLLM's own spinning and recheck interval apply again."""
        if self._module is not None:
            setattr(self._module, _RECHECK, self._vllm_recheck)


def _spin_condition(owner: Any) -> Any | None:
    """The spin condition of `owner`'s step queue, if it has one that parks."""
    spin = getattr(getattr(owner, "rpc_broadcast_mq", None), "_spin_condition", None)
    return spin if hasattr(spin, "last_read") and hasattr(spin, "busy_loop_s") else None
