"""tests/netns.py's reachable pairs: the root namespace reaches each host at the address
it advertises without using the host-to-host link, two pairs claim subnets of their
own, and closing leaves no namespace, link, route or process behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import netns
import pytest

PAYLOAD = 1 << 20
# Accepts one connection, reads it to its end, answers with how many bytes it got.
SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
got = 0
while chunk := conn.recv(65536):
    got += len(chunk)
conn.sendall(str(got).encode())
"""


@pytest.fixture
def reachable():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made: list[netns.TwoHosts] = []

    def start() -> netns.TwoHosts:
        made.append(netns.TwoHosts(reachable=True))
        return made[-1].start()

    yield start
    for hosts in made:
        hosts.close()


def _link_bytes(host: netns.Host) -> int:
    """Bytes through `host`'s end of the host-to-host link, both ways."""
    shown = subprocess.run(
        ["ip", "-j", "-s", "-n", host.namespace, "link", "show", "dev", host.device],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    stats = json.loads(shown.stdout)[0]["stats64"]
    return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def _send_from_root(hosts: netns.TwoHosts, host: netns.Host, port: int) -> int:
    """PAYLOAD bytes from this process to a sink on `host`: how many arrived."""
    sink = hosts.popen(host, [sys.executable, "-c", SINK, host.address, str(port)],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sink.stdout.readline().strip() == "ready"
    with socket.create_connection((host.address, port), timeout=10) as conn:
        conn.sendall(b"x" * PAYLOAD)
        conn.shutdown(socket.SHUT_WR)
        return int(conn.recv(64))


def test_the_root_namespace_reaches_each_host_off_the_host_to_host_link(reachable):
    hosts = reachable()
    before = _link_bytes(hosts.a) + _link_bytes(hosts.b)
    for port, host in enumerate((hosts.a, hosts.b), start=18500):
        assert _send_from_root(hosts, host, port) == PAYLOAD
    assert _link_bytes(hosts.a) + _link_bytes(hosts.b) - before < PAYLOAD // 10


def test_two_pairs_claim_subnets_of_their_own_and_close_leaves_nothing(reachable):
    first, second = reachable(), reachable()
    subnets = {h.a.address.rpartition(".")[0] for h in (first, second)}
    assert len(subnets) == 2 and all(s.startswith("10.241.") for s in subnets)
    sink = first.popen(first.a, [sys.executable, "-c", "import time; time.sleep(600)"])
    first.close()
    assert sink.poll() is not None, "a process started in a host outlived close()"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    gone = first.a.address.rpartition(".")[0]
    assert first.a.namespace not in names and first.b.namespace not in names
    root_links = first.a.device.removesuffix("a") + "r"  # tests/netns.py's naming
    assert first.a.device not in links and root_links not in links
    assert f"{gone}." not in routes
    assert second.a.namespace in names, "closing one pair touched the other"
