"""Every reach into vLLM past its connector contract, in this one module.

KVConnectorBase_V1 hands a connector the scheduler's and the workers' calls, not the
objects around them. kvpush reaches past it eleven times, each a Hook below: what it
touches, the vLLM versions it was read and tested against, and what a deployment
pays where it is absent. On a vLLM outside a hook's versions, a hook that changes
vLLM's state (`risky`) stays off; one that only reads is tried, and fails soft.
KVPUSH_VLLM_HOOKS_OFF (comma-separated names) turns risky hooks off on purpose.

Each process records what attached. A hook that did not is a WARNING naming its
cost, once; the scheduler logs one INFO line of what did. `/kvpush/state?detail=1`
shows the scheduler's record and each worker rank's; `kvpush doctor` probes the
installed vLLM without starting an engine.

One module: every reach past vLLM's contract lives here, where one
read shows all of them, their versions and their costs.

Parking (why it exists): vLLM's multiprocess executor hands each step to its workers
through a shared-memory queue whose readers spin (sched_yield) for a second after
every read before they sleep on the queue's socket (`SpinCondition.busy_loop_s` in
shm_broadcast). While every request waits for a transfer, the scheduler steps only
when the doorbell rings (kvpush.vllm.wake), and a worker spinning through those waits
costs a whole core, on a shared machine the other engine's. So when the scheduler
says it is about to wait, the worker marks its queue read long ago: its next read
sleeps on the socket, which the next step's write wakes. That wake-up can be lost:
the writer's notify socket keeps one message in flight (send high-water mark 1) and
ZeroMQ learns the previous one left only when it next processes its commands, so two
steps written close together can lose the second notify. vLLM's own readers spin
through such bursts; a parked one does not. So the engine process has the socket take
in those acknowledgements before each send (step_notify), and parking also shortens
vLLM's recheck interval (SHM_READER_RECHECK_INTERVAL_MS, 5 s) to RECHECK_MS as a
safety net; the first step that is not parked puts the interval back.

Window margin (why it exists): when a prefill leg finishes, vLLM frees the
sliding-window blocks that the next token's window no longer covers (every token
before N - W + 1, for a prompt of N tokens and a window of W) before it hands the
connector the request's blocks. Decode recomputes the prompt's last token, whose
window starts one token earlier, at N - W; when that token is the last of its block,
its block is gone. vLLM keeps `extra_retained_tokens` more below each window for its
own multi-token drafters; one more on a producer keeps exactly that block.

Reader spin (why it exists): that second of spinning follows every read, not only
the waits kvpush parks through. A decode that answers a request a second, in steps
tens of milliseconds long, spins a core in each worker between requests, and the
engine process spins likewise on its workers' result queues during each step. On
kvpush instances each of those readers spins `reader_spin_s` (2 ms: longer than the
gap between two steps of a busy engine, so under load they still never sleep), and
so sleeps far more often than vLLM's: its recheck is shortened as a parked one's.
vLLM 0.34 adds a spin of its own in the engine process, up to a second per step
while it waits for its workers' results (taking in requests meanwhile); engine_spin
bounds it by the same `reader_spin_s`.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Container
from dataclasses import replace
from types import ModuleType
from typing import Any

from kvpush.errors import ConfigError
from kvpush.vllm import CONNECTOR_MODULE, CONNECTOR_NAME, hook_spec
from kvpush.vllm.hook_spec import Hook, Target

log = logging.getLogger(__name__)

# A safety net: with step_notify attached no notify was seen lost (80 pairs of steps
# 0.2 ms apart; without it about 60 % of the second steps were), so this bounds only
# a loss of unknown cause, or the cost where step_notify could not attach. An idle
# parked worker wakes this often to look: 0.5 % of a core at 10 ms here (0.17 % at
# 50 ms), against the core a spinning one burns.
RECHECK_MS = 10
_RECHECK = "SHM_READER_RECHECK_INTERVAL_MS"
_ENGINE_SPIN = "_INPUT_SPIN_DURATION_S"
OFF_ENV = "KVPUSH_VLLM_HOOKS_OFF"


# The vLLM source files the hooks' targets live in (kvpush.vllm.contract reads them).
_SHM = "vllm/distributed/device_communicators/shm_broadcast.py"
_SCHED = "vllm/v1/core/sched/scheduler.py"
_EXECUTOR = "vllm/v1/executor/multiproc_executor.py"
_CORE = "vllm/v1/engine/core.py"


HOOKS = {
    hook.name: hook
    for hook in (
        Hook(
            "connector_registry",
            "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory._registry",
            ("0.32.0", "0.33.0", "0.34.0"),
            False,
            "registering twice raises: KVPushConnector may not be nameable in "
            "--kv-transfer-config (name kv_connector_module_path instead)",
            targets={
                "KVConnectorFactory._registry": Target(
                    "vllm/distributed/kv_transfer/kv_connector/factory.py",
                    "KVConnectorFactory",
                    ("_registry",),
                ),
                "KVConnectorFactory.register_connector": Target(
                    "vllm/distributed/kv_transfer/kv_connector/factory.py",
                    "KVConnectorFactory",
                    ("register_connector",),
                ),
            },
        ),
        Hook(
            "caller_kv_role",
            "the KVTransferConfig in the frame of vLLM's call asking whether the "
            "connector needs piecewise graphs",
            ("0.32.0", "0.33.0", "0.34.0"),
            False,
            "a decode with layerwise on runs piecewise graphs, not full ones",
            targets={
                "self.kv_transfer_config beside the call": Target(
                    "vllm/config/vllm.py",
                    None,
                    ("requires_piecewise_for_cudagraph", "self.kv_transfer_config"),
                    "near",
                )
            },
        ),
        Hook(
            "engine_inbox",
            "EngineCoreProc.input_queue.put, wrapped to ring the doorbell",
            ("0.32.0", "0.33.0", "0.34.0"),
            True,
            "a request or abort reaching an engine that waits on transfers is seen "
            "only after idle_wait_s",
            targets={
                "EngineCoreProc.input_queue": Target(_CORE, "EngineCoreProc", ("input_queue",))
            },
        ),
        Hook(
            "idle_wait",
            "vLLM's engine loop, held in build_connector_meta while only transfers can "
            "change anything",
            ("0.32.0", "0.33.0", "0.34.0"),
            True,
            "an engine whose requests all wait for transfers runs about a thousand "
            "empty steps a second",
            targets={
                "connector.build_connector_meta": Target(
                    _SCHED, "Scheduler", ("build_connector_meta",)
                )
            },
        ),
        Hook(
            "step_notify",
            "the executor's rpc_broadcast_mq._spin_condition.notify (the writing end of "
            "the workers' step queue), wrapped",
            ("0.32.0", "0.33.0", "0.34.0"),
            True,
            "a parked worker misses about half the steps written within a millisecond "
            "of the one before, and sees each only at its recheck "
            f"({RECHECK_MS} ms)",
            targets={
                "SpinCondition.notify, local_notify_socket, is_reader": Target(
                    _SHM, "SpinCondition", ("notify", "local_notify_socket", "is_reader")
                ),
                "MessageQueue._spin_condition": Target(_SHM, "MessageQueue", ("_spin_condition",)),
                "MultiprocExecutor.rpc_broadcast_mq": Target(
                    _EXECUTOR, "MultiprocExecutor", ("rpc_broadcast_mq",)
                ),
            },
        ),
        Hook(
            "reader_spin",
            "busy_loop_s of the reading end of a worker's rpc_broadcast_mq and of the "
            "executor's response_mqs (shm_broadcast.SpinCondition), and "
            "shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS",
            ("0.32.0", "0.33.0", "0.34.0"),
            True,
            "each worker, and the engine process during a step, spins a core for a "
            "second after every read, between requests too",
            targets={
                "SpinCondition.busy_loop_s": Target(_SHM, "SpinCondition", ("busy_loop_s",)),
                "SHM_READER_RECHECK_INTERVAL_MS": Target(_SHM, None, (_RECHECK,)),
                "MultiprocExecutor.response_mqs": Target(
                    _EXECUTOR, "MultiprocExecutor", ("response_mqs",)
                ),
            },
        ),
        Hook(
            "engine_spin",
            "vllm.v1.engine.core._INPUT_SPIN_DURATION_S, which the engine process "
            "reads on every step it waits for its workers' results",
            ("0.34.0",),
            True,
            "the engine process spins up to a second of a core on every step, while "
            "its workers compute",
            targets={"_INPUT_SPIN_DURATION_S": Target(_CORE, None, (_ENGINE_SPIN,))},
        ),
        Hook(
            "window_margin",
            "SlidingWindowSpec.extra_retained_tokens of a producer's sliding-window KV "
            "cache groups (the KVCacheConfig vLLM's Scheduler builds its KV cache "
            "manager from), raised by one before that manager exists",
            ("0.32.0",),
            True,
            "a prefill instance of a sliding-window model under the hybrid KV cache "
            "manager refuses to start (for one prompt in block_size, vLLM would free "
            "a window block decode needs before kvpush could send it)",
            targets={
                "SlidingWindowSpec.extra_retained_tokens": Target(
                    "vllm/v1/kv_cache_interface.py",
                    "SlidingWindowSpec",
                    ("extra_retained_tokens",),
                    "fields",
                ),
                "Scheduler makes the connector before its KVCacheManager": Target(
                    _SCHED,
                    "Scheduler",
                    ("__init__", "create_connector(", "KVCacheManager("),
                    "order",
                ),
            },
        ),
        Hook(
            "landings_before_schedule",
            "Scheduler.schedule (wrapped on the instance), Scheduler.requests and "
            "finished_recving_kv_req_ids, and KVConnectorOutput.finished_recving "
            "(ids already taken, removed)",
            ("0.32.0",),
            True,
            "a landing reaches decode's scheduler only with the output of the step "
            "after it: one more step (an empty round trip to the workers when idle) "
            "before decode computes",
            targets={
                "Scheduler.schedule, requests, finished_recving_kv_req_ids": Target(
                    _SCHED, "Scheduler", ("schedule", "requests", "finished_recving_kv_req_ids")
                ),
                "KVConnectorOutput.finished_recving": Target(
                    "vllm/v1/outputs.py", "KVConnectorOutput", ("finished_recving",), "fields"
                ),
            },
        ),
        Hook(
            "prompt_cut",
            "a prefill leg's Request.prompt_token_ids, _all_token_ids and "
            "num_prompt_tokens, each one token shorter, from on_new_request",
            ("0.32.0",),
            True,
            "a prefill instance of a recurrent-state model (gated DeltaNet, Mamba) "
            "refuses to start (its decode would apply the prompt's last token twice)",
            targets={
                "Request._all_token_ids, prompt_token_ids, num_prompt_tokens": Target(
                    "vllm/v1/request.py",
                    "Request",
                    ("_all_token_ids", "prompt_token_ids", "num_prompt_tokens"),
                    "fields",
                ),
                "Scheduler.add_request calls on_new_request": Target(
                    _SCHED, "Scheduler", ("on_new_request",)
                ),
            },
        ),
        Hook(
            "park_workers",
            "a worker's rpc_broadcast_mq._spin_condition.last_read and "
            "shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS",
            ("0.32.0", "0.33.0", "0.34.0"),
            True,
            "decode's waiting workers spin, about a core each, while requests wait for KV",
            targets={
                "SpinCondition.last_read": Target(_SHM, "SpinCondition", ("last_read",)),
                "SHM_READER_RECHECK_INTERVAL_MS": Target(_SHM, None, (_RECHECK,)),
                "WorkerProc.rpc_broadcast_mq": Target(
                    _EXECUTOR, "WorkerProc", ("rpc_broadcast_mq",)
                ),
            },
        ),
    )
}


def turned_off() -> set[str]:
    """The hooks an operator turned off (OFF_ENV, comma-separated): an escape hatch
    where a hook misbehaves on a vLLM, and the A/B of what one is worth."""
    names = {name.strip() for name in os.environ.get(OFF_ENV, "").split(",") if name.strip()}
    # Only the hooks that change vLLM's state can be kept off; the others only read.
    risky = sorted(name for name, hook in HOOKS.items() if hook.risky)
    unknown = sorted(names - set(risky))
    if unknown:
        raise ConfigError(
            f"{OFF_ENV} names no vLLM hook that can be turned off: {unknown}; those are {risky}"
        )
    return names


class Record:
    """What attached in this process: hook name -> "attached" or "off: why"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.states: dict[str, str] = {}

    def attached(self, name: str) -> None:
        with self._lock:
            self.states[name] = "attached"

    def missed(self, name: str, why: str) -> None:
        hook = HOOKS[name]
        with self._lock:
            first = name not in self.states
            self.states[name] = f"off: {why}"
        if first:
            log.warning("kvpush: vLLM hook %s is off (%s): %s", name, why, hook.cost)

    def allowed(self, name: str) -> bool:
        """Whether a risky hook may try to attach on this vLLM (else recorded off)."""
        hook = HOOKS[name]
        if name in turned_off():
            self.missed(name, f"turned off by {OFF_ENV}")
            return False
        if hook.risky and not hook_spec.verified(hook):
            among = ", ".join(hook.verified)
            self.missed(name, f"vLLM {hook_spec.vllm_version()} is not among {among}")
            return False
        return True

    def log_attached(self, where: str) -> None:
        with self._lock:
            on = sorted(name for name, state in self.states.items() if state == "attached")
        version = hook_spec.vllm_version()
        log.info("kvpush: vLLM %s, %s hooks attached: %s", version, where, on or "none")

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self.states)


RECORD = Record()  # this process's


def find_caller(test: Callable[[Any], bool]) -> Any | None:
    """The `self` of the nearest frame up the stack that passes `test`, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and test(owner):
            return owner
        frame = frame.f_back
    return None


# -- connector_registry (every process, from the vllm.general_plugins entry point) -----


def register_connector() -> None:
    """Make "KVPushConnector" nameable in --kv-transfer-config; harmless twice."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if registry is None:
        RECORD.missed("connector_registry", "KVConnectorFactory has no _registry")
    elif CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # already registered, and no registry to have told us
        return
    if registry is not None:
        RECORD.attached("connector_registry")


# -- caller_kv_role (scheduler process, when vLLM picks the CUDA graph mode) -----------


def callers_kv_role(extra_config: dict[str, Any]) -> str | None:
    """The kv_role of the KVTransferConfig whose extra config vLLM asks about (vLLM
    passes only the extra config), or None if no caller holds it."""

    def holds_it(owner: Any) -> bool:
        transfer = getattr(owner, "kv_transfer_config", None)
        return getattr(transfer, "kv_connector_extra_config", None) is extra_config

    owner = find_caller(holds_it)
    if owner is None:
        RECORD.missed("caller_kv_role", "no caller holds the KVTransferConfig")
        return None
    RECORD.attached("caller_kv_role")
    return getattr(owner.kv_transfer_config, "kv_role", None)


# -- engine_inbox (scheduler process, while vLLM builds the engine) --------------------


def ring_on_engine_inbox(ring: Callable[[], None]) -> bool:
    """Call `ring` whenever vLLM's engine queues a request, abort or utility call
    (EngineCoreProc.input_queue; put_nowait goes through put). True if attached."""
    if not RECORD.allowed("engine_inbox"):
        return False
    owner = find_caller(lambda o: isinstance(getattr(o, "input_queue", None), queue.Queue))
    if owner is None:
        RECORD.missed("engine_inbox", "no engine with an input_queue on the stack")
        return False
    inbox = owner.input_queue
    put = inbox.put

    def put_and_ring(item: Any, block: bool = True, timeout: float | None = None) -> None:
        put(item, block, timeout)
        ring()

    inbox.put = put_and_ring  # type: ignore[method-assign]
    RECORD.attached("engine_inbox")
    return True


# -- idle_wait (scheduler process) ------------------------------------------------------


def idle_wait_allowed(idle_wait_s: float) -> float:
    """The engine-loop wait to use: `idle_wait_s`, or 0 where the hook is off."""
    if not idle_wait_s:
        RECORD.missed("idle_wait", "idle_wait_s is 0")
        return 0.0
    if not RECORD.allowed("idle_wait"):
        return 0.0
    RECORD.attached("idle_wait")
    return idle_wait_s


# -- landings_before_schedule (scheduler process, while vLLM builds its Scheduler) -------


class ScheduleHook:
    """vLLM's Scheduler, with `before` run at the start of each schedule() call."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    @classmethod
    def attach(cls, before: Callable[[], None]) -> ScheduleHook | None:
        """Wrap the schedule() of the Scheduler now making the connector; None (and
        the cost recorded) where there is none or the hook is off."""
        name = "landings_before_schedule"
        if not RECORD.allowed(name):
            return None
        scheduler = find_caller(
            lambda o: (
                callable(getattr(o, "schedule", None))
                and callable(getattr(o, "update_from_output", None))
                and hasattr(o, "kv_cache_config")
            )
        )
        if scheduler is None:
            RECORD.missed(name, "no vLLM Scheduler on the stack")
            return None
        schedule = scheduler.schedule

        def before_then_schedule(*args: Any, **kwargs: Any) -> Any:
            before()
            return schedule(*args, **kwargs)

        scheduler.schedule = before_then_schedule
        RECORD.attached(name)
        return cls(scheduler)

    def take_landed(self, request_id: str) -> bool:
        """Tell vLLM a request's KV is loaded, as a worker's finished_recving would; its
        schedule() promotes it. False if vLLM no longer waits for it (finished, or
        told already)."""
        from vllm.v1.request import RequestStatus

        scheduler = self._scheduler
        request = scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        if request_id in scheduler.finished_recving_kv_req_ids:
            return False
        scheduler.finished_recving_kv_req_ids.add(request_id)
        return True

    @staticmethod
    def drop_taken(output: Any, taken: Container[str]) -> set[str]:
        """Remove from a step's finished_recving the requests already taken; returns
        those removed (vLLM must not see a running request's load finish again)."""
        reported = getattr(output, "finished_recving", None) or set()
        dropped = {r for r in reported if r in taken}
        if dropped:
            output.finished_recving = set(reported) - dropped
        return dropped


# -- park_workers (worker processes) ----------------------------------------------------


class Parking:
    """A worker's step queue, parked and unparked by the step's metadata."""

    def __init__(self, spin: Any | None, queue_module: ModuleType | None = None) -> None:
        self._spin = spin
        self._module = queue_module if hasattr(queue_module, _RECHECK) else None
        self._resting: int | None = None  # the recheck to put back on unpark, while parked

    @classmethod
    def find(cls) -> Parking:
        """The calling worker's step queue, from the frames above this call (vLLM's
        worker loop owns it, and calls register_kv_caches)."""
        if not RECORD.allowed("park_workers"):
            return cls(None)
        owner = find_caller(lambda o: _spin_condition(o) is not None)
        if owner is None:
            # GPUs with one worker run it in the engine process: no queue to park on.
            RECORD.missed("park_workers", "no multiprocess step queue on the stack")
            return cls(None)
        spin = _spin_condition(owner)
        module = sys.modules.get(type(spin).__module__)
        if not hasattr(module, _RECHECK):
            # Parking without a short recheck could hang a worker on a lost notify.
            RECORD.missed("park_workers", f"vLLM's step queue has no {_RECHECK}")
            return cls(None)
        RECORD.attached("park_workers")
        return cls(spin, module)

    @property
    def available(self) -> bool:
        return self._spin is not None

    def park(self) -> None:
        """Sleep on the socket, not spin, while waiting for the next step; look again
        every RECHECK_MS in case that step's notify was lost."""
        if self._spin is None:
            return
        self._spin.last_read = float("-inf")
        if self._module is not None and self._resting is None:
            self._resting = getattr(self._module, _RECHECK)
            _shorten_recheck(self._module)

    def unpark(self) -> None:
        """A step with work came: the recheck from before parking applies again."""
        if self._module is not None and self._resting is not None:
            setattr(self._module, _RECHECK, self._resting)
            self._resting = None


def _shorten_recheck(module: ModuleType | None) -> None:
    """A sleeping reader of `module`'s queues looks every RECHECK_MS, notified or not."""
    if module is not None and hasattr(module, _RECHECK):
        setattr(module, _RECHECK, min(RECHECK_MS, getattr(module, _RECHECK)))


def _spin_condition(owner: Any) -> Any | None:
    """The spin condition of `owner`'s step queue, if it has one that parks."""
    spin = getattr(getattr(owner, "rpc_broadcast_mq", None), "_spin_condition", None)
    return spin if hasattr(spin, "last_read") and hasattr(spin, "busy_loop_s") else None


# -- reader_spin (worker processes, and the scheduler's while vLLM builds the engine) ---


def bound_reader_spin(spin_s: float, executor_side: bool) -> bool:
    """Spin `spin_s`, not vLLM's second, after each read of this process's step queue
    (a worker) or of its workers' result queues (the engine process: `executor_side`).
    True if attached."""
    if not RECORD.allowed("reader_spin"):
        return False
    if executor_side:
        owner = find_caller(lambda o: _response_queues(getattr(o, "model_executor", None)))
        queues = _response_queues(owner.model_executor) if owner is not None else []
        spins = [getattr(q, "_spin_condition", None) for q in queues]
    else:
        owner = find_caller(lambda o: _spin_condition(o) is not None)
        spins = [_spin_condition(owner)] if owner is not None else []
    spins = [s for s in spins if getattr(s, "is_reader", False) and hasattr(s, "busy_loop_s")]
    if not spins:
        # One GPU (the worker in the engine process), or another executor: no queue.
        RECORD.missed("reader_spin", "no multiprocess step or result queue on the stack")
        return False
    shorter = any(spin_s < spin.busy_loop_s for spin in spins)
    for spin in spins:
        spin.busy_loop_s = spin_s
    if shorter:  # asleep more often: a lost notify must not cost vLLM's 5 s recheck
        _shorten_recheck(sys.modules.get(type(spins[0]).__module__))
    RECORD.attached("reader_spin")
    if not executor_side:
        warn_spinloop_extension()
    return True


def warn_spinloop_extension() -> bool:
    """Say so when vLLM's spin-loop extension is on (vLLM 0.33, VLLM_USE_SPINLOOP_EXT):
    a reader then spins on the queue's flags before each wait, outside the reader-spin
    bound and parking. True if it is on."""
    from vllm.distributed.device_communicators import shm_broadcast

    if not getattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", False):
        return False
    log.warning(
        "kvpush: vLLM's spin-loop extension is on (VLLM_USE_SPINLOOP_EXT): each worker "
        "spins before every wait for a step, outside reader_spin_s and park_workers, so "
        "waiting workers keep a core busy; unset it on P/D instances whose cores are shared"
    )
    return True


# -- engine_spin (scheduler process, while vLLM builds the engine) ---------------------


def bound_engine_spin(spin_s: float) -> bool:
    """Spin at most `spin_s`, not vLLM's second, while the engine process waits for a
    step's results (vLLM 0.34 takes in requests and aborts meanwhile; one that comes
    later is taken when the step ends, as in vLLM before 0.34). vLLM reads the
    constant on every step, so setting it now bounds every step. True if attached;
    False, and quiet, on a vLLM without that spin."""
    import importlib

    core = importlib.import_module("vllm.v1.engine.core")
    if not hasattr(core, _ENGINE_SPIN) or not RECORD.allowed("engine_spin"):
        return False
    setattr(core, _ENGINE_SPIN, min(spin_s, getattr(core, _ENGINE_SPIN)))
    RECORD.attached("engine_spin")
    return True


# -- window_margin (scheduler process, a producer of a sliding-window model) ----------


def keep_window_margin(kv_cache_config: Any) -> None:
    """Keep one more token below each sliding window of this producer's KV cache
    groups (the module docstring says why). ConfigError where it cannot attach: a
    transfer would then miss, for one prompt in block_size, a block decode reads."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    groups = [
        g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, SlidingWindowSpec)
    ]
    why = ""
    if not RECORD.allowed("window_margin"):
        why = "the hook is off"
    else:
        # vLLM's Scheduler makes the connector before its KV cache manager, from the
        # same config object: a change made now is the one that manager reads.
        scheduler = find_caller(
            lambda owner: getattr(owner, "kv_cache_config", None) is kv_cache_config
        )
        if scheduler is None or hasattr(scheduler, "kv_cache_manager"):
            why = "vLLM's KV cache manager is not built after the connector here"
            RECORD.missed("window_margin", why)
    if why:
        raise ConfigError(
            f"kvpush cannot keep the sliding-window block decode needs ({why}); serve "
            "this model with --disable-hybrid-kv-cache-manager (full KV on every layer)"
        )
    for group in groups:
        spec = group.kv_cache_spec
        group.kv_cache_spec = replace(spec, extra_retained_tokens=spec.extra_retained_tokens + 1)
    RECORD.attached("window_margin")


def _response_queues(executor: Any) -> list[Any]:
    queues = getattr(executor, "response_mqs", None)
    return list(queues) if isinstance(queues, list | tuple) else []


# -- step_notify (scheduler process, while vLLM builds the engine) ---------------------


def prepare_step_notify() -> bool:
    """Make every step's notify reach a worker sleeping on the step queue.

    The queue's notify socket (ZeroMQ PUB, send high-water mark 1) counts its last
    message as in flight until it processes its commands, which it does only when
    next used and then after the send is decided: a step written within about a
    millisecond of the previous one finds the pipe full, and its notify is dropped.
    Asking the socket for its events first processes those commands. True if
    attached."""
    if not RECORD.allowed("step_notify"):
        return False
    owner = find_caller(lambda o: _writer_spin(getattr(o, "model_executor", None)) is not None)
    if owner is None:
        # One GPU: the worker runs in the engine process, with no step queue.
        RECORD.missed("step_notify", "no multiprocess executor's step queue on the stack")
        return False
    import zmq

    spin = _writer_spin(owner.model_executor)
    sock, notify = spin.local_notify_socket, spin.notify

    def notify_after_taking_in_acks() -> None:
        sock.getsockopt(zmq.EVENTS)
        notify()

    spin.notify = notify_after_taking_in_acks
    RECORD.attached("step_notify")
    return True


def _writer_spin(executor: Any) -> Any | None:
    spin = getattr(getattr(executor, "rpc_broadcast_mq", None), "_spin_condition", None)
    if getattr(spin, "is_reader", True) or not hasattr(spin, "local_notify_socket"):
        return None
    return spin if callable(getattr(spin, "notify", None)) else None


# -- prompt_cut (scheduler process, a producer of a recurrent-state model) ------------


def allow_prompt_cut() -> None:
    """A producer of a recurrent-state model has its prefill legs stop one token
    short (kvpush.vllm.groups). ConfigError where it cannot: decode would then
    apply the prompt's last token to a state that holds it already."""
    problem = _static_problem("prompt_cut") if RECORD.allowed("prompt_cut") else "off"
    if problem:
        if problem != "off":
            RECORD.missed("prompt_cut", problem)
        raise ConfigError(
            "kvpush cannot have this prefill instance stop before each prompt's last "
            "token (the prompt_cut hook is off), which a model with recurrent state "
            "needs: serve it without disaggregation"
        )
    RECORD.attached("prompt_cut")


def cut_last_prompt_token(request: Any) -> None:
    """One token off the end of a request's prompt, everywhere vLLM 0.32 keeps it."""
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1


def _source(obj: Any) -> str:
    import inspect

    try:
        return inspect.getsource(obj) if obj is not None else ""
    except (OSError, TypeError):
        return ""


# -- kvpush doctor -----------------------------------------------------------------------


def probe() -> list[dict[str, Any]]:
    """Each hook against the installed vLLM, without starting an engine: whether its
    version was verified, and whether the targets that can be seen statically exist."""
    version = hook_spec.vllm_version()
    off = turned_off()  # as an engine started from this shell would read it
    rows = []
    for hook in HOOKS.values():
        problem = _static_problem(hook.name)
        applies = problem != _NOT_HERE
        ok = hook_spec.verified(hook, version) or not hook.risky
        if hook.name in off:
            problem = f"turned off by {OFF_ENV}"
        rows.append({
            "hook": hook.name, "reaches": hook.reaches, "verified": list(hook.verified),
            "vllm": version, "matched": hook_spec.matched(hook, version), "applies": applies,
            "turned_off": hook.name in off,
            "would_attach": applies and ok and not problem,
            "problem": problem or ("" if ok else f"vLLM {version} not verified"),
            "cost_when_off": hook.cost,
        })  # fmt: skip
    return rows


_NOT_HERE = "this vLLM has no such spin"


def _static_problem(name: str) -> str:
    try:
        if name == "connector_registry":
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            return "" if hasattr(KVConnectorFactory, "_registry") else "no _registry"
        if name == "park_workers":
            from vllm.distributed.device_communicators import shm_broadcast

            if not hasattr(shm_broadcast, _RECHECK):
                return f"shm_broadcast has no {_RECHECK}"
            spin = getattr(shm_broadcast, "SpinCondition", None)
            source = _source(spin)
            return "" if "last_read" in source and "busy_loop_s" in source else "no SpinCondition"
        if name == "reader_spin":
            from vllm.distributed.device_communicators import shm_broadcast

            source = _source(getattr(shm_broadcast, "SpinCondition", None))
            return "" if "self.busy_loop_s" in source else "no busy_loop_s"
        if name == "step_notify":
            from vllm.distributed.device_communicators import shm_broadcast

            source = _source(getattr(shm_broadcast, "SpinCondition", None))
            return "" if "def notify" in source and "local_notify_socket" in source else "no notify"
        if name == "window_margin":
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.kv_cache_interface import SlidingWindowSpec

            if "extra_retained_tokens" not in SlidingWindowSpec.__dataclass_fields__:
                return "SlidingWindowSpec has no extra_retained_tokens"
            source = _source(Scheduler.__init__)
            made, managed = source.find("create_connector("), source.find("KVCacheManager(")
            return "" if 0 <= made < managed else "the connector is not made before the manager"
        if name == "landings_before_schedule":
            from vllm.v1.core.sched.scheduler import Scheduler

            source = _source(Scheduler)
            wanted = ("finished_recving_kv_req_ids", "def schedule", "WAITING_FOR_REMOTE_KVS")
            missing = [w for w in wanted if w not in source]
            return f"Scheduler has no {', '.join(missing)}" if missing else ""
        if name == "prompt_cut":
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.request import Request

            if "self._all_token_ids" not in _source(Request.__init__):
                return "Request keeps no _all_token_ids"
            added = _source(Scheduler.add_request)
            return "" if "on_new_request(" in added else "add_request calls no on_new_request"
        if name == "engine_spin":
            from vllm.v1.engine import core

            return "" if hasattr(core, _ENGINE_SPIN) else _NOT_HERE
        if name == "engine_inbox":
            from vllm.v1.engine.core import EngineCoreProc

            return "" if "self.input_queue" in _source(EngineCoreProc) else "no input_queue"
    except Exception as exc:  # vLLM missing or reshaped
        return f"{type(exc).__name__}: {exc}"
    return ""
