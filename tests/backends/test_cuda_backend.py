"""The CUDA backend's logic, run on CPU tensors posing as GPU memory (kvpush_cuda.testing)."""

from __future__ import annotations

import mmap
import socket
import threading

import pytest
import torch

from kvpush.backend.plugins import Backends
from kvpush.errors import BackendError, ConfigError, KVPushError
from kvpush.node import Node, NodeConfig

GPU_DIMS = ("blocks", "kv", "heads", "tokens", "dim")
NB, H, T, D = 6, 2, 4, 8
BLOCK = 2 * H * T * D * 2  # bytes of one block of K and V, float16


@pytest.fixture
def fake(fake_cuda):
    return fake_cuda(device_count=2)


@pytest.fixture
def backends():
    return Backends(["host", "cuda"])


def _layers(fake, count=2, device=1):
    return {f"layer.{i}": fake.zeros((NB, 2, H, T, D), device=device) for i in range(count)}


def test_kv_on_a_gpu_becomes_vram_regions_with_the_live_strides(fake, backends):
    tensors = _layers(fake)
    kv = backends.describe(tensors, GPU_DIMS)
    assert (kv.backend, kv.device, kv.path) == ("cuda", "cuda:1", "direct")
    regions = kv.layout.regions
    assert {(r.device_id, r.mem_type) for r in regions} == {(1, "VRAM")}
    # Each tensor's bytes registered once (neighbouring allocations may merge into one region).
    assert sum(r.length for r in regions) == len(tensors) * NB * BLOCK
    for tensor in tensors.values():
        assert any(r.contains(tensor.data_ptr(), NB * BLOCK) for r in regions)
    for tensor, runs in zip(tensors.values(), kv.layout.layers, strict=True):
        assert [(r.base, r.stride, r.block_bytes, r.part) for r in runs] == [
            (tensor.data_ptr(), BLOCK, BLOCK, "KV")
        ]
    assert kv.layout.tokens_per_block == T


def test_a_permuted_cache_is_described_as_it_lies(fake, backends):
    # Logical (2, blocks, ...) over block-major memory: what a stride-ordered cache looks like.
    base = fake.zeros((NB, 2, H, T, D), device=0)
    kv = backends.describe({"l0": base.permute(1, 0, 2, 3, 4)}, ("kv", "blocks", *GPU_DIMS[2:]))
    (run,) = kv.layout.layers[0]
    assert (run.base, run.stride, run.block_bytes, run.part) == (
        base.data_ptr(),
        BLOCK,
        BLOCK,
        "KV",
    )


def test_layers_sharing_one_allocation_register_it_once(fake, backends):
    whole = fake.zeros((3, NB, 2, H, T, D), device=1)
    kv = backends.describe({f"layer.{i}": whole[i] for i in range(3)}, GPU_DIMS)
    assert [(r.addr, r.length) for r in kv.layout.regions] == [(whole.data_ptr(), 3 * NB * BLOCK)]
    bases = [runs[0].base - whole.data_ptr() for runs in kv.layout.layers]
    assert bases == [0, NB * BLOCK, 2 * NB * BLOCK]


def test_layers_interleaved_in_one_allocation_get_the_whole_stride(fake, backends):
    # (blocks, layers, 2, ...): block i of every layer sits together; a layer is a strided view.
    whole = fake.zeros((NB, 3, 2, H, T, D), device=1)
    kv = backends.describe({f"layer.{i}": whole[:, i] for i in range(3)}, GPU_DIMS)
    assert [(r.addr, r.length) for r in kv.layout.regions] == [(whole.data_ptr(), 3 * NB * BLOCK)]
    for i, (run,) in enumerate(kv.layout.layers):
        assert (run.base - whole.data_ptr(), run.stride, run.block_bytes) == (
            i * BLOCK,
            3 * BLOCK,
            BLOCK,
        )


def test_one_tensor_given_for_two_layers_is_registered_once(fake, backends):
    shared = fake.zeros((NB, 2, H, T, D), device=0)
    kv = backends.describe({"a": shared, "b": shared}, GPU_DIMS)
    assert len(kv.layout.regions) == 1 and len(kv.layout.layers) == 2


def test_tensors_on_two_gpus_or_half_on_host_are_refused(fake, backends):
    with pytest.raises(BackendError, match=r"one GPU; got devices \[0, 1\]"):
        backends.describe({"a": fake.zeros((NB, 2), device=0), "b": fake.zeros((NB, 2), device=1)},
                          ("blocks", "kv"))  # fmt: skip
    # Whichever backend looks first refuses the mix.
    with pytest.raises(BackendError, match=r"are not (on a host device|on a CUDA device)"):
        backends.describe({"a": fake.zeros((NB, 2)), "b": torch.zeros(NB, 2)}, ("blocks", "kv"))
    # Plain host tensors are not the CUDA backend's: the host backend takes them.
    assert backends.describe({"a": torch.zeros(NB, 2)}, ("blocks", "kv")).backend == "host"


def test_an_unfenced_write_is_stale_and_each_layer_fence_covers_its_layer(fake, backends):
    tensors = _layers(fake)
    kv = backends.describe(tensors, GPU_DIMS)
    fake.write(tensors["layer.0"], 3, 1.0)
    fence0 = backends.fence(kv, "layer.0")
    fake.write(tensors["layer.1"], 3, 2.0)
    # What NIXL would read now: neither write has landed.
    assert tensors["layer.0"][3].sum().item() == 0
    backends.wait_fence(kv, fence0)
    assert (tensors["layer.0"][3] == 1.0).all()
    assert tensors["layer.1"][3].sum().item() == 0  # queued after the fence: still in flight
    backends.wait_fence(kv, backends.fence(kv, "layer.1"))
    assert (tensors["layer.1"][3] == 2.0).all()


def test_staging_mirrors_blocks_in_pinned_page_aligned_host_memory(fake, backends):
    tensors = _layers(fake)
    kv = backends.describe(tensors, GPU_DIMS, {"staging": "host"})
    assert kv.path == "staged"
    assert {r.mem_type for r in kv.layout.regions} == {"DRAM"}
    assert all(r.addr % mmap.PAGESIZE == 0 for r in kv.layout.regions)
    assert sorted(fake.pinned) == sorted(r.addr for r in kv.layout.regions)
    # Block-major on the device stays block-major on the host: pairs the same way.
    assert [r.part for runs in kv.layout.layers for r in runs] == ["KV", "KV"]
    host = kv.state.staging.host
    for i, tensor in enumerate(tensors.values()):
        fake.write(tensor, slice(None), float(i + 1))
    # A staging copy made before the fence copies what has landed: nothing yet.
    backends.stage(kv, [1, 2, 4], "to_host")
    assert host["layer.0"].abs().sum().item() == 0
    backends.wait_fence(kv, backends.fence(kv, None))
    backends.stage(kv, [1, 2, 4], "to_host")
    for i, name in enumerate(tensors):
        copied = [b for b in range(NB) if (host[name][b] == i + 1).all()]
        assert copied == [1, 2, 4]
        assert host[name][[0, 3, 5]].abs().sum().item() == 0
    # After a receive: host -> device, only the blocks received.
    host["layer.1"][5] = 7.0
    host["layer.1"][0] = 9.0
    backends.stage(kv, [5], "to_device")
    assert (tensors["layer.1"][5] == 7.0).all()
    assert (tensors["layer.1"][0] == 2.0).all()
    backends.release(kv)
    assert fake.pinned == {}


def test_staging_works_unpinned_when_the_driver_refuses(fake_cuda, backends, caplog):
    fake = fake_cuda(pin_ok=False)
    kv = backends.describe(_layers(fake, device=0), GPU_DIMS, {"staging": "host"})
    assert kv.path == "staged" and fake.pinned == {}
    assert "pinning" in caplog.text


def test_a_permuted_cache_is_staged_in_its_own_memory_order(fake, backends):
    base = fake.zeros((NB, 2, H, T, D), device=0)
    logical = base.permute(1, 0, 2, 3, 4)  # (2, blocks, ...) over block-major memory
    kv = backends.describe({"l0": logical}, ("kv", "blocks", "heads", "tokens", "dim"),
                           {"staging": "host"})  # fmt: skip
    assert [r.part for r in kv.layout.layers[0]] == ["KV"]
    fake.write(logical, (1, 2), 5.0)  # V of block 2
    backends.wait_fence(kv, backends.fence(kv, "l0"))
    backends.stage(kv, [2], "to_host")
    host = kv.state.staging.host["l0"]
    assert (host[1, 2] == 5.0).all() and host[0, 2].abs().sum().item() == 0


def test_bind_thread_sets_the_kv_device_on_the_calling_thread_only(fake, backends):
    kv = backends.describe(_layers(fake, device=1), GPU_DIMS)
    seen = []
    thread = threading.Thread(
        target=lambda: (backends.bind_thread(kv), seen.append(fake.current_device()))
    )
    thread.start()
    thread.join()
    assert seen == [1]
    assert fake.current_device() == 0  # this thread was not touched


def test_nixl_backends_default_to_ucx_and_take_libfabric_when_asked(fake, backends):
    kv = backends.describe(_layers(fake), GPU_DIMS)
    assert backends.nixl_backends(kv) == ["UCX"]
    assert backends.nixl_backends(kv, ["LIBFABRIC"]) == ["LIBFABRIC"]


def test_a_bad_staging_option_fails_before_any_allocation(backends):
    with pytest.raises(ConfigError, match="staging must be one of"):
        backends.prepare_process("cuda", 0, {"staging": "yes"})
    backends.prepare_process("cuda", 0, {"staging": "host"})
    backends.prepare_process("neuron-or-other", 0, {"staging": "yes"})  # not the CUDA backend's


@pytest.mark.nixl
def test_closing_the_node_unpins_the_staging_buffers(fake, backends):
    kv = backends.describe(_layers(fake), GPU_DIMS, {"staging": "host"})
    assert fake.pinned
    node = Node(NodeConfig("prefill", secret=b"s"), kv, backends).start()
    node.close()
    assert fake.pinned == {}


@pytest.mark.nixl
def test_a_node_that_fails_to_start_unpins_what_it_was_given(fake, backends):
    kv = backends.describe(_layers(fake), GPU_DIMS, {"staging": "host"})
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(KVPushError, match=f"cannot listen on 127.0.0.1:{port}"):
        Node(NodeConfig("prefill", role="producer", port=port, secret=b"s"), kv, backends).start()
    taken.close()
    assert fake.pinned == {}
