"""The Neuron backend against the fake Neuron device: paths, traps and the layout it reports."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from kvpush.backend.plugins import Backends
from kvpush.errors import BackendError, ConfigError, RegionError
from kvpush.layout import BlockTable, pairing_split
from kvpush.regions import MemRegion
from kvpush_neuron.backend import NEURON_KV_DIMS

NB, H, T, D = 6, 2, 4, 8
PART = H * T * D * 2  # bytes of K (or V) of one block, bfloat16
GPU_DIMS = ("blocks", "kv", "heads", "tokens", "dim")


@pytest.fixture
def backends():
    return Backends(["host", "neuron"])


def _layers(fake, count=2):
    return {f"layer.{i}": fake.zeros((2, NB, H, T, D)) for i in range(count)}


def _direct(fake_neuron, backends, **options):
    """The right order: environment, runtime, allocation, description."""
    fake = fake_neuron(**options)
    backends.prepare_process("neuron", 0, {})
    backends.init_runtime("neuron")
    tensors = _layers(fake)
    return fake, tensors, backends.describe(tensors, NEURON_KV_DIMS)


# -- the process environment -----------------------------------------------------------


def test_prepare_process_gives_each_rank_its_core_and_maps_hbm(fake_neuron, backends):
    fake_neuron()
    backends.prepare_process("neuron", 3, {})
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "3"
    assert os.environ["NEURON_RT_MAP_HBM"] == "1"


def test_a_launcher_range_is_split_by_local_rank(fake_neuron, backends, monkeypatch):
    fake_neuron()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    backends.prepare_process("neuron", 2, {})
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "6"
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")
    with pytest.raises(ConfigError, match="local rank 2 has none of its own"):
        backends.prepare_process("neuron", 2, {})


def test_staging_on_purpose_does_not_map_hbm(fake_neuron, backends):
    fake_neuron()
    backends.prepare_process("neuron", 0, {"staging": "host"})
    assert "NEURON_RT_MAP_HBM" not in os.environ


def test_prepare_process_after_an_allocation_refuses_and_says_why(fake_neuron, backends):
    fake = fake_neuron()
    fake.zeros((4,))
    with pytest.raises(BackendError) as caught:
        backends.prepare_process("neuron", 0, {})
    message = str(caught.value)
    assert "too late" in message and "already allocated" in message
    assert "NEURON_RT_MAP_HBM=1: data_ptr() stays 0" in message
    assert "NEURON_RT_MAP_HBM" not in os.environ  # nothing half-set


def test_prepare_process_late_is_fine_when_the_launch_environment_was_right(
    fake_neuron, backends, monkeypatch
):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "true")
    fake = fake_neuron()
    fake.zeros((4,))
    backends.prepare_process("neuron", 0, {})  # too late to change anything: must not try
    # "true" maps HBM as "1" does: left as the launcher wrote it, not rewritten.
    assert os.environ["NEURON_RT_MAP_HBM"] == "true"
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0"
    assert backends.describe(_layers(fake), NEURON_KV_DIMS).path == "direct"


def test_one_visible_core_per_process(fake_neuron, backends, monkeypatch, tmp_path):
    # Without NEURON_RT_VISIBLE_CORES the first runtime claims every core of the host...
    greedy = fake_neuron(lock_dir=tmp_path)
    greedy.start()
    with pytest.raises(RuntimeError, match=r"NeuronCore 0 is in use.*NEURON_RT_VISIBLE_CORES"):
        fake_neuron(lock_dir=tmp_path).start()
    greedy.close()
    # ... with prepare_process each rank takes its own.
    for rank in (0, 1):
        monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)  # a process per rank
        fake = fake_neuron(lock_dir=tmp_path)
        backends.prepare_process("neuron", rank, {})
        fake.start()
        assert fake.visible == [rank]
        fake.zeros((4,), device=0)
        with pytest.raises(RuntimeError, match="neuron:1 is not visible"):
            fake.zeros((4,), device=1)


# -- the direct path and its traps -----------------------------------------------------


def test_mapped_hbm_is_registered_directly_as_vram_in_neuron_layout(fake_neuron, backends):
    fake, tensors, kv = _direct(fake_neuron, backends)
    assert (kv.backend, kv.device, kv.path, kv.layout.mem_type) == (
        "neuron", "neuron:0", "direct", "VRAM",
    )  # fmt: skip
    for tensor, runs in zip(tensors.values(), kv.layout.layers, strict=True):
        base = tensor.data_ptr()
        assert base != 0
        assert [(r.base, r.stride, r.block_bytes, r.part) for r in runs] == [
            (base, PART, PART, "K"),
            (base + NB * PART, PART, PART, "V"),
        ]
    assert kv.layout.inner == f"heads:{H},tokens:{T},dim:{D}"
    # Every region is an allocation the runtime knows: NIXL finds its placement.
    for region in kv.layout.regions:
        assert fake.nixl_register("LIBFABRIC", "VRAM", region.addr, region.length) == (
            "FI_HMEM_NEURON"
        )


def test_generic_dims_that_do_not_fit_are_read_as_neuron_layout(fake_neuron, backends):
    _, tensors, _ = _direct(fake_neuron, backends)
    kv = backends.describe(tensors, ("blocks", "heads", "tokens", "kvdim"))
    assert [r.part for r in kv.layout.layers[0]] == ["K", "V"]


def test_kv_half_in_hbm_and_half_on_the_host_is_refused_by_name(fake_neuron, backends):
    _, tensors, _ = _direct(fake_neuron, backends)
    tensors["layer.host"] = torch.zeros(2, NB, H, T, D)
    # Whichever backend looks first refuses the mix, naming what does not fit.
    with pytest.raises(
        BackendError, match=r"\['layer\.(0|1|host)'.*are not (on a host device|on a Neuron device)"
    ):
        backends.describe(tensors, NEURON_KV_DIMS)


def test_without_hbm_mapping_data_ptr_is_zero_and_kv_is_staged(fake_neuron, backends, caplog):
    fake = fake_neuron()
    backends.prepare_process("neuron", 0, {"staging": "host"})  # so no mapping
    tensors = _layers(fake)
    assert tensors["layer.0"].data_ptr() == 0
    with pytest.raises(BackendError, match=r"data_ptr\(\) is 0: NEURON_RT_MAP_HBM=1 was not set"):
        backends.describe(tensors, NEURON_KV_DIMS, {"staging": "off"})
    kv = backends.describe(tensors, NEURON_KV_DIMS)  # "auto"
    assert (kv.path, kv.layout.mem_type) == ("staged", "DRAM")
    assert "NEURON_RT_MAP_HBM=1 was not set" in caplog.text
    # And NIXL would refuse the zero address anyway, obscurely; the core refuses it clearly.
    with pytest.raises(RuntimeError, match=r"placement for VA: \(nil\)"):
        fake.nixl_register("LIBFABRIC", "VRAM", 0, 64)
    with pytest.raises(RegionError, match="address is 0"):
        MemRegion(0, 64, 0, "VRAM")


def test_the_mapping_is_read_at_the_first_allocation_only(fake_neuron, backends, monkeypatch):
    fake = fake_neuron()
    first = fake.zeros((4,))
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")  # too late for this process
    assert fake.zeros((4,)).data_ptr() == 0 and first.data_ptr() == 0


def test_legacy_xla_tensors_have_no_pointer_and_are_staged(fake_neuron, backends, caplog):
    fake = fake_neuron(legacy=True)
    backends.prepare_process("xla", 0, {})
    tensors = _layers(fake)
    with pytest.raises(RuntimeError, match="no storage"):
        tensors["layer.0"].data_ptr()
    with pytest.raises(BackendError, match="XLA stack's tensors have no device address"):
        backends.describe(tensors, NEURON_KV_DIMS, {"staging": "off"})
    kv = backends.describe(tensors, NEURON_KV_DIMS)
    assert (kv.device, kv.path) == ("xla:0", "staged")


def test_an_agent_before_the_runtime_is_refused_not_degraded(fake_neuron, backends):
    fake = fake_neuron(start_on_alloc=False)
    backends.prepare_process("neuron", 0, {})
    tensors = _layers(fake)
    kv = backends.describe(tensors, NEURON_KV_DIMS)
    region = kv.layout.regions[0]
    # What NIXL would do now: file HBM as system memory, and say nothing.
    assert fake.nixl_register("LIBFABRIC", "VRAM", region.addr, region.length) == "FI_HMEM_SYSTEM"
    with pytest.raises(BackendError, match=r"runtime is not started.*without any error"):
        backends.nixl_backends(kv, ["LIBFABRIC"])
    backends.init_runtime("neuron")
    assert backends.nixl_backends(kv, ["LIBFABRIC"]) == ["LIBFABRIC"]
    assert fake.nixl_register("LIBFABRIC", "VRAM", region.addr, region.length) == "FI_HMEM_NEURON"


def test_ucx_is_refused_for_neuron_hbm_and_libfabric_chosen(fake_neuron, backends):
    fake, _, kv = _direct(fake_neuron, backends)
    assert backends.nixl_backends(kv) == ["LIBFABRIC"]
    with pytest.raises(BackendError, match=r"UCX does not know Neuron memory.*LIBFABRIC"):
        backends.nixl_backends(kv, ["UCX"])
    assert backends.nixl_backends(kv, ["UCX", "LIBFABRIC"]) == ["LIBFABRIC"]
    # Whatever it picks, NIXL files the HBM as HBM.
    region = kv.layout.regions[0]
    for asked in ([], ["LIBFABRIC"], ["UCX", "LIBFABRIC"], ["LIBFABRIC", "UCX"]):
        for name in backends.nixl_backends(kv, asked):
            assert fake.nixl_register(name, "VRAM", region.addr, region.length) == "FI_HMEM_NEURON"
    with pytest.raises(RuntimeError, match="UCX"):
        fake.nixl_register("UCX", "VRAM", region.addr, region.length)


def test_staged_kv_takes_any_nixl_backend_for_its_host_buffers(fake_neuron, backends):
    fake = fake_neuron()
    kv = backends.describe(_layers(fake), NEURON_KV_DIMS, {"staging": "host"})
    assert backends.nixl_backends(kv) == ["UCX"]
    assert backends.nixl_backends(kv, ["LIBFABRIC"]) == ["LIBFABRIC"]


# -- fences ----------------------------------------------------------------------------------


def test_device_writes_land_only_at_the_fence_and_one_sync_serves_many(fake_neuron, backends):
    fake, tensors, kv = _direct(fake_neuron, backends)
    fake.write(tensors["layer.0"], (0, 2), 3.0)
    fence0 = backends.fence(kv, "layer.0")
    fake.write(tensors["layer.1"], (1, 2), 4.0)
    fence1 = backends.fence(kv, "layer.1")
    assert fake.read(tensors["layer.0"]).abs().sum().item() == 0  # what NIXL would read now
    backends.wait_fence(kv, fence1)
    assert (fake.read(tensors["layer.0"])[0, 2] == 3.0).all()
    assert (fake.read(tensors["layer.1"])[1, 2] == 4.0).all()
    syncs = fake.syncs
    backends.wait_fence(kv, fence0)  # already covered by the sync for fence1
    assert fake.syncs == syncs


# -- staging ---------------------------------------------------------------------------------


def test_staged_copies_move_only_the_given_blocks_and_never_pin(fake_neuron, backends, monkeypatch):
    def no_pinning(*args, **kwargs):
        raise RuntimeError("pin_memory crashes the Neuron runtime")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    fake = fake_neuron(legacy=True)
    tensors = _layers(fake)
    kv = backends.describe(tensors, NEURON_KV_DIMS)
    assert all(r.addr % mmap.PAGESIZE == 0 for r in kv.layout.regions)
    assert [r.part for r in kv.layout.layers[0]] == ["K", "V"]
    for i, tensor in enumerate(tensors.values()):
        fake.write(tensor, (slice(None), slice(None)), float(i + 1))
    backends.stage(kv, [4, 1], "to_host")
    host = kv.state.staging.host
    for i, name in enumerate(tensors):
        assert [b for b in range(NB) if (host[name][:, b] == i + 1).all()] == [1, 4]
        assert host[name][:, [0, 2, 3, 5]].abs().sum().item() == 0
    host["layer.0"][:, 3] = 8.0
    backends.stage(kv, [3], "to_device")
    landed = fake.read(tensors["layer.0"])
    assert (landed[:, 3] == 8.0).all() and (landed[:, 2] == 1.0).all()
    backends.release(kv)


# -- the layout mapping, byte for byte ---------------------------------------------------------


def _copy_rows(src_table, src_ids, dst_table, dst_ids):
    """What a NIXL WRITE does with two descriptor lists, done with memmove."""
    for s, d in zip(src_ids, dst_ids, strict=True):
        (src_addr, nbytes, _), (dst_addr, dst_bytes, _) = src_table.rows[s], dst_table.rows[d]
        assert nbytes == dst_bytes
        ctypes.memmove(int(dst_addr), int(src_addr), int(nbytes))


def test_neuron_layout_maps_onto_gpu_layout_and_back_byte_for_byte(fake_neuron, backends):
    fake, tensors, kv = _direct(fake_neuron, backends)
    gpu = {name: torch.zeros((NB, 2, H, T, D), dtype=torch.bfloat16) for name in tensors}
    gpu_kv = backends.describe(gpu, GPU_DIMS)
    assert pairing_split(kv.layout, gpu_kv.layout) is True
    generator = torch.Generator().manual_seed(3)
    for tensor in tensors.values():
        fake.write(tensor, slice(None), torch.randn((2, NB, H, T, D), generator=generator))
    backends.wait_fence(kv, backends.fence(kv, None))
    src, dst = [0, 1, 4], [5, 3, 2]
    neuron_table, gpu_table = BlockTable(kv.layout, True), BlockTable(gpu_kv.layout, True)
    _copy_rows(neuron_table, neuron_table.ids(src), gpu_table, gpu_table.ids(dst))
    for name, tensor in tensors.items():
        hbm = fake.read(tensor)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(gpu[name][d, 0], hbm[0, s])  # K
            assert torch.equal(gpu[name][d, 1], hbm[1, s])  # V
        untouched = [b for b in range(NB) if b not in dst]
        assert gpu[name][untouched].abs().sum().item() == 0
    # And back: GPU block 5 (Neuron block 0's bytes) into Neuron block 3, nothing else.
    before = {name: fake.read(tensor) for name, tensor in tensors.items()}
    _copy_rows(gpu_table, gpu_table.ids([5]), neuron_table, neuron_table.ids([3]))
    for name, tensor in tensors.items():
        hbm, old = fake.read(tensor), before[name]
        assert torch.equal(hbm[:, 3], old[:, 0])
        others = [b for b in range(NB) if b != 3]
        assert torch.equal(hbm[:, others], old[:, others])
