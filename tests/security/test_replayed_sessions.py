"""Frames recorded from a real session, replayed and reordered by someone without the
secret, against live nodes.

A recording proxy sits between a real decode and a real prefill Node while they pair
and move one transfer, and keeps each direction's frames. The attacker then plays
them back: the decode's frames to the live prefill, and the prefill's frames (an
old boot's hello among them) to a decode that dials the attacker. Signatures hold,
since the frames are genuine; what must fail is everything past the hello, because
each session's keys come from both sides' fresh nonces.
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
from host_nodes import HEADER, host_node

from kvpush.protocol.messages import AgentMetadata, Hello, decode

pytestmark = pytest.mark.nixl


def _split(data: bytes) -> list[bytes]:
    """The length-prefixed frames in `data`, each with its prefix."""
    frames = []
    while len(data) >= HEADER.size:
        (size,) = HEADER.unpack_from(data)
        frames.append(data[: HEADER.size + size])
        data = data[HEADER.size + size :]
    return frames


def _message(frame: bytes):
    _, _, _, payload = msgspec.msgpack.decode(frame[HEADER.size :])
    return decode(payload)


class _Recorder:
    """A TCP proxy in front of `target` that keeps what each side sent."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.from_client = bytearray()
        self.from_server = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target)
        pumps = [
            threading.Thread(target=self._pump, args=(client, upstream, self.from_client)),
            threading.Thread(target=self._pump, args=(upstream, client, self.from_server)),
        ]
        for pump in pumps:
            pump.start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while chunk := src.recv(65536):
                record += chunk
                dst.sendall(chunk)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # one side closed under us: the recording ends there

    def close(self) -> None:
        self.server.close()


def _read_until_closed(sock: socket.socket, seconds: float = 15.0) -> bytes:
    sock.settimeout(seconds)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.fixture(scope="module")
def recorded():
    """One real session's frames: decode -> prefill and prefill -> decode, and the
    prefill's boot epoch."""
    producer = host_node("producer", "prefill-engine")
    decode_node = host_node("consumer", "decode-engine")
    proxy = _Recorder(producer.address)
    try:
        decode_node.expect("t1", proxy.address, [1, 2], engine="prefill-engine")
        deadline = time.monotonic() + 20
        while not producer.stats()["links"]:
            assert time.monotonic() < deadline, "the two nodes did not pair"
            time.sleep(0.02)
        producer.kv_ready("t1", [3, 4])
        (outcome,) = decode_node.wait_results(20)
        assert outcome.kind == "delivered", outcome
        epoch = producer.config.epoch
    finally:
        decode_node.close()
        producer.close()
        proxy.close()
    time.sleep(0.2)  # the pumps drain the closes
    to_producer, to_decode = _split(bytes(proxy.from_client)), _split(bytes(proxy.from_server))
    kinds = [type(_message(f)).__name__ for f in to_decode]
    assert kinds[:3] == ["Hello", "Verify", "AgentMetadata"], kinds  # a genuine session
    return to_producer, to_decode, epoch


def test_a_decodes_recorded_frames_replayed_to_a_live_prefill_open_nothing(recorded):
    to_producer, _, _ = recorded
    producer = host_node("producer", "prefill-engine")
    try:
        for order in (to_producer, [to_producer[0], *reversed(to_producer[1:])]):
            host, _, port = producer.address.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"".join(order))
            answers = [_message(f) for f in _split(_read_until_closed(sock))]
            kinds = [type(m).__name__ for m in answers]
            assert kinds == ["Hello", "Verify", "Reject"], kinds  # hello, then refused
            assert "signature" in answers[-1].reason or "replayed" in answers[-1].reason
            assert not any(isinstance(m, AgentMetadata) for m in answers)
            sock.close()
        assert producer.metrics.counter("rejected_messages", why="auth") == 2
        assert producer.stats()["links"] == []
    finally:
        producer.close()


@pytest.mark.parametrize("leg_names", ["the new boot", "the old boot"])
@pytest.mark.parametrize("order", ["as recorded", "reordered"])
def test_a_prefills_recorded_frames_replayed_to_a_decode_get_none_of_its_memory(
    recorded, leg_names, order
):
    """The attacker listens where a forged decode leg points, and answers the
    decode's hello with an old prefill session's frames."""
    _, to_decode, old_epoch = recorded
    frames = to_decode if order == "as recorded" else [to_decode[0], *reversed(to_decode[1:])]
    attacker = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{attacker.getsockname()[1]}"
    heard: list = []

    def play_back() -> None:
        conn, _ = attacker.accept()
        conn.settimeout(15)
        first = conn.recv(65536)  # the decode's hello
        conn.sendall(b"".join(frames))
        heard.extend(_message(f) for f in _split(first + _read_until_closed(conn)))
        conn.close()

    thread = threading.Thread(target=play_back, daemon=True)
    thread.start()
    decode_node = host_node("consumer", "decode-engine")
    try:
        epoch = "0badc0de" if leg_names == "the new boot" else old_epoch
        decode_node.expect("t1", address, [1, 2], engine="prefill-engine", epoch=epoch)
        (failed,) = decode_node.wait_results(20)
        assert (failed.kind, failed.reason) == ("failed", "handshake_failed"), failed
        if leg_names == "the new boot":
            assert "restarted" in failed.detail
        thread.join(20)
        kinds = [type(m).__name__ for m in heard]
        assert kinds[0] == "Hello" and isinstance(heard[0], Hello)
        assert not any(isinstance(m, AgentMetadata) for m in heard), kinds
        assert set(kinds) <= {"Hello", "Reject"}, kinds
        assert decode_node.stats()["links"] == []
        if leg_names == "the old boot":
            assert decode_node.metrics.counter("rejected_messages", why="auth") == 1
    finally:
        decode_node.close()
        attacker.close()
