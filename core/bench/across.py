"""`kvpush bench transfer --across-namespaces`: NIXL WRITE across a network link,
against the same link's plain TCP.

Two network namespaces joined by a veth link (kvpush.netns) stand in for two hosts.
In namespace b run the bench's NIXL receiver (transfer.py's, listening on b's
address) and a TCP sink; in namespace a the sender, which alternates one NIXL WRITE
into the receiver's blocks with one plain TCP send of the same bytes to the sink, so
that both see the same moment of a shared machine. The TCP send is timed at the
sink, from its length header to the last byte, as iperf times a stream; the WRITE
at the sender, from posting to completion. Their ratio is how close the transport
comes to what the link carries.

The sender checks the WRITE's completion every 50 µs, as kvpush's loop does at its
fastest, rather than in a tight loop: over TCP the kernel's network stack moves the
bytes, and on a machine with few cores a spinning sender takes the core it needs
(on 2 shared cores a spinning sender got 0.64 to 0.70 of TCP at 256 MiB where a napping
one got 0.79 to 0.89, in the same runs).

UCX runs with `UCX_TLS=tcp,self`: left to choose, it moves the bytes between two
namespaces of one machine through shared memory, and the link carries none of them.
The sender reads its end of the link's transmit counter around each WRITE, so the
report says how many bytes crossed.

Needs root (namespaces and links); every namespace, link and process it made is
removed when it ends, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.errors import KVPushError
from kvpush.netns import Host, TwoHosts, unavailable

MiB = 1 << 20
SIZES_MIB = (16, 256)
CHUNK = 4 * MiB  # the TCP stream's send and receive buffer
UCX_ENV = {"UCX_TLS": "tcp,self"}
HEADER = struct.Struct("!Q")  # bytes that follow
ANSWER = struct.Struct("!d")  # seconds the sink took to receive them
START_S = 120.0  # a child's first line: NIXL's import and registration
NAP_S = 50e-6  # the sender's sleep between completion checks


@dataclass
class AcrossResult:
    size_mib: float
    runs: int
    link_rate: str  # "veth" uncapped, else the tbf rate
    nixl_gbps: float
    tcp_gbps: float
    ratio: float  # NIXL over TCP
    first_transfer_ms: float
    moved_bytes: int  # by the WRITEs, warm-up included
    link_bytes: int  # the sender's end of the link sent while the WRITEs ran
    verified: bool


def main(sizes_mib: tuple[float, ...], runs: int, link_rate: int | None, as_json: bool) -> int:
    refuse_unless_able()
    progress = Progress("kvpush bench transfer --across-namespaces", "size", len(sizes_mib))
    report = Report(as_json, progress)
    hosts = TwoHosts()
    try:
        hosts.start()
        if link_rate:
            hosts.cap_link(link_rate)
        for size in sizes_mib:
            report.step(f"{size:g} MiB across the link")
            report.add(_measure(hosts, int(size * MiB), runs, rate_name(link_rate)))
        results = report.finish(_print_table)
    finally:
        close_uninterrupted(hosts)
    whole = all(r.verified and r.link_bytes >= r.moved_bytes for r in results)
    return 0 if whole else 1


def refuse_unless_able() -> None:
    if os.geteuid() != 0:
        raise KVPushError(
            "--across-namespaces needs root: it creates two network namespaces and a veth "
            "link between them (run it as root, e.g. with sudo)"
        )
    reason = unavailable()
    if reason:
        raise KVPushError(f"--across-namespaces cannot run here: {reason}")


def rate_name(bits: int | None) -> str:
    if not bits:
        return "veth"
    for unit, scale in (("Gbit", 10**9), ("Mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}/s"
    return f"{bits} bit/s"


def close_uninterrupted(hosts: TwoHosts) -> None:
    """Remove what was made; a second Ctrl-C must not leave half of it behind."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        hosts.close()
    finally:
        signal.signal(signal.SIGINT, before)


def _measure(hosts: TwoHosts, nbytes: int, runs: int, rate: str) -> AcrossResult:
    """One size: a fresh sink, receiver and sender; the sender's report."""
    address = hosts.b.address
    sink = _child(hosts, hosts.b, "sink", address)
    receiver = _child(hosts, hosts.b, "receiver", str(nbytes), address)
    sink_port, port = _read_line(sink), _read_line(receiver)
    sender = _child(
        hosts, hosts.a, "sender", str(nbytes), address, port, sink_port, str(runs), hosts.a.device
    )
    answer = json.loads(_read_line(sender, timeout=300 + runs * 30))
    for process in (sender, receiver, sink):
        process.wait(30)
    return AcrossResult(link_rate=rate, **answer)


def _child(hosts: TwoHosts, host: Host, role: str, *args: str) -> subprocess.Popen:
    # A session of its own: Ctrl-C reaches this process alone, whose clean-up ends it.
    return hosts.popen(
        host,
        [sys.executable, "-m", "kvpush.bench.across", role, *args],
        env={**os.environ, **UCX_ENV},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _read_line(process: subprocess.Popen, timeout: float = START_S) -> str:
    """The child's next line of output, or why there is none."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise KVPushError(f"bench child {process.args[-1]!r} said nothing in {timeout:g}s")
    line = process.stdout.readline().strip()
    if not line:
        code = process.wait(10)
        raise KVPushError(f"bench child {' '.join(process.args[6:8])} exited ({code})")
    return line


def _print_table(results: list[AcrossResult]) -> None:
    print(
        f"{'size':>8} {'link':>12} {'NIXL GB/s':>10} {'TCP GB/s':>9} {'ratio':>6} "
        f"{'first ms':>9} {'crossed':>8} ok"
    )
    for r in results:
        crossed = r.link_bytes / r.moved_bytes if r.moved_bytes else 0.0
        print(
            f"{r.size_mib:>6g}Mi {r.link_rate:>12} {r.nixl_gbps:>10.3f} {r.tcp_gbps:>9.3f} "
            f"{r.ratio:>6.2f} {r.first_transfer_ms:>9.2f} {crossed:>7.2f}x {r.verified}"
        )
    runs = results[0].runs if results else 0
    print(
        f"(UCX_TLS={UCX_ENV['UCX_TLS']}; medians of {runs} runs per size; crossed: bytes the "
        "link sent during the WRITEs over the bytes they moved)"
    )


# -- the children, each in its namespace ---------------------------------------------


class _Say:
    """transfer.py's receiver puts its port on a queue: here, a line on stdout."""

    def put(self, value: object) -> None:
        print(value, flush=True)


def _sink(address: str) -> None:
    """Receive length-prefixed streams on one connection; answer each with its time."""
    server = socket.create_server((address, 0))
    _Say().put(server.getsockname()[1])
    conn, _ = server.accept()
    buffer = memoryview(bytearray(CHUNK))
    while header := _exactly(conn, HEADER.size):
        left = HEADER.unpack(header)[0]
        started = time.perf_counter()
        while left:
            got = conn.recv_into(buffer, min(left, CHUNK))
            if not got:
                return
            left -= got
        conn.sendall(ANSWER.pack(time.perf_counter() - started))


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


class _Stream:
    """The sender's end of the TCP baseline: one connection, kept, as iperf's."""

    def __init__(self, address: str, port: int) -> None:
        self.conn = socket.create_connection((address, port), timeout=120)
        self.chunk = memoryview(bytearray(CHUNK))

    def time_one(self, nbytes: int) -> float:
        """Send `nbytes`; the seconds the sink took to receive them."""
        self.conn.sendall(HEADER.pack(nbytes))
        left = nbytes
        while left:
            step = min(left, CHUNK)
            self.conn.sendall(self.chunk[:step])
            left -= step
        return ANSWER.unpack(_exactly(self.conn, ANSWER.size))[0]


def _sent_bytes(device: str) -> int:
    # `ip netns exec` mounts this namespace's sysfs: the device is ours.
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def _sender(nbytes: int, address: str, port: int, sink_port: int, runs: int, device: str) -> None:
    from kvpush.bench.transfer import Shape, open_writer

    writer = open_writer(Shape(nbytes), address, port, nap_s=NAP_S)
    stream = _Stream(address, sink_port)
    writes, streams, crossed = [], [], 0
    for tag in range(runs + 1):  # the first of each pays set-up and is left out
        before = _sent_bytes(device)
        writes.append(writer.timed(tag)[2])
        crossed += _sent_bytes(device) - before
        streams.append(stream.time_one(writer.nbytes))
    verified = writer.verified()
    writer.close()
    nixl = writer.nbytes / statistics.median(writes[1:]) / 1e9
    tcp = writer.nbytes / statistics.median(streams[1:]) / 1e9
    answer = {
        "size_mib": writer.nbytes / MiB,
        "runs": runs,
        "nixl_gbps": round(nixl, 3),
        "tcp_gbps": round(tcp, 3),
        "ratio": round(nixl / tcp, 3),
        "first_transfer_ms": round(writes[0] * 1e3, 2),
        "moved_bytes": writer.nbytes * (runs + 1),
        "link_bytes": crossed,
        "verified": verified,
    }
    print(json.dumps(answer), flush=True)


def _run_child(argv: list[str]) -> None:
    role, *args = argv
    if role == "sink":
        _sink(args[0])
    elif role == "receiver":
        from kvpush.bench.transfer import Shape, _receiver_main

        _receiver_main(Shape(int(args[0])), _Say(), 0.1, host=args[1])
    elif role == "sender":
        nbytes, address, port, sink_port, runs, device = args
        _sender(int(nbytes), address, int(port), int(sink_port), int(runs), device)


if __name__ == "__main__":
    _run_child(sys.argv[1:])
