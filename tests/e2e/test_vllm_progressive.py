"""Progressive push on real vLLM: with push_granularity "chunk" and a step budget of
96 tokens (3/4 of the CPU backend's 128-token blocks), a long prompt is computed in
many chunks, chunk boundaries fall inside blocks, and each chunk's complete blocks
must cross before the last chunk runs, and still give a plain instance's answer.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import DECODE_TIMERS, Client, extra_pair, prompt

from kvpush.identities import decode_params, parse_identity
from kvpush.router.legs import new_transfer_id, prefill_leg

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


def _decode_leg_first(cluster, client: Client, tokens: list[int], head_start: float) -> None:
    """Both legs of one request sent by hand, decode's first: prefill gets the prompt
    only once decode has allocated its blocks, and `head_start` seconds later, so the
    grant is waiting before the first chunk ends however fast this machine computes."""
    identity = parse_identity(
        client.http.get(cluster.identity_url("chunked_prefill") + "/query").json()
    )
    transfer_id = new_transfer_id()
    decode_identity = cluster.identity_url("chunked_decode")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            client.complete,
            cluster.servers["chunked_decode"].url,
            tokens,
            2,
            kv_transfer_params=decode_params(transfer_id, identity),
        )
        deadline = time.monotonic() + 60
        while not client.state(decode_identity)["receiving"]:
            assert time.monotonic() < deadline, "decode never allocated the request's blocks"
            assert not answer.done(), answer.result().text
            time.sleep(0.02)
        time.sleep(head_start)
        leg = prefill_leg({}, transfer_id)["kv_transfer_params"]
        first = client.complete(
            cluster.servers["chunked_prefill"].url, tokens, 1, kv_transfer_params=leg
        )
        assert first.status_code == 200, first.text
        assert answer.result().status_code == 200, answer.result().text


def test_early_chunks_cross_before_the_last_chunk_runs(cluster, chunked_pair, client):
    """A prompt of many steps whose grant is waiting when prefill starts: an earlier
    chunk's WRITE has completed before prefill schedules the step computing the last
    token, so those bytes were in decode's memory by then. The grant's head start
    grows until that holds once (a slow machine may take a while to send it); the
    prompt is nearly the model's whole context, so the steps after the first chunk
    outlast one WRITE on a fast machine too.

    The negative control is in the same run: a prompt that fits one step has no
    earlier chunk, so nothing may be noted as sent before its last step."""
    (one_step,) = _traced(
        client, cluster, "chunked_prefill", lambda: client.tokens(chunked_pair, prompt(90, 5290))
    )
    assert "last_step" in one_step["marks"] and "chunk_sent" not in one_step["marks"]
    seen = []
    for attempt, head_start in enumerate((0.2, 1.0, 3.0)):
        tokens = prompt(1900, 5300 + attempt)
        send = lambda tokens=tokens, wait=head_start: _decode_leg_first(  # noqa: E731
            cluster, client, tokens, wait
        )
        (many,) = _traced(client, cluster, "chunked_prefill", send)
        marks = many["marks"]
        seen.append(marks)
        if marks.get("chunk_sent", float("inf")) < marks["last_step"]:
            return
    raise AssertionError(f"no earlier chunk crossed before the last step: {seen}")


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
