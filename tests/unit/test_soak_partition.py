"""The soak's `partition` fault: which instance it cuts, how, and that it heals."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from kvpush.bench import faults
from kvpush.bench.faults import Fault, Injector


def _cluster(launcher: list[str]) -> SimpleNamespace:
    server = SimpleNamespace(spec=SimpleNamespace(launcher=launcher))
    return SimpleNamespace(servers={"prefill0": server})


def test_a_partition_is_a_kind_and_cuts_a_prefill_instance():
    assert faults.parse_kinds("partition,kill-decode") == ("partition", "kill-decode")
    pick = faults.schedule(("partition", "stop-decode"), ["p0", "p1"], ["d0"], 0)
    assert [pick(i) for i in range(4)] == [
        ("partition", "p0"), ("stop-decode", "d0"), ("partition", "p1"), ("stop-decode", "d0"),
    ]  # fmt: skip


def test_a_partition_of_a_server_in_no_namespace_is_skipped_and_every_later_one():
    injector = Injector(_cluster([]), stop_s=0.1, clock=lambda: 5.0)
    first = asyncio.run(injector.inject(Fault(1, "partition", "prefill0", 0.0)))
    assert first.skipped and "no network namespace" in first.note
    later = asyncio.run(injector.inject(Fault(2, "partition", "prefill0", 0.0)))
    assert later.skipped and "refused earlier" in later.note


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def namespace():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2")
    name = f"kvpush-part-{os.getpid()}"
    _ip("netns", "add", name)
    try:
        # A veth pair inside it: this kernel has no dummy devices.
        _ip("-n", name, "link", "add", "kvpd0", "type", "veth", "peer", "name", "kvpd1")
        _ip("-n", name, "addr", "add", "10.241.250.1/30", "dev", "kvpd0")
        for device in ("kvpd0", "kvpd1"):
            _ip("-n", name, "link", "set", device, "up")
        _ip("-n", name, "route", "add", "default", "dev", "kvpd0")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_partition_takes_the_hosts_outward_link_down_then_heals_it_with_its_route(namespace):
    injector = Injector(_cluster(["ip", "netns", "exec", namespace]), stop_s=1.0, clock=lambda: 0)
    seen: list[str] = []

    async def cut_and_look() -> Fault:
        injecting = asyncio.ensure_future(injector.inject(Fault(1, "partition", "prefill0", 0)))
        await asyncio.sleep(0.5)
        seen.append(_ip("-n", namespace, "-o", "link", "show", "kvpd0"))
        seen.append(_ip("-n", namespace, "route", "show", "default"))
        return await injecting

    fault = asyncio.run(cut_and_look())
    assert "state DOWN" in seen[0] or ",UP" not in seen[0], seen[0]
    assert seen[1].strip() == "", "the default route survived the link going down"
    assert not fault.skipped and "kvpd0 down" in fault.note and fault.end is not None
    assert ",UP" in _ip("-n", namespace, "-o", "link", "show", "kvpd0")
    assert "dev kvpd0" in _ip("-n", namespace, "route", "show", "default")
