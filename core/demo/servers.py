"""Start and stop real vLLM OpenAI servers (the CPU build) as process groups.

Each server gets its own temp and compile directories (vLLM leaves sockets behind
otherwise), shares vLLM's cache with the other servers of its work directory (or
the run's, with VLLM_CACHE_ROOT set), is pinned to one core, and runs in its own
session so that stopping it reaches every process it spawned.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.errors import KVPushError
from kvpush.vllm.config import ENV_INSECURE, ENV_SECRET, ENV_SECRET_FILE, env_flag

MODEL_NAME = "tiny"
# "ValueError: ...", "torch.OutOfMemoryError: ...": a traceback's last line.
EXCEPTION_LINE = re.compile(r"(^|\s)([\w.]+(Error|Exception)): ")


@dataclass
class ServerSpec:
    name: str
    model: Path
    port: int
    kv_transfer_config: dict[str, Any] | None = None
    core: int | str | None = None  # CPU core(s) for the worker's compute threads, e.g. "0-3"
    kv_cache_gib: int = 1  # vLLM reads whole GiB
    # Fewer blocks than kv_cache_gib holds (vLLM's --num-gpu-blocks-override): a smaller
    # cache to allocate and register at start, and less memory per server.
    kv_blocks: int | None = None
    max_model_len: int = 2048
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Where the API listens and is reached: another address where the server runs
    # behind `launcher` in a network of its own.
    host: str = "127.0.0.1"
    # What the server's command runs under, e.g. ["ip", "netns", "exec", NAME] for
    # another network namespace; it must exec the command, keeping its process group.
    launcher: list[str] = field(default_factory=list)


class VllmServer:
    def __init__(self, spec: ServerSpec, workdir: Path) -> None:
        self.spec = spec
        self.dir = workdir / spec.name
        self.log_path = self.dir / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def scratch(self) -> Path:
        """vLLM's TMPDIR, where its ZeroMQ sockets are files: short, not under the work
        directory, since a socket's path must fit in 107 bytes and a work directory's
        (pytest's, under xdist) may take most of them. Made on start, removed on stop."""
        return Path(tempfile.gettempdir()) / f"kvpush-{os.getpid()}-{self.spec.port}"

    @property
    def cache(self) -> Path:
        """vLLM's cache (VLLM_CACHE_ROOT): ours where it is set, else shared by the
        servers of one work directory. What vLLM learns of a model's class there, it
        would otherwise learn anew at every start, in a subprocess that imports vLLM
        again (about 16 s of CPU here)."""
        chosen = os.environ.get("VLLM_CACHE_ROOT")
        return Path(chosen) if chosen else self.dir.parent / "vllm-cache"

    def command(self) -> list[str]:
        spec = self.spec
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model), "--served-model-name", MODEL_NAME,
            "--host", spec.host, "--port", str(spec.port),
            "--enforce-eager", "--dtype", "float32", "--seed", "0",
            "--max-model-len", str(spec.max_model_len),
        ]  # fmt: skip
        if spec.kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        if spec.kv_blocks is not None:  # before extra_args: a test's own count wins
            command += ["--num-gpu-blocks-override", str(spec.kv_blocks)]
        return command + spec.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for directory in (self.cache, self.dir / "inductor"):
            directory.mkdir(parents=True, exist_ok=True)
        env.update(
            TMPDIR=str(self.scratch),
            VLLM_CACHE_ROOT=str(self.cache),
            TORCHINDUCTOR_CACHE_DIR=str(self.dir / "inductor"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib),
            PYTHONUNBUFFERED="1",
        )
        if self.spec.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.spec.core)
        if env_flag(ENV_INSECURE, self.spec.env):  # no secret on purpose: none inherited either
            env.pop(ENV_SECRET, None)
            env.pop(ENV_SECRET_FILE, None)
        env.update(self.spec.env)
        return env

    def start(self) -> VllmServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open
        self.process = subprocess.Popen(
            [*self.spec.launcher, *self.command()],
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                log = self.log_tail(400)
                raise KVPushError(
                    f"vLLM server {self.spec.name!r} exited ({self.process.returncode}):\n"
                    + "\n".join(log.splitlines()[-40:])
                    + f"\n{self.spec.name}: {root_cause(log)}"
                )
            if self.healthy():
                return
            time.sleep(0.2)
        # The name again last: CI shows only the end of a failed run.
        raise KVPushError(
            f"vLLM server {self.spec.name!r} not healthy after {timeout:.0f}s:\n"
            + self.log_tail()
            + f"\n{self.spec.name}: no answer on /health after {timeout:.0f}s (still running)"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left."""
        process, self.process = self.process, None
        if process is not None:
            _end_group(process, timeout)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def send_signal(self, sig: int) -> None:
        """Signal every process of the server (SIGSTOP and SIGCONT: a frozen host)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """Crash the server on purpose (SIGKILL to every process): tests of peer death."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self.process = None


def root_cause(log: str) -> str:
    """The last exception a server's log names, other than vLLM's generic start-up failure.

    vLLM's API process ends with "Engine core initialization failed. See root cause
    above"; the cause is the engine core's own traceback, often more than a short tail
    back. CI shows only the end of a failed run, so a start failure ends with this.
    """
    generic = "Engine core initialization failed"
    causes = [
        line.strip()
        for line in log.splitlines()
        if EXCEPTION_LINE.search(line) and generic not in line
    ]
    return causes[-1] if causes else "no exception in the log (killed? out of memory?)"


def _end_group(process: subprocess.Popen, timeout: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        if _group_gone(process, wait):
            return


def _group_gone(process: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    # The leader is gone; its children share the group id until they exit too.
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
