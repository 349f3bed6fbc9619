"""kvpush on real vLLM, as an attacker without the secret sees it.

Secure by default: an instance without a secret does not start. A client of decode's
OpenAI API that forges a decode leg naming a producer it runs (with another secret)
gets no KV of decode's and can write none: the handshake stops at the hellos, the
request is computed from the prompt, and both sides count the refusal. Whoever
reads the servers' logs or the process table learns no secret from them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import Client, prompt

from kvpush.backend.plugins import Backends
from kvpush.demo.cluster import Cluster
from kvpush.errors import KVPushError
from kvpush.node import Node, NodeConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_an_instance_without_a_secret_does_not_start_and_says_how(cluster, monkeypatch):
    monkeypatch.delenv("KVPUSH_SECRET", raising=False)
    monkeypatch.delenv("KVPUSH_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVPUSH_INSECURE", raising=False)
    server = cluster.add_server("no_secret", "kv_consumer", core=1)
    server.spec.env.pop("KVPUSH_SECRET")
    try:
        with pytest.raises(KVPushError, match="exited"):
            cluster.start("no_secret", timeout=300)
        log = server.log_path.read_text(errors="replace")
        assert "no shared secret" in log and "kvpush secret" in log, log[-3000:]
    finally:
        cluster.servers.pop("no_secret").stop()


@pytest.fixture
def attacker():
    """A kvpush producer the attacker runs: real NIXL, its own (wrong) secret, and KV
    memory of its own that a fooled decode would read from or write into."""
    backends = Backends(["host"])
    memory = np.full((2, 8, 4096), 0x66, dtype=np.uint8)
    kv = backends.describe({f"layer.{i}": memory[i] for i in range(2)}, ("blocks", "bytes"))
    config = NodeConfig("attacker", "producer", secret=b"the-attackers-own-secret-0123")
    node = Node(config, kv, backends).start()
    try:
        yield node
    finally:
        node.close()


def test_a_forged_decode_leg_naming_the_attackers_producer_moves_no_kv(
    cluster, client: Client, attacker
):
    decode = cluster.servers["decode"]  # kv_both, kv_load_failure_policy recompute
    tokens = prompt(300, 9700)
    sources = "vllm:prompt_tokens_by_source_total"
    before = _external(client, decode.url, sources)
    refused = client.metric(decode.url, "vllm:kvpush_rejected_messages_total")
    forged = {
        "do_remote_prefill": True, "transfer_id": "xfer-forged", "transfer_mode": "push",
        "remote_engine_id": "attacker", "remote_epoch": "", "tp_size": 1,
        "remote_addresses": [attacker.address],
    }  # fmt: skip
    answer = client.complete(decode.url, tokens, kv_transfer_params=forged)
    assert answer.status_code == 200, answer.text  # computed here, per the policy
    assert answer.json()["choices"][0]["token_ids"] == client.tokens(
        cluster.servers["single"].url, tokens
    )
    assert _external(client, decode.url, sources) == before  # nothing came from it
    assert attacker.metrics.counter("rejected_messages", why="auth") >= 1
    assert attacker.stats()["links"] == []  # never paired: no metadata either way
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(decode.url, "vllm:kvpush_rejected_messages_total") == refused:
        assert time.monotonic() < deadline, "decode did not count the refused hello"
        time.sleep(0.2)
    assert client.wait_drained(cluster.identity_url("decode"))["receiving"] == 0


def _external(client: Client, url: str, name: str) -> float:
    total = 0.0
    for line in client.http.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'source="external_kv_transfer"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_secret_is_in_no_log_line_and_no_command_line(
    cluster: Cluster, router: str, client: Client
):
    """A secured pair that paired and moved KV, behind the router: no line of any log
    the servers and routers wrote, and no command line of their processes, holds the
    deployment's secret, as is or hex-encoded."""
    decode = cluster.servers["decode"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    tokens = prompt(300, 9800)
    assert client.tokens(router, tokens) == client.tokens(cluster.servers["single"].url, tokens)
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(decode, "vllm:kvpush_delivered_total") == delivered:
        assert time.monotonic() < deadline, "no KV moved: the pair never paired"
        time.sleep(0.2)
    secret = cluster.secret.encode()
    forms = {"the secret": secret, "its hex": secret.hex().encode()}
    logs = sorted(cluster.workdir.rglob("*.log"))
    names = {path.parent.name if path.name == "server.log" else path.stem for path in logs}
    assert {"prefill", "decode", "router"} <= names, names
    # The line that printed a secret set in kv_connector_extra_config: it is read here.
    assert "non-default args" in cluster.servers["prefill"].log_path.read_text(errors="replace")
    leaks = [
        f"{what} in {path}, line {number}"
        for path in logs
        for number, line in enumerate(path.read_bytes().splitlines(), 1)
        for what, form in forms.items()
        if form in line
    ]
    commands = _command_lines(cluster)
    assert any(b"--kv-transfer-config" in line for line in commands.values()), commands
    leaks += [
        f"{what} in the command line of process {pid}"
        for pid, line in commands.items()
        for what, form in forms.items()
        if form in line
    ]
    assert not leaks, leaks


def _command_lines(cluster: Cluster) -> dict[int, bytes]:
    """/proc/PID/cmdline (what `ps` shows) of every process of the running servers
    and routers: each runs in its own process group, its children in it too."""
    groups = {s.process.pid for s in cluster.servers.values() if s.process is not None}
    groups |= {process.pid for process, _ in cluster.routers.values()}
    found: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) in groups:
                found[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
    assert len(found) >= len(groups), (groups, found)
    return found
