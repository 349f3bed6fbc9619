"""kvpush on real vLLM, as an attacker without the secret sees it.

Secure by default: an instance without a secret does not start. A client of decode's
OpenAI API that forges a decode leg naming a producer it runs (with another secret)
gets no KV of decode's and can write none: the handshake stops at the hellos, the
request is computed from the prompt, and both sides count the refusal.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import Client, prompt

from kvpush.backend.plugins import Backends
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
