"""Progressive push on real vLLM: with push_granularity "chunk" and a step budget of
96 tokens (3/4 of the CPU backend's 128-token blocks), a long prompt is computed in
many chunks, chunk boundaries fall inside blocks, and each chunk's complete blocks
must cross before the last chunk runs, and still give a plain instance's answer.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from conftest import DECODE_TIMERS, Client, extra_pair, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

STEP_TOKENS = 96
CHUNKED = ("--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", "8")
LENGTHS = (1, 96, 127, 128, 300, 700, 1500)


@pytest.fixture(scope="module")
def chunked_pair(cluster):
    with extra_pair(
        cluster, "chunked", extra_args=CHUNKED, push_granularity="chunk", **DECODE_TIMERS
    ) as url:
        yield url


def _trace(client: Client, cluster, name: str) -> list[dict]:
    return client.http.get(cluster.identity_url(name) + "/kvpush/trace?last=500").json()


def _traced(client: Client, cluster, name: str, send) -> list[dict]:
    """`send()`'s requests as instance `name` traced them, once it has let them go."""
    started = time.time()
    send()
    client.wait_drained(cluster.identity_url(name))
    return [t for t in _trace(client, cluster, name) if t["marks"]["arrived"] >= started]


def test_multi_chunk_prompts_answer_as_a_plain_instance(cluster, chunked_pair, client):
    single = cluster.servers["single"].url
    prompts = [prompt(n, 4100 + n) for n in LENGTHS]
    expected = [client.tokens(single, p) for p in prompts]
    assert [client.tokens(chunked_pair, p) for p in prompts] == expected


def test_shared_prefixes_hit_both_prefix_caches_and_still_answer_right(
    cluster, chunked_pair, client
):
    """Prompts sharing a 700-token prefix (five full blocks and a split one): the
    later ones find it in prefill's prefix cache (their first chunk starts past it)
    and in decode's (only the blocks after it are claimed)."""
    single = cluster.servers["single"].url
    prefix = prompt(700, 4900)
    prompts = [prefix + prompt(n, 4950 + n) for n in (1, 200, 500)]
    expected = [client.tokens(single, p) for p in prompts]
    assert [client.tokens(chunked_pair, p) for p in prompts] == expected
    for name in ("chunked_prefill", "chunked_decode"):
        url = cluster.servers[name].url
        assert client.metric(url, "vllm:prefix_cache_hits_total") > 0, name


def test_early_chunks_cross_before_the_last_chunk_runs(cluster, chunked_pair, client):
    """The negative control is in the same run: a prompt that fits one step has no
    earlier chunk, so nothing may be noted as sent before its last step."""
    short, long = (
        _traced(
            client,
            cluster,
            "chunked_prefill",
            lambda n=n: client.tokens(chunked_pair, prompt(n, 5200 + n)),
        )
        for n in (90, 1200)
    )
    ((one_step,), (many,)) = short, long
    assert "last_step" in one_step["marks"] and "chunk_sent" not in one_step["marks"]
    marks = many["marks"]
    # Prefill learnt that an earlier chunk's WRITE had completed before it scheduled
    # the step computing the last token: those bytes were in decode's memory by then.
    assert marks["chunk_sent"] < marks["last_step"], marks


def test_decode_holds_the_kv_only_once_every_block_landed(cluster, chunked_pair, client):
    send = lambda: client.tokens(chunked_pair, prompt(1400, 6100))  # noqa: E731
    (decode,) = _traced(client, cluster, "chunked_decode", send)
    marks = decode["marks"]
    assert marks["kv_ready"] <= marks["landed"] <= marks["scheduled"], marks


def test_requests_abandoned_between_chunks_leave_nothing_held(cluster, chunked_pair, client):
    """A client that gives up while its long prompt is computed chunk by chunk: the
    router drops both legs, prefill aborts between chunks (a chunk's WRITE may still
    read the blocks), and both instances end with nothing in flight. Prefill takes a
    tenth of a second here, so the client gives up sooner and sooner until once it
    did so between a chunk crossing and the last step. How soon is sooner depends on
    the machine: the client's patience is a growing share of how long the same
    request takes whole here, measured first."""
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    started = time.monotonic()
    client.tokens(chunked_pair, prompt(1900, 6900), max_tokens=1)
    whole = time.monotonic() - started
    caught = []
    for attempt, share in enumerate((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9)):
        tokens, patience = prompt(1900, 7000 + attempt), share * whole

        def give_up(tokens=tokens, patience=patience) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(
                    chunked_pair + "/v1/completions",
                    json={**body, "prompt": tokens},
                    timeout=patience,
                )

        traced = _traced(client, cluster, "chunked_prefill", give_up)
        for name in ("chunked_prefill", "chunked_decode"):
            state = client.wait_drained(cluster.identity_url(name), seconds=60)
            assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
        caught += [
            t for t in traced if "chunk_sent" in t["marks"] and "last_step" not in t["marks"]
        ]
        if caught:
            break
    assert caught, "no client gave up between a chunk crossing and the last step"
    # The pair still serves, with the right answer.
    single = cluster.servers["single"].url
    tokens = prompt(900, 7100)
    assert client.tokens(chunked_pair, tokens) == client.tokens(single, tokens)
