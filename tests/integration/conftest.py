from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

PEER_SCRIPT = Path(__file__).with_name("peer_main.py")


class RemotePeer:
    """An agent_peer.py process; call() sends one command and waits for its answer."""

    def __init__(self, start: Callable[..., subprocess.Popen] = subprocess.Popen, **env: str):
        """`start`: how to start the process (another host's, say: tests/netns.py);
        `env`: variables for it, beside this process's."""
        self.proc = start(
            [sys.executable, str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **env),
        )

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply(op, timeout)

    def send(self, op: str, **args: Any) -> None:
        """Start a command without waiting; collect its answer with reply()."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, op: str, timeout: float = 60.0) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"peer did not answer {op!r} within {timeout}s")
        line = self.proc.stdout.readline()
        # UCX logs to stdout (an interface another test removed mid-scan, say):
        # replies are the lines that are JSON objects.
        while line and not line.startswith("{"):
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited (code {self.proc.poll()}) during {op!r}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"peer failed {op!r}: {reply['error']}")
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        # Generous: a killed process is gone only once the kernel has torn down its
        # memory, which takes seconds on a CI machine full of vLLM engines.
        self.proc.wait(120)


@pytest.fixture
def remote_peer() -> Iterator[RemotePeer]:
    peer = RemotePeer()
    yield peer
    peer.kill()
