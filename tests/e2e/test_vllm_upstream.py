"""A kvpush decode refuses KV from upstream vLLM's NixlConnector, clearly, not by hanging.

Its own module, so the pull tests' servers are gone before these start: upstream's
server busy-polls a core even when idle, and two cores are all there is.
"""

from __future__ import annotations

import pytest
from conftest import DECODE_TIMERS, prompt

from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

NIXL = "nixl_prefill"


@pytest.fixture(scope="module")
def kvpush_decode(cluster):
    """A pull-mode kvpush decode with the fail policy: a refused transfer is an error."""
    name = "upstream_pair_decode"
    cluster.add_server(name, "kv_consumer", core=1, mode="pull", policy="fail", **DECODE_TIMERS)
    try:
        cluster.start(name)
        yield name
    finally:
        cluster.servers.pop(name).stop()


def test_upstream_nixl_connector_prefill_cannot_pair(cluster, kvpush_decode, client):
    nixl = cluster.add_server(NIXL, None, core=0)
    nixl.spec.kv_transfer_config = {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
    }  # fmt: skip
    nixl.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    try:
        cluster.start(NIXL)
        # Through the router: no kvpush identity, so a clear 502 rather than a hang.
        router = cluster.start_router([NIXL], [kvpush_decode], mode="pull", name="nixl")
        response = client.complete(router, prompt(40))
        assert response.status_code == 502
        assert "NixlConnector cannot pair" in response.json()["error"]["message"]
        # By hand: upstream's real prefill answer, given to a kvpush decode.
        leg = client.complete(
            nixl.url, prompt(40), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        upstream_params = leg.json()["kv_transfer_params"]
        decode = cluster.servers[kvpush_decode]
        response = client.complete(decode.url, prompt(40), kv_transfer_params=upstream_params)
        assert response.status_code >= 500
        assert "cannot pair with it" in decode.log_tail(400)
    finally:
        cluster.stop_router("nixl")
        cluster.servers.pop(NIXL).stop()
