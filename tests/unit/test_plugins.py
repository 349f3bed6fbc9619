"""The backend plugin manager: entry points, restriction, routing, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvpush.backend.plugins import Backends
from kvpush.errors import BackendError, BackendNotImplemented, ConfigError

PLUGIN_DIR = Path(__file__).parents[1] / "plugins"


def _install(where: Path, dist: str, version: str, entry_point: str, module: str) -> None:
    """A distribution as pip leaves it: a dist-info with one `kvpush.backends` entry point."""
    info = where / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvpush.backends]\n{entry_point} = {module}\n")


@pytest.fixture
def example_installed(tmp_path, monkeypatch):
    """kvpush-example-backend installed the way pip installs it, on sys.path."""
    _install(tmp_path, "kvpush-example-backend", "0.1", "example", "kvpush_example_backend")
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("kvpush_example_backend", None)


def test_builtins_load_through_the_entry_point_group():
    backends = Backends()
    assert {"host", "cuda", "neuron"} <= set(backends.names)
    for name in ("host", "cuda", "neuron"):
        assert backends.get(name).source == "built-in"
    probes = backends.probes()
    assert probes["host"].present is True


def test_third_party_backend_is_found_and_used_for_its_device(example_installed):
    from kvpush_example_backend import ExampleTensor

    backends = Backends()
    loaded = backends.get("example")
    assert loaded.source == "kvpush-example-backend 0.1"
    tensors = {f"layer.{i}": ExampleTensor((8, 2, 64)) for i in range(2)}
    kv = backends.describe(tensors, ("blocks", "kv", "bytes"))
    assert kv.backend == "example"
    assert kv.layout.num_blocks == 8
    assert len(kv.layout.layers) == 2
    assert backends.nixl_backends(kv) == ["UCX"]
    # The fence is routed to the example backend: queued device writes land.
    tensors["layer.0"].write((3, 0), 9)
    assert tensors["layer.0"].memory[3, 0].max() == 0
    backends.wait_fence(kv, backends.fence(kv, "layer.0"))
    assert (tensors["layer.0"].memory[3, 0] == 9).all()


def test_host_backend_still_claims_host_arrays_beside_a_third_party(example_installed):
    kv = Backends().describe({"l0": np.zeros((4, 2, 16), dtype=np.float32)}, ("blocks", "kv", "x"))
    assert kv.backend == "host"
    assert kv.layout.layers[0][0].part == "KV"


def test_environment_restricts_which_backends_load(example_installed, monkeypatch):
    monkeypatch.setenv("KVPUSH_BACKENDS", "host, example")
    assert sorted(Backends().names) == ["example", "host"]


def test_unknown_backend_name_is_a_config_error(monkeypatch):
    monkeypatch.setenv("KVPUSH_BACKENDS", "host,tpu")
    with pytest.raises(ConfigError, match=r"unknown backend\(s\) \['tpu'\]"):
        Backends()


def test_no_backend_for_a_device_names_the_device():
    class Weird:
        device = "quantum:3"

    with pytest.raises(BackendError, match="device 'quantum:3'"):
        Backends(["host"]).describe({"l0": Weird()}, ("blocks",))


def test_a_backend_that_fails_to_import_is_named(tmp_path, monkeypatch):
    _install(tmp_path, "broken-backend", "1.0", "broken", "no_such_module_here")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendError, match=r"'broken' .*broken-backend 1\.0.*failed to load"):
        Backends()
    assert "broken" not in Backends(["host"]).names


def test_routed_hook_missing_in_backend_is_not_silently_skipped(example_installed):
    from kvpush_example_backend import ExampleTensor

    backends = Backends()
    kv = backends.describe({"l0": ExampleTensor((4, 2, 8))}, ("blocks", "kv", "bytes"))
    kv.path = "staged"  # a staged path needs kvpush_stage_blocks, which the example lacks
    with pytest.raises(BackendNotImplemented, match="kvpush_stage_blocks"):
        backends.stage(kv, [0], "to_host")


# A third-party backend for ROCm-like tensors: they report device type "cuda", as ROCm
# tensors do, but are host arrays underneath. Its name sorts before "cuda" on purpose.
AMD_BACKEND = """
from kvpush.backend import BackendInfo, DeviceKV, hookimpl, layout_from_views
from kvpush.backend.host import host_view

@hookimpl
def kvpush_backend_info():
    return BackendInfo("amd", ("cuda",), ("DRAM",), ("direct",))

@hookimpl
def kvpush_describe_kv(tensors, dims, config):
    if not all(t.device.type == "cuda" for t in tensors.values()):
        return None
    views = {name: host_view(t.memory) for name, t in tensors.items()}
    return DeviceKV("amd", "cuda:0", layout_from_views(views, dims), state=tensors)
"""


def test_a_third_party_backend_is_asked_before_a_built_in_claiming_the_same_device(
    tmp_path, monkeypatch
):
    (tmp_path / "kvpush_amd_backend.py").write_text(AMD_BACKEND)
    _install(tmp_path, "kvpush-amd-backend", "0.1", "amd", "kvpush_amd_backend")
    monkeypatch.syspath_prepend(str(tmp_path))

    class RocmTensor:
        device = type("Device", (), {"type": "cuda", "index": 0})()
        memory = np.zeros((4, 2, 8), dtype=np.uint8)

    try:
        backends = Backends()
        assert backends.names == ["amd", "cuda", "host", "neuron"]
        # The built-in CUDA backend would claim these too, and fail on them.
        kv = backends.describe({"l0": RocmTensor()}, ("blocks", "kv", "bytes"))
        assert kv.backend == "amd"
    finally:
        sys.modules.pop("kvpush_amd_backend", None)
