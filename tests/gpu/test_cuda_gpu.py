"""The CUDA backend on a real GPU: regions, events as fences, staging, thread binding, and
two processes on one GPU moving KV by the core's descriptor tables (CUDA IPC, or host
memory), without NIXL. Skipped, with the reason, where there is no usable GPU."""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest

torch = pytest.importorskip("torch")

import gpu_peer  # noqa: E402 (needs torch)
from gpu_peer import BLOCK_MAJOR, BLOCKS, DIM, DST, HEADS, LAYERS, SRC, TOKENS  # noqa: E402


@pytest.fixture
def backends():
    from kvpush.backend.plugins import Backends
    from kvpush_cuda import runtime

    runtime.set_runtime(None)  # the real torch.cuda, whatever another test installed
    return Backends(["host", "cuda"])


def _cache(dims, device=0):
    shape = (
        (BLOCKS, 2, HEADS, TOKENS, DIM) if dims == BLOCK_MAJOR else (2, BLOCKS, HEADS, TOKENS, DIM)
    )
    return {
        f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16, device=f"cuda:{device}")
        for i in range(LAYERS)
    }


def _same(a, b) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def test_regions_are_the_live_gpu_memory(backends):
    device = torch.cuda.device_count() - 1
    tensors = _cache(BLOCK_MAJOR, device)
    kv = backends.describe(tensors, BLOCK_MAJOR)
    assert (kv.device, kv.path) == (f"cuda:{device}", "direct")
    # Each tensor's bytes registered once (neighbouring allocations may merge into one region).
    regions = kv.layout.regions
    assert {(r.device_id, r.mem_type) for r in regions} == {(device, "VRAM")}
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    assert sum(r.length for r in regions) == sum(sizes)
    for tensor, size in zip(tensors.values(), sizes, strict=True):
        assert any(r.contains(tensor.data_ptr(), size) for r in regions)
    block = 2 * HEADS * TOKENS * DIM * 2
    assert [(r.stride, r.block_bytes, r.part) for r in kv.layout.layers[0]] == [
        (block, block, "KV")
    ]


def test_the_fence_is_an_event_after_the_writes(backends):
    tensors = _cache(BLOCK_MAJOR)
    kv = backends.describe(tensors, BLOCK_MAJOR)
    torch.cuda._sleep(gpu_peer.SLEEP_CYCLES * 4)  # the write below is queued behind this
    tensors["layer.0"][3].fill_(7.0)
    fence = backends.fence(kv, "layer.0")
    assert not fence.query(), "the kernel has not run yet: a WRITE now would send stale bytes"
    backends.wait_fence(kv, fence)
    assert fence.query()
    assert (tensors["layer.0"][3].cpu() == 7.0).all()


def test_staging_uses_pinned_page_aligned_buffers_and_moves_only_given_blocks(backends):
    tensors = _cache(BLOCK_MAJOR)
    kv = backends.describe(tensors, BLOCK_MAJOR, {"staging": "host"})
    host = kv.state.staging.host
    assert kv.path == "staged" and all(h.is_pinned() for h in host.values())
    assert all(r.addr % mmap.PAGESIZE == 0 and r.mem_type == "DRAM" for r in kv.layout.regions)
    for i, tensor in enumerate(tensors.values()):
        tensor.fill_(float(i + 1))
    backends.wait_fence(kv, backends.fence(kv, None))
    backends.stage(kv, [2, 3, 6], "to_host")
    for i, name in enumerate(tensors):
        assert [b for b in range(BLOCKS) if (host[name][b] == i + 1).all()] == [2, 3, 6]
    host["layer.0"][5] = 9.0
    backends.stage(kv, [5], "to_device")
    torch.cuda.synchronize()
    assert (tensors["layer.0"][5].cpu() == 9.0).all() and (tensors["layer.0"][4].cpu() == 1.0).all()
    backends.release(kv)
    assert not host


def test_bind_thread_sets_the_current_device_of_the_nixl_thread(backends):
    device = torch.cuda.device_count() - 1
    kv = backends.describe(_cache(BLOCK_MAJOR, device), BLOCK_MAJOR)
    seen = []
    thread = threading.Thread(
        target=lambda: (backends.bind_thread(kv), seen.append(torch.cuda.current_device()))
    )
    thread.start()
    thread.join()
    assert seen == [device]


def _flat(tensor):
    """The bytes of a whole, freshly allocated tensor (its data_ptr is where they start)."""
    return tensor.reshape(-1).view(torch.uint8)


def _window(spans, addr: int, nbytes: int):
    for base, flat in spans:
        if base <= addr and addr + nbytes <= base + flat.numel():
            return flat[addr - base : addr - base + nbytes]
    raise AssertionError(f"no registered memory holds [{addr:#x}, +{nbytes})")


@pytest.mark.parametrize("staged", [False, True], ids=["cuda-ipc", "host-staged"])
def test_two_processes_on_one_gpu_move_kv_across_layouts(backends, staged):
    import msgspec

    from kvpush.layout import BlockTable, KVLayout, pairing_split

    context = torch.multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=gpu_peer.producer, args=(queue, done, staged, 7))
    child.start()
    try:
        message = queue.get(timeout=300)
        remote = msgspec.msgpack.decode(message["layout"], type=KVLayout)
        mine = _cache(BLOCK_MAJOR)
        kv = backends.describe(mine, BLOCK_MAJOR, {"staging": "host"} if staged else {})
        split = pairing_split(kv.layout, remote)
        assert split is True  # K/V-major against block-major
        src_table, dst_table = BlockTable(remote, split), BlockTable(kv.layout, split)
        pairs = zip(src_table.ids(SRC), dst_table.ids(DST), strict=True)
        if staged:
            buffers = [(addr, ctypes.create_string_buffer(data, len(data)))
                       for addr, data in message["regions"]]  # fmt: skip
            for s, d in pairs:
                src, nbytes, _ = (int(v) for v in src_table.rows[s])
                base, buffer = next((a, b) for a, b in buffers if a <= src < a + len(b))
                ctypes.memmove(int(dst_table.rows[d][0]), ctypes.addressof(buffer) + src - base,
                               nbytes)  # fmt: skip
            backends.stage(kv, DST, "to_device")
        else:
            received = message["tensors"]
            theirs = [(message["bases"][n], _flat(t)) for n, t in received.items()]
            ours = [(t.data_ptr(), _flat(t)) for t in mine.values()]
            for s, d in pairs:
                src, nbytes, _ = (int(v) for v in src_table.rows[s])
                dst = int(dst_table.rows[d][0])
                _window(ours, dst, nbytes).copy_(_window(theirs, src, nbytes))
        torch.cuda.synchronize()
    finally:
        done.set()
        child.join(60)
    for layer, tensor in enumerate(mine.values()):
        for s, d in zip(SRC, DST, strict=True):
            for part in (0, 1):
                assert _same(tensor[d, part], gpu_peer.pattern(7, layer, s, part)), (layer, d, part)
        untouched = [b for b in range(BLOCKS) if b not in DST]
        assert tensor[untouched].abs().sum().item() == 0
    assert child.exitcode == 0
