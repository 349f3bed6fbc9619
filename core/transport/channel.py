"""The side channel: length-prefixed frames over TCP, driven by the loop thread.

Control messages travel here rather than as NIXL notifications because a socket can
wake a blocked thread the instant a message arrives, while a notification is only
seen when someone polls NIXL; and a peer that dies closes its sockets at once, so
death is noticed without a timeout (a host that vanishes closes nothing: the kernel
drops a link its peer stopped acknowledging, `drop_when_silent`). Bytes moved by
NIXL still carry their own notification, which says they have landed.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Callable

from kvpush.errors import ConfigError, ProtocolError
from kvpush.transport.loop import Loop

log = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20


class Connection:
    """One framed TCP connection; all methods run on the loop thread."""

    def __init__(
        self,
        loop: Loop,
        sock: socket.socket,
        on_frame: Callable[[Connection, bytes], None],
        on_close: Callable[[Connection, str], None],
        label: str = "",
        max_frame: int = MAX_FRAME,
        dead_after_s: float | None = None,
    ) -> None:
        self.loop = loop
        self.max_frame = max_frame  # the largest frame the peer may send now
        self.sock = sock
        self.on_frame = on_frame
        self.on_close = on_close
        self.label = label or _peer_label(sock)
        self.closed = False
        # The peer's end closed (FIN or RST came): its side knows the link is gone.
        self.closed_by_peer = False
        self.refused = ""  # why we closed it on the peer's account, for the counters
        self._inbuf = bytearray()
        self._outbuf = bytearray()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if dead_after_s is not None:
            drop_when_silent(sock, dead_after_s)
        loop.add_reader(sock, self._readable)

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise ProtocolError(f"connection to {self.label} is closed")
        self._outbuf += HEADER.pack(len(frame)) + frame
        self._flush()

    def close(self, reason: str = "closed locally") -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock)
        self.loop.remove_writer(self.sock)
        self.sock.close()
        self.on_close(self, reason)

    def _flush(self) -> None:
        try:
            while self._outbuf:
                sent = self.sock.send(self._outbuf)
                del self._outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError as exc:
            self.close(f"send failed: {exc.strerror or exc}")
            return
        if self._outbuf:
            self.loop.add_writer(self.sock, self._flush)
        else:
            self.loop.remove_writer(self.sock)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            self.closed_by_peer = isinstance(exc, ConnectionResetError)
            self.close(f"receive failed: {exc.strerror or exc}")
            return
        if not data:
            self.closed_by_peer = True
            self.close("the peer closed the connection")
            return
        self._inbuf += data
        while len(self._inbuf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._inbuf)
            if size > self.max_frame:
                self.refused = "oversized_frame"
                self.close(f"the peer sent a {size}-byte frame (limit {self.max_frame})")
                return
            if len(self._inbuf) < HEADER.size + size:
                break
            frame = bytes(self._inbuf[HEADER.size : HEADER.size + size])
            del self._inbuf[: HEADER.size + size]
            self.on_frame(self, frame)
            if self.closed:
                return


class Listener:
    """Accepts connections on (host, port); port 0 picks a free one."""

    def __init__(
        self, loop: Loop, host: str, port: int, on_accept: Callable[[socket.socket], None]
    ) -> None:
        self.loop = loop
        self.on_accept = on_accept
        try:
            self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        except OSError as exc:
            raise ConfigError(
                f"the kvpush side channel cannot listen on {host}:{port}: {exc.strerror} "
                "(another process holds the port? set port to a free one, or 0)"
            ) from exc
        self.sock.setblocking(False)
        self.host, self.port = self.sock.getsockname()[:2]
        loop.add_reader(self.sock, self._accept)

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
                raise
            log.warning("kvpush side channel: accept failed: %s", exc)
            return
        self.on_accept(sock)

    def close(self) -> None:
        self.loop.remove_reader(self.sock)
        self.sock.close()


def drop_when_silent(sock: socket.socket, seconds: float) -> None:
    """Have the kernel drop `sock` once its peer has acknowledged nothing for about
    `seconds`, idle or not: a host that vanished (power lost, a cable cut) sends no FIN,
    and without this the connection stays established for as long as TCP retries
    (with Linux's default tcp_retries2, a quarter of an hour with data queued; for
    ever when idle). The loss then
    surfaces as a failed receive, as any closed link's does.

    Keepalive probes an idle connection a third of the way in; TCP_USER_TIMEOUT bounds
    both unacknowledged data and the probes. Where the platform lacks an option, the
    connection goes without it."""
    options = [
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", max(1, int(seconds / 3))),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", max(1, int(seconds / 6))),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 6),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", max(1, int(seconds * 1000))),
    ]
    for level, name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(level, option, value)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connected socket, or ProtocolError naming the address. Blocking: call off-loop."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ProtocolError(f"cannot reach kvpush side channel at {host}:{port}: {exc}") from exc


def _peer_label(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unconnected"
