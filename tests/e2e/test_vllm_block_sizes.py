"""Different block sizes on real vLLM's CPU build: refused, with the reason, where
the cache's token order is the attention kernel's own.

kvpush moves a larger block as pages of a smaller one wherever a block's tokens lie
in a known order (GPU HND and NHD caches, Neuron's, any backend that names its
tokens: tests/integration and tests/unit/test_layout_pages.py check those byte for
byte). vLLM's CPU attention keeps each head's K for a block, then its V, and orders
K by its kernels' tiling, so kvpush describes a head's part of a block as opaque and
refuses to cut it. Each instance says so in its identity, so a router in front of a
prefill of 128-token blocks (vLLM's CPU default) and a decode of 64 refuses the pair
before either leg runs, naming both sizes and why: never a wrong answer, never a
bare "Internal server error", and no KV held."""

from __future__ import annotations

import pytest
from conftest import DECODE_TIMERS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SMALL = "bs64_decode"


@pytest.fixture(scope="module")
def small_blocks_decode(cluster):
    """A decode of 64-token blocks (load failures fail the request) beside the
    session's 128-token pair."""
    cluster.add_server(SMALL, "kv_consumer", core=1, **DECODE_TIMERS)
    cluster.servers[SMALL].spec.extra_args = ["--block-size", "64"]
    try:
        cluster.start(SMALL)
        yield
    finally:
        cluster.servers.pop(SMALL).stop()


def _prompt(length: int, seed: int) -> list[int]:
    """Token ids no other module's prompt shares a block with (another stride than
    conftest's)."""
    return [(seed * 131 + i * 41) % 2040 + 6 for i in range(length)]


def test_blocks_of_another_size_on_the_cpu_build_are_refused_naming_why(
    cluster, client, small_blocks_decode
):
    router = cluster.start_router(["prefill"], [SMALL], name="bs-128-to-64")
    try:
        answer = client.complete(router, _prompt(300, 31000))
    finally:
        cluster.stop_router("bs-128-to-64")
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "pairing_error", error
    for words in ("prefill holds 128 tokens per block, decode 64", "kernel's own order"):
        assert words in error["message"], error
    url = cluster.servers[SMALL].url
    assert client.metric(url, "vllm:kvpush_delivered_total") == 0
    for name in ("prefill", SMALL):
        state = client.wait_drained(cluster.identity_url(name))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
