"""The backend plugin manager.

Every backend, built-in or not, is found through the entry-point group
`kvpush.backends`; KVPUSH_BACKENDS="host,cuda" restricts which load. Set-up hooks reach
every backend, kvpush_describe_kv the first that claims the tensors, and every hook
taking a DeviceKV only the backend that returned it (kvpush.backend.hookspecs says
who is asked first, and on which thread each hook runs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from kvpush.backend import BackendInfo, DeviceKV, Probe, hookspecs
from kvpush.errors import BackendError, BackendNotImplemented, ConfigError, did_you_mean

ENTRY_POINT_GROUP = "kvpush.backends"
ENV_BACKENDS = "KVPUSH_BACKENDS"
STAGE_DIRECTIONS = ("to_host", "to_device")
log = logging.getLogger(__name__)
# Backends already warned about taking device_options unchecked: once a process.
_unchecked_warned: set[str] = set()


@dataclass(frozen=True)
class LoadedBackend:
    """A backend as loaded: where it came from and what it says it serves."""

    name: str
    source: str
    module: str
    info: BackendInfo


def _source_of(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    if dist is None:
        return "unknown distribution"
    if dist.name == "kvpush":
        return "built-in"
    return f"{dist.name} {dist.version}"


def _requested_names(only: Iterable[str] | None) -> set[str] | None:
    if only is not None:
        return set(only)
    raw = os.environ.get(ENV_BACKENDS, "").strip()
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class Backends:
    """The loaded device backends and the core's way of calling them."""

    def __init__(self, only: Iterable[str] | None = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._loaded: dict[str, LoadedBackend] = {}
        self._routed: dict[tuple[str, str], Any] = {}
        wanted = _requested_names(only)
        found = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if wanted is not None and (unknown := wanted - found.keys()):
            raise ConfigError(
                f"unknown backend(s) {sorted(unknown)} in {ENV_BACKENDS}; "
                f"installed backends: {sorted(found) or 'none'}"
            )
        if not found:
            raise BackendError(
                f"no backends in entry-point group {ENTRY_POINT_GROUP!r}: is kvpush installed "
                "(pip install kvpush, or pip install -e . from a checkout)?"
            )
        chosen = [ep for name, ep in sorted(found.items()) if wanted is None or name in wanted]
        builtin = [ep for ep in chosen if _source_of(ep) == "built-in"]
        third_party = [ep for ep in chosen if _source_of(ep) != "built-in"]
        # pluggy asks the plugin registered last first. Registering in reverse asks third
        # parties before the built-ins, each group by name (see kvpush.backend.hookspecs).
        for entry_point in reversed(third_party + builtin):
            self._load(entry_point.name, entry_point)

    def _load(self, name: str, entry_point: metadata.EntryPoint) -> None:
        source = _source_of(entry_point)
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise BackendError(
                f"backend {name!r} ({source}, {entry_point.value}) failed to load: {exc!r}; "
                f"leave it out with {ENV_BACKENDS}"
            ) from exc
        self._register(plugin, name, source, entry_point.value)

    def _register(self, plugin: Any, name: str, source: str, module: str) -> None:
        self._pm.register(plugin, name=name)
        self._routed.clear()
        impl = self._impl(name, "kvpush_backend_info")
        if impl is None:
            raise BackendError(
                f"backend {name!r} ({source}) does not implement kvpush_backend_info"
            )
        info = impl.function()
        if info.name != name:
            raise BackendError(
                f"backend registered as {name!r} ({source}) calls itself {info.name!r}"
            )
        self._loaded[name] = LoadedBackend(name, source, module, info)

    def add(self, plugin: Any, name: str) -> None:
        """Register a backend object directly, without an entry point (embedding, tests)."""
        if name in self._loaded:
            raise BackendError(f"a backend named {name!r} is already loaded")
        self._register(plugin, name, "registered at runtime", repr(plugin))

    # -- what is loaded --------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [backend.name for backend in self.loaded()]

    def loaded(self) -> list[LoadedBackend]:
        """Loaded backends in the order kvpush_describe_kv asks them (any without it last)."""
        impls = self._pm.hook.kvpush_describe_kv.get_hookimpls()
        asked = [impl.plugin_name for impl in reversed(impls)]
        rest = [name for name in self._loaded if name not in asked]
        return [self._loaded[name] for name in asked + rest]

    def get(self, name: str) -> LoadedBackend:
        try:
            return self._loaded[name]
        except KeyError:
            raise BackendError(f"no backend named {name!r}; loaded: {self.names}") from None

    def probes(self) -> dict[str, Probe]:
        return {probe.name: probe for probe in self._pm.hook.kvpush_probe()}

    # -- process set-up, for every backend serving the device type ------------------

    def prepare_process(self, device_type: str, local_rank: int, config: Mapping[str, Any]) -> None:
        self.check_device_options(config, device_type)
        self._pm.hook.kvpush_prepare_process(
            device_type=device_type, local_rank=local_rank, config=config
        )

    def init_runtime(self, device_type: str) -> None:
        self._pm.hook.kvpush_init_runtime(device_type=device_type)

    def check_device_options(
        self, options: Mapping[str, Any], device_type: str | None = None
    ) -> None:
        """Refuse a device_options key that no backend serving `device_type` (None: any
        loaded backend) declares. A backend that declares none takes every key
        unchecked, with a warning once."""
        serving = [
            b for b in self.loaded() if device_type is None or device_type in b.info.device_types
        ]
        if not options or not serving:
            return  # no backend of this device: describe_kv says so, naming the device
        undeclared = [b.name for b in serving if b.info.device_options is None]
        if undeclared:
            _warn_unchecked(undeclared, options)
            return
        known = sorted({key for b in serving for key in b.info.device_options or ()})
        unknown = sorted(set(options) - set(known))
        if unknown:
            named = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
            names = ", ".join(b.name for b in serving)
            raise ConfigError(
                f"unknown device_options key(s) {named} for backend(s) {names}; known: {known}"
            )

    # -- KV description: the first backend asked that recognises the tensors --------

    def describe(
        self,
        tensors: Mapping[str, Any],
        dims: Sequence[str],
        config: Mapping[str, Any] | None = None,
    ) -> DeviceKV:
        if not tensors:
            raise BackendError("no KV tensors were given to describe")
        kv = self._pm.hook.kvpush_describe_kv(
            tensors=tensors, dims=tuple(dims), config=config or {}
        )
        if kv is None:
            first = next(iter(tensors.values()))
            raise BackendError(
                f"no loaded backend handles KV tensors on device {_device_of(first)!r} "
                f"({type(first).__module__}.{type(first).__qualname__}); loaded backends: "
                f"{', '.join(f'{b.name} ({b.info.device_types})' for b in self.loaded())}"
            )
        if kv.backend not in self._loaded:
            raise BackendError(f"a backend described KV as {kv.backend!r}, which is not loaded")
        return kv

    # -- calls routed to the backend that owns a DeviceKV ----------------------------

    def nixl_backends(self, kv: DeviceKV, requested: Sequence[str] = ()) -> list[str]:
        return list(self._call(kv, "kvpush_nixl_backends", requested=tuple(requested)))

    def bind_thread(self, kv: DeviceKV) -> None:
        self._call(kv, "kvpush_bind_thread")

    def fence(self, kv: DeviceKV, layer: str | None = None) -> Any:
        return self._call(kv, "kvpush_fence", layer=layer)

    def wait_fence(self, kv: DeviceKV, fence: Any) -> None:
        if fence is not None:
            self._call(kv, "kvpush_wait_fence", fence=fence)

    def stage(self, kv: DeviceKV, block_ids: Sequence[int], direction: str) -> None:
        if direction not in STAGE_DIRECTIONS:
            raise ValueError(f"direction must be one of {STAGE_DIRECTIONS}, got {direction!r}")
        if kv.path == "staged":
            self._call(kv, "kvpush_stage_blocks", block_ids=block_ids, direction=direction)

    def release(self, kv: DeviceKV) -> None:
        if self._impl(kv.backend, "kvpush_release") is not None:
            self._call(kv, "kvpush_release")

    def _impl(self, backend: str, hook: str) -> Any:
        for impl in getattr(self._pm.hook, hook).get_hookimpls():
            if impl.plugin_name == backend:
                return impl
        return None

    def _call(self, kv: DeviceKV, hook: str, **kwargs: Any) -> Any:
        caller = self._routed.get((kv.backend, hook))
        if caller is None:
            if self._impl(kv.backend, hook) is None:
                raise BackendNotImplemented(
                    f"{hook} is not implemented for backend {kv.backend!r} (device {kv.device})"
                )
            others = [p for n, p in self._pm.list_name_plugin() if n != kv.backend]
            caller = self._pm.subset_hook_caller(hook, remove_plugins=others)
            self._routed[(kv.backend, hook)] = caller
        # One plugin answers; pluggy leaves a None answer out of the list.
        answers = caller(kv=kv, **kwargs)
        return answers[0] if answers else None


def _warn_unchecked(names: list[str], options: Mapping[str, Any]) -> None:
    fresh = [name for name in names if name not in _unchecked_warned]
    if fresh:
        _unchecked_warned.update(fresh)
        log.warning(
            "kvpush: backend(s) %s declare no device_options keys (BackendInfo.device_options): "
            "%s reach them unchecked, so a misspelt key is not caught",
            ", ".join(fresh),
            sorted(options),
        )


def _device_of(tensor: Any) -> str:
    device = getattr(tensor, "device", None)
    return str(device) if device is not None else "unknown"


_default: dict[frozenset[str] | None, Backends] = {}


def get_backends(only: Iterable[str] | None = None) -> Backends:
    """The process-wide Backends for this selection (KVPUSH_BACKENDS when `only` is None)."""
    wanted = _requested_names(only)
    key = frozenset(wanted) if wanted is not None else None
    if key not in _default:
        _default[key] = Backends(wanted)
    return _default[key]
