"""A disaggregated deployment on one machine: vLLM prefill and decode servers running
KVPushConnector, and the kvpush router in front. Used by `kvpush demo` and the
end-to-end tests alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvpush.demo.servers import ServerSpec, VllmServer
from kvpush.errors import KVPushError
from kvpush.ports import free_port
from kvpush.vllm.config import ENV_INSECURE, ENV_SECRET, KV_ROLES, new_secret


def kvpush_transfer_config(
    role: str, mode: str = "push", policy: str = "fail", **extra: Any
) -> dict[str, Any]:
    """A --kv-transfer-config for KVPushConnector (by name: the vLLM plugin registers it)."""
    if role not in KV_ROLES:
        raise KVPushError(f"kv_role must be one of {sorted(KV_ROLES)}, got {role!r}")
    return {
        "kv_connector": "KVPushConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"mode": mode, **extra},
    }


class Cluster:
    """Servers and a router under one work directory; stop() ends them all."""

    def __init__(
        self,
        workdir: Path,
        model: Path,
        secret: str | None = None,
        insecure: bool = False,
        kv_blocks: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.model = model
        self.kv_blocks = kv_blocks  # each server's KV cache blocks; None: what 1 GiB holds
        # This deployment's own secret; none at all only when asked (a soak's baseline).
        self.secret = "" if insecure else secret or new_secret()
        self.servers: dict[str, VllmServer] = {}
        self.identity_ports: dict[str, int] = {}
        self.routers: dict[str, tuple[subprocess.Popen, str]] = {}

    def add_server(
        self,
        name: str,
        role: str | None,
        core: int | None,
        mode: str = "push",
        policy: str = "fail",
        model: Path | None = None,
        dp: int = 1,
        tp: int = 1,
        **extra: Any,
    ) -> VllmServer:
        """Configure (not start) a server; role None means a plain vLLM without kvpush.
        `dp` > 1: that many data-parallel ranks, rank d's identity at identity port + d.
        `tp` > 1: tensor parallel, one core a rank (cores 0, 1, ...)."""
        transfer = None
        if role is not None:
            self.identity_ports[name] = free_port(span=dp)
            extra.setdefault("identity_port", self.identity_ports[name])
            transfer = kvpush_transfer_config(role, mode, policy, **extra)
        spec = ServerSpec(
            name, model or self.model, free_port(), transfer, core=core,
            env={ENV_SECRET: self.secret} if self.secret else {ENV_INSECURE: "1"},
            kv_blocks=self.kv_blocks,
        )  # fmt: skip
        if dp > 1:
            spec.extra_args += ["--data-parallel-size", str(dp)]
            if core is not None:  # vLLM wants one CPU list per DP rank, "|" between
                spec.core = "|".join([str(core)] * dp)
        if tp > 1:  # one CPU list per TP rank
            spec.extra_args += ["--tensor-parallel-size", str(tp)]
            spec.core = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
        server = self.servers[name] = VllmServer(spec, self.workdir)
        return server

    def start(self, *names: str, timeout: float = 600.0) -> None:
        """Start the named servers together and wait until each answers /health."""
        chosen = [self.servers[n] for n in names or self.servers]
        for server in chosen:
            server.start()
        for server in chosen:
            server.wait_healthy(timeout)

    def restart(self, name: str, timeout: float = 600.0) -> None:
        self.servers[name].stop()
        self.start(name, timeout=timeout)

    def router_spec(self, name: str) -> str:
        """How the router is told about a server: URL plus identity port."""
        server = self.servers[name]
        port = self.identity_ports.get(name)
        return f"{server.url},identity={port}" if port else server.url

    def identity_url(self, name: str, dp_rank: int = 0) -> str:
        server = self.servers.get(name)
        host = server.spec.host if server else "127.0.0.1"
        return f"http://{host}:{self.identity_ports[name] + dp_rank}"

    def start_router(
        self,
        prefill: list[str],
        decode: list[str],
        mode: str = "push",
        timeout_s: float = 120.0,
        name: str = "router",
        flags: tuple[str, ...] = (),
    ) -> str:
        """Start (or restart) the router `name` in front of the named servers (or of
        other instances, given as router specs: "http://..."), with more `flags` of
        `kvpush router`; its URL."""
        port = free_port()
        command = [sys.executable, "-m", "kvpush", "router", "--port", str(port),
                   "--mode", mode, "--timeout", str(timeout_s), *flags]  # fmt: skip
        for flag, servers in (("--prefill", prefill), ("--decode", decode)):
            for server in servers:
                command += [flag, server if server.startswith("http") else self.router_spec(server)]
        return self.start_router_command(name, command, port, ready_path="/metrics")

    def start_router_command(
        self, name: str, command: list[str], port: int, ready_path: str = "/health"
    ) -> str:
        """Start (or restart) router `name` as `command`, which serves on `port`
        (kvpush's own, or one a user runs, such as vllm-router); its URL once it
        answers `ready_path`."""
        self.stop_router(name)
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        router = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        url = f"http://127.0.0.1:{port}"
        self.routers[name] = (router, url)
        _wait_http(url + ready_path, 60, router)
        return url

    def stop_router(self, name: str = "router") -> None:
        router, _ = self.routers.pop(name, (None, ""))
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                # Dead, if not yet reaped: cleanup goes on (a stalled machine can take long).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    router.wait(10)

    def stop(self) -> None:
        for name in list(self.routers):
            self.stop_router(name)
        for server in self.servers.values():
            server.stop()


def _wait_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise KVPushError(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise KVPushError(f"{url} did not answer within {timeout:.0f}s")
