"""`kvpush doctor`'s view of the vLLM hooks (kvpush.vllm.hooks): each one probed
against the installed vLLM without starting an engine. It reads, as
kvpush.vllm.contract reads a wheel's source; every hook that changes vLLM stays in
hooks.py."""

from __future__ import annotations

from typing import Any

from kvpush.vllm.hooks import (
    ENGINE_SPIN_ATTR,
    HOOKS,
    OFF_ENV,
    RECHECK_ATTR,
    matched,
    prompt_cut_problem,
    source_of,
    turned_off,
    verified,
    vllm_version,
)


def probe() -> list[dict[str, Any]]:
    """Each hook against the installed vLLM, without starting an engine: whether its
    version was verified, and whether the targets that can be seen statically exist."""
    version = vllm_version()
    off = turned_off()  # as an engine started from this shell would read it
    rows = []
    for hook in HOOKS.values():
        problem = _static_problem(hook.name)
        applies = problem != _NOT_HERE
        ok = verified(hook, version) or not hook.risky
        if hook.name in off:
            problem = f"turned off by {OFF_ENV}"
        rows.append({
            "hook": hook.name, "reaches": hook.reaches, "verified": list(hook.verified),
            "vllm": version, "matched": matched(hook, version), "applies": applies,
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

            if not hasattr(shm_broadcast, RECHECK_ATTR):
                return f"shm_broadcast has no {RECHECK_ATTR}"
            spin = getattr(shm_broadcast, "SpinCondition", None)
            source = source_of(spin)
            return "" if "last_read" in source and "busy_loop_s" in source else "no SpinCondition"
        if name == "reader_spin":
            from vllm.distributed.device_communicators import shm_broadcast

            source = source_of(getattr(shm_broadcast, "SpinCondition", None))
            return "" if "self.busy_loop_s" in source else "no busy_loop_s"
        if name == "step_notify":
            from vllm.distributed.device_communicators import shm_broadcast

            source = source_of(getattr(shm_broadcast, "SpinCondition", None))
            return "" if "def notify" in source and "local_notify_socket" in source else "no notify"
        if name == "window_margin":
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.kv_cache_interface import SlidingWindowSpec

            if "extra_retained_tokens" not in SlidingWindowSpec.__dataclass_fields__:
                return "SlidingWindowSpec has no extra_retained_tokens"
            source = source_of(Scheduler.__init__)
            made, managed = source.find("create_connector("), source.find("KVCacheManager(")
            return "" if 0 <= made < managed else "the connector is not made before the manager"
        if name == "landings_before_schedule":
            from vllm.v1.core.sched.scheduler import Scheduler

            source = source_of(Scheduler)
            wanted = ("finished_recving_kv_req_ids", "def schedule", "WAITING_FOR_REMOTE_KVS")
            missing = [w for w in wanted if w not in source]
            return f"Scheduler has no {', '.join(missing)}" if missing else ""
        if name == "prompt_cut":
            return prompt_cut_problem()
        if name == "engine_spin":
            from vllm.v1.engine import core

            return "" if hasattr(core, ENGINE_SPIN_ATTR) else _NOT_HERE
        if name == "engine_inbox":
            from vllm.v1.engine.core import EngineCoreProc

            return "" if "self.input_queue" in source_of(EngineCoreProc) else "no input_queue"
    except Exception as exc:  # vLLM missing or reshaped
        return f"{type(exc).__name__}: {exc}"
    return ""
