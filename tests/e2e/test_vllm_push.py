"""kvpush in real vLLM: router + 1 prefill + 1 decode against a plain instance.

Greedy fp32 output through the pair must equal the plain instance's, token for
token; a prefill with other K/V weights must change decode's answer (so decode
really used the pushed KV); failures must end in errors, never hangs, and leave no
block held on either side.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import (
    PREFILL_TIMERS,
    WRONG_KV,
    Client,
    assert_request_shapes_match,
    assert_shared_prefixes_match,
    assert_streams_match,
    assert_unseeded_stream_is_decodes_own,
    perturbed_copy,
    prompt,
    routed,
    streamed,
)

from kvpush.bench.cpu import tree_cpu_seconds
from kvpush.demo.servers import MODEL_NAME
from kvpush.ports import free_port
from kvpush.protocol.config import ProtocolConfig

# Servers take minutes to start on 2 cores; the first test pays for the session.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

# 1 token to several 128-token blocks, including every block edge.
LENGTHS = [1, 2, 5, 17, 64, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 450, 511,
           512, 513, 600, 700]  # fmt: skip


def _both_drained(cluster, client: Client, seconds: float = 30.0) -> None:
    for name in ("prefill", "decode"):
        state = client.wait_drained(cluster.identity_url(name), seconds)
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


def test_outputs_equal_a_single_instance(cluster, router, client):
    single = cluster.servers["single"].url
    expected = {n: client.tokens(single, prompt(n, n)) for n in LENGTHS}
    with cf.ThreadPoolExecutor(4) as pool:
        got = dict(zip(LENGTHS, pool.map(lambda n: client.tokens(router, prompt(n, n)), LENGTHS),
                       strict=True))  # fmt: skip
    mismatched = [n for n in LENGTHS if got[n] != expected[n]]
    assert not mismatched, f"prompt lengths whose output differs: {mismatched}"
    _both_drained(cluster, client)


def test_n_list_prompts_min_tokens_and_logprobs_equal_a_single_instance(cluster, router, client):
    assert_request_shapes_match(client, cluster.servers["single"].url, router)
    _both_drained(cluster, client)


def test_prompts_sharing_a_prefix_cached_on_decode_equal_a_single_instance(cluster, router, client):
    assert_shared_prefixes_match(client, cluster.servers["single"].url, router, seed=300)
    _both_drained(cluster, client)


def test_prefills_lookups_for_legs_are_counted_as_vllm_counts_its_own(cluster, router, client):
    """Every request prefill serves here is a leg, so kvpush's count of the legs'
    prefix-cache lookups must equal vLLM's counters: what the fleet bench subtracts to
    tell a decode's hits from a prefill leg's. A prompt sent twice hits the second time."""
    prefill = cluster.servers["prefill"].url
    legs = "vllm:kvpush_prefill_leg_prefix_tokens_total"

    def counts() -> tuple[float, ...]:
        return (client.metric(prefill, "vllm:prefix_cache_queries_total"),
                client.metric(prefill, "vllm:prefix_cache_hits_total"),
                client.metric(prefill, legs, 'reason="queried"'),
                client.metric(prefill, legs, 'reason="hit"'))  # fmt: skip

    before = counts()
    tokens = prompt(600, seed=4242)
    for _ in range(2):
        client.tokens(router, tokens)
    deadline = time.monotonic() + 15
    while (delta := [a - b for a, b in zip(counts(), before, strict=True)])[2] < 1200:
        assert time.monotonic() < deadline, delta
        time.sleep(0.2)
    queries, hits, leg_queries, leg_hits = delta
    assert queries == leg_queries == 1200, delta
    assert hits == leg_hits >= 512, delta  # the second send found 4 of its blocks
    _both_drained(cluster, client)


def test_streaming_and_chat_equal_a_single_instance(cluster, router, client):
    single = cluster.servers["single"].url
    for n in (3, 130, 400):
        body = {"model": MODEL_NAME, "prompt": prompt(n, 7), "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        assert client.stream_text(router, "/v1/completions", body) == client.stream_text(
            single, "/v1/completions", body
        )
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "push the kv cache"}],
            "max_tokens": 10, "temperature": 0}  # fmt: skip
    for stream in (False, True):
        if stream:
            ours = client.stream_text(router, "/v1/chat/completions", chat)
            theirs = client.stream_text(single, "/v1/chat/completions", chat)
        else:
            ours, theirs = (
                client.http.post(url + "/v1/chat/completions", json=chat).json()["choices"][0][
                    "message"
                ]["content"]
                for url in (router, single)
            )
        assert ours == theirs and ours
    models = client.http.get(router + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME


def test_every_streamed_shape_takes_its_first_token_from_prefill_and_equals_a_single_instance(
    cluster, router, client
):
    single = cluster.servers["single"].url
    before = client.metric(router, "kvpush_first_token_unusable_total")
    assert_streams_match(client, single, router, seed=500)
    assert_unseeded_stream_is_decodes_own(client, router)
    assert client.metric(router, "kvpush_first_token_unusable_total") == before
    # Three shapes end at their first token: decode's legs were read to their end.
    assert client.metric(router, "kvpush_decode_legs_drained_total") >= 3
    assert client.metric(router, "kvpush_first_token_divergences_total") == 0
    _both_drained(cluster, client)


def _a_diverged_first_token_is_continued_from(cluster, router, client) -> None:
    """Prefill's other weights sample another first token than decode: the client
    has prefill's, so the stream goes on from it (decode's continuation of prompt
    plus that token), never from decode's own first token."""
    other = cluster.servers["prefill_other_kv"].url
    decode = cluster.servers["decode"].url
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    diverged = 0
    for n in (256, 384, 512):
        tokens = prompt(n, 3000 + n)
        before = client.metric(router, "kvpush_first_token_divergences_total")
        ids = streamed(client, router, "/v1/completions", {**body, "prompt": tokens, **WRONG_KV})
        ids = ids["choices"][0]["ids"]
        assert len(ids) == 6 and ids[0] == client.tokens(other, tokens, 1, **WRONG_KV)[0]
        if client.metric(router, "kvpush_first_token_divergences_total") > before:
            diverged += 1
            # Salted alike: decode's cached prompt is the other weights' KV it was pushed.
            assert ids[1:] == client.tokens(decode, tokens + ids[:1], 5, **WRONG_KV)
    assert diverged, "no first token diverged: the continuation went untested"


@pytest.fixture
def other_kv_router(cluster):
    """A router in front of a prefill whose K/V weights differ, and the same decode."""
    # Its head differs too: its first tokens are not decode's (the continuation test).
    wrong = perturbed_copy(cluster.model, cluster.workdir / "model-other-kv", head=True)
    cluster.add_server("prefill_other_kv", "kv_both", core=0, model=wrong, **PREFILL_TIMERS)
    with routed(cluster, ["prefill_other_kv"], ["prefill_other_kv"], ["decode"], "other") as url:
        yield url


def test_prefill_with_other_kv_weights_changes_decode_output(
    cluster, other_kv_router, router, client
):
    single = cluster.servers["single"].url
    spanning = [129, 256, 300, 450, 600]
    # Fresh prompts: decode must not hold their prefix in its own cache already.
    wrong = {n: client.tokens(other_kv_router, prompt(n, 1000 + n), **WRONG_KV) for n in spanning}
    right = {n: client.tokens(single, prompt(n, 1000 + n)) for n in spanning}
    changed = [n for n in spanning if wrong[n] != right[n]]
    assert changed == spanning, (
        f"decode ignored the pushed KV for lengths {set(spanning) - set(changed)}"
    )
    # The router gave both legs the cache salt: decode keeps the wrong KV apart.
    unsalted = {n: client.tokens(router, prompt(n, 1000 + n)) for n in spanning}
    assert unsalted == right, "a salted request's KV was found by an unsalted one"
    _a_diverged_first_token_is_continued_from(cluster, other_kv_router, client)
    # The same through sequential legs with no transfer id (the prefill instance names it).
    other = cluster.servers["prefill_other_kv"].url
    tokens = prompt(300, 2500)
    _, got = client.sequential(other, cluster.servers["decode"].url, tokens, **WRONG_KV)
    assert got != client.tokens(single, tokens), "decode ignored the KV the sequential legs moved"


def test_a_sequential_orchestrator_without_transfer_ids_moves_the_kv(cluster, client):
    """Upstream NixlConnector's prefill shape, answer forwarded to decode: the prefill
    instance names the transfer, and decode loads the KV instead of recomputing."""
    prefill, decode = cluster.servers["prefill"].url, cluster.servers["decode"].url
    single = cluster.servers["single"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    recomputed = client.metric(decode, "vllm:kvpush_local_recomputes_total")
    lengths = (129, 300, 600)
    for n in lengths:
        echo, tokens = client.sequential(prefill, decode, prompt(n, 2000 + n))
        assert echo["transfer_id"].startswith("cmpl-") and echo["transfer_mode"] == "push"
        assert tokens == client.tokens(single, prompt(n, 2000 + n)), n
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + len(lengths)
    assert client.metric(decode, "vllm:kvpush_local_recomputes_total") == recomputed
    _both_drained(cluster, client)


def test_a_mooncake_mode_router_sends_both_legs_at_once_and_the_kv_is_pushed(cluster, client):
    """What llm-d's and vllm-router's mooncake modes do: learn the prefill engine id from
    its bootstrap GET /query, then send both legs at once, decode naming only the
    bootstrap server."""
    spec = cluster.servers["prefill"].spec.kv_transfer_config["kv_connector_extra_config"]
    bootstrap = f"http://127.0.0.1:{spec['bootstrap_port']}"
    (entry,) = client.http.get(bootstrap + "/query").json().values()
    prefill, decode = cluster.servers["prefill"].url, cluster.servers["decode"].url
    delivered = client.metric(decode, "vllm:kvpush_delivered_total")
    tokens = prompt(450, 2700)
    legs = {
        prefill: {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-mc1"},
        decode: {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-mc1",
                 "remote_engine_id": entry["engine_id"], "remote_bootstrap_addr": bootstrap},
    }  # fmt: skip

    def send(url: str):
        return client.complete(
            url, tokens, 1 if url == prefill else 12, kv_transfer_params=legs[url]
        )

    with cf.ThreadPoolExecutor(2) as pool:
        answers = dict(zip(legs, pool.map(send, legs), strict=True))
    assert answers[prefill].status_code == 200, answers[prefill].text
    assert answers[decode].status_code == 200, answers[decode].text
    got = answers[decode].json()["choices"][0]["token_ids"]
    assert got == client.tokens(cluster.servers["single"].url, tokens)
    assert client.metric(decode, "vllm:kvpush_delivered_total") == delivered + 1
    _both_drained(cluster, client)


def test_32_concurrent_requests_all_correct_and_nothing_leaks(cluster, router, client):
    single = cluster.servers["single"].url
    lengths = [(i * 53) % 600 + 1 for i in range(32)]
    expected = [client.tokens(single, prompt(n, i)) for i, n in enumerate(lengths)]
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(
            pool.map(lambda a: client.tokens(router, prompt(a[1], a[0])), enumerate(lengths))
        )
    assert got == expected
    _both_drained(cluster, client)
    metrics = client.http.get(router + "/metrics").text
    assert 'kvpush_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def test_load_failure_recompute_policy_still_answers_correctly(cluster, client):
    """A decode leg whose KV never comes: the watchdog fails the load, vLLM recomputes."""
    decode = cluster.servers["decode"]
    identity = client.http.get(cluster.identity_url("prefill") + "/query").json()
    tokens = prompt(300, 99)
    params = {
        "do_remote_prefill": True, "transfer_id": "xfer-nobody-prefills-this",
        "transfer_mode": "push", "remote_engine_id": identity["engine_id"],
        "remote_epoch": identity["epoch"], "remote_addresses": identity["addresses"],
        "tp_size": identity["tp_size"],
    }  # fmt: skip
    before = client.metric(decode.url, "vllm:kvpush_failed_total")
    started = time.monotonic()
    response = client.complete(decode.url, tokens, kv_transfer_params=params)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == client.tokens(
        cluster.servers["single"].url, tokens
    )
    assert time.monotonic() - started < 60  # the watchdog, not a hang
    assert client.metric(decode.url, "vllm:kvpush_failed_total") == before + 1
    _both_drained(cluster, client)


def test_kv_transfer_params_from_a_nixl_connector_are_refused_clearly(cluster, client):
    decode = cluster.servers["decode"]
    upstream_params = {  # what an upstream NixlConnector prefill hands its router
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
        "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1, "transfer_mode": "pull",
    }  # fmt: skip
    response = client.complete(decode.url, prompt(20), kv_transfer_params=upstream_params)
    assert response.status_code == 200  # policy "recompute": answered from local compute
    assert "cannot pair with it" in decode.log_tail(400)


def test_client_disconnect_aborts_both_legs_and_frees_blocks(cluster, router, client):
    body = {"model": MODEL_NAME, "prompt": prompt(500, 5), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", router + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())  # decode is generating; now walk away
    _both_drained(cluster, client)
    assert client.tokens(router, prompt(40, 1)) == client.tokens(
        cluster.servers["single"].url, prompt(40, 1)
    )


class HeldDial:
    """A relay to a side channel that takes a dial at once but passes nothing either
    way until opened: a session that is still pairing, for as long as a test likes."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.dialled = threading.Event()
        self.opened = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        with contextlib.suppress(OSError):
            near, _ = self.listener.accept()
            self.sockets.append(near)
            self.dialled.set()
            self.opened.wait()
            far = socket.create_connection(self.target)
            self.sockets.append(far)
            threading.Thread(target=self._pump, args=(far, near), daemon=True).start()
            self._pump(near, far)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@contextlib.contextmanager
def held_dial(target: str) -> Iterator[HeldDial]:
    relay = HeldDial(target)
    try:
        yield relay
    finally:
        relay.close()


def test_a_decode_leg_given_up_while_its_session_pairs_frees_prefills_kv_at_once(cluster, client):
    """Prefill answered the leg's first token and holds the KV for decode; the decode
    leg ends (its client gone) while decode's side channel to prefill is still pairing,
    as for its first request to this prefill or the first after a restart. Nothing
    was claimed or announced, so prefill would keep the KV its whole lease (60 s): it
    lets go as soon as the session is up, and counts it."""
    prefill, decode = cluster.servers["prefill"].url, cluster.servers["decode"]
    identity = client.http.get(cluster.identity_url("prefill") + "/query").json()
    (address,) = identity["addresses"]
    tokens, transfer_id = prompt(300, 1300), f"xfer-given-up-{time.time_ns()}"
    before = client.metric(prefill, "vllm:kvpush_orphaned_total")
    leg = {"do_remote_decode": True, "transfer_id": transfer_id}
    assert client.complete(prefill, tokens, max_tokens=1, kv_transfer_params=leg).status_code == 200
    assert client.state(cluster.identity_url("prefill"))["sending"] >= 1
    with held_dial(address) as relay:
        params = {
            "do_remote_prefill": True, "transfer_id": transfer_id, "transfer_mode": "push",
            "remote_engine_id": identity["engine_id"], "remote_epoch": identity["epoch"],
            "remote_addresses": [relay.address], "tp_size": identity["tp_size"],
        }  # fmt: skip
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 12, "temperature": 0,
                "stream": True, "kv_transfer_params": params}  # fmt: skip
        payload = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: decode\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n")  # fmt: skip
        decode_state = cluster.identity_url("decode")
        host, port = decode.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as leg_socket:
            leg_socket.sendall(head.encode() + payload)
            assert relay.dialled.wait(30), "decode never dialled the producer it was named"
            deadline = time.monotonic() + 30
            while client.state(decode_state)["receiving"] < 1:  # blocks allocated, not claimed
                assert time.monotonic() < deadline, client.state_detail(decode_state)
                time.sleep(0.05)
        # The client left: vLLM aborts the leg, and decode frees its blocks at once.
        assert client.wait_drained(decode_state, 30)["receiving"] == 0
        relay.opened.set()  # the session pairs now
        started = time.monotonic()
        state = client.wait_drained(cluster.identity_url("prefill"), 15)  # lease_s is 60
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, state
        print(f"prefill let go {time.monotonic() - started:.2f} s after the session opened")
    deadline = time.monotonic() + 10
    while client.metric(prefill, "vllm:kvpush_orphaned_total") < before + 1:
        assert time.monotonic() < deadline, "the release was not counted"
        time.sleep(0.2)
    assert 'reason="decode_cancelled"' in client.http.get(prefill + "/metrics").text
    _both_drained(cluster, client)


def test_a_decode_leg_decode_refuses_has_prefills_kv_released_at_once(cluster, router, client):
    """A stream asking for more tokens than decode's max_model_len. On the first-token
    path prefill's leg asks for one token, so prefill takes it and computes the
    prompt's KV, while decode's API refuses its leg (400) before its engine ever sees
    it: no decode will claim that KV, and nothing but the router knows. The router
    hands back the release token of prefill's answer, and prefill lets the KV go at
    once, not after lease_s (60 s)."""
    prefill, prefill_state = cluster.servers["prefill"].url, cluster.identity_url("prefill")
    released = ("vllm:kvpush_orphaned_total", 'reason="router_released"')
    routed = ("kvpush_prefill_releases_total", 'outcome="released"')
    _both_drained(cluster, client)
    before, routed_before = client.metric(prefill, *released), client.metric(router, *routed)
    body = {"model": MODEL_NAME, "prompt": prompt(400, 4100), "max_tokens": 10**6,
            "temperature": 0, "stream": True}  # fmt: skip
    answer = client.http.post(router + "/v1/completions", json=body)
    # Decode's refusal, as a status (or as an error event after prefill's token).
    assert "max_model_len" in answer.text or "context length" in answer.text, answer.text
    assert "release_token" not in answer.text
    started = time.monotonic()
    state = client.wait_drained(prefill_state, 15)
    assert state == {"sending": 0, "producing": 0, "receiving": 0}, state
    print(f"prefill let go within {time.monotonic() - started:.2f} s of the refusal")
    deadline = time.monotonic() + 10
    while client.metric(prefill, *released) < before + 1:
        assert time.monotonic() < deadline, "prefill never counted the release"
        time.sleep(0.2)
    assert client.metric(prefill, *released) == before + 1  # its KV was held, and let go
    assert client.metric(router, *routed) == routed_before + 1
    _both_drained(cluster, client)


KILL_ATTEMPTS = 3


def _in_flight_while(client, router, action, ready, prompt_len: int, answer: int) -> list:
    """Run `action` once `ready()` says the eight long requests sent meanwhile are
    where the action must find them; their responses (or transport errors), once
    every request is over."""
    responses: list = []

    def send(i: int) -> None:
        try:
            tokens = prompt(prompt_len, 100 + i)
            responses.append(client.complete(router, tokens, max_tokens=answer))
        except httpx.HTTPError as exc:
            responses.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    deadline = started + 120
    while not ready() and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.005)
    print(f"ready after {time.monotonic() - started:.2f}s, {len(responses)} answered")
    action()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    return responses


def _holding(client, url: str, least: int):
    """A `ready` for _in_flight_while: a vLLM server holds at least `least` requests
    (running or waiting) and is computing at least one of them."""

    def ready() -> bool:
        running = client.metric(url, "vllm:num_requests_running")
        return running >= 1 and running + client.metric(url, "vllm:num_requests_waiting") >= least

    return ready


def _is_error(response) -> bool:
    return (
        isinstance(response, httpx.Response)
        and response.status_code >= 500
        and bool(response.json()["error"]["message"])
    )


def _is_whole_answer(response, answer: int) -> bool:
    """A 200 carrying every token asked for: what a request that ended before the kill
    returns. A 200 cut short by the kill is the defect these tests are for."""
    return (
        isinstance(response, httpx.Response)
        and response.status_code == 200
        and len(response.json()["choices"][0]["token_ids"]) == answer
    )


def _check_killed_run(responses: list, answer: int) -> int:
    """Each request either finished whole or got an error naming what failed; how
    many got an error."""
    for response in responses:
        assert _is_whole_answer(response, answer) or _is_error(response), response
    return sum(_is_error(r) for r in responses)


def _kill_mid_run(cluster, client, router, name: str, least: int, prompt_len: int, answer: int):
    """Kill instance `name` once vLLM's gauges say it computes one of eight requests
    (`prompt_len` tokens, `answer` more) and holds at least `least` of them; restart
    it and again (a bounded number of times) if the kill hit fewer than `least` after
    all: the kill must hit requests, however fast the machine."""
    server = cluster.servers[name]
    for attempt in range(KILL_ATTEMPTS):
        if attempt:
            cluster.start(name)
            server = cluster.servers[name]
        ready = _holding(client, server.url, least)
        responses = _in_flight_while(client, router, server.kill, ready, prompt_len, answer)
        errors = _check_killed_run(responses, answer)
        print(f"kill {attempt + 1} of {name}: {errors} of 8 requests hit")
        if errors >= least:
            return errors
    raise AssertionError(f"{KILL_ATTEMPTS} kills of {name} hit fewer than {least} requests")


def test_prefill_killed_mid_run_errors_then_recovers(cluster, router, client):
    """Prefill dies while it computes long prompts: the legs it had not answered fail
    with an error naming it, the rest answer whole."""
    single = cluster.servers["single"].url
    try:
        _kill_mid_run(cluster, client, router, "prefill", 1, prompt_len=1900, answer=100)
        started = time.monotonic()
        while_dead = client.complete(router, prompt(50, 8))
        assert _is_error(while_dead) and time.monotonic() - started < 30
        state = client.wait_drained(cluster.identity_url("decode"))
        assert state["receiving"] == 0, state
    finally:
        cluster.start("prefill")  # a new incarnation: new epoch, new side-channel port
    assert client.tokens(router, prompt(200, 3)) == client.tokens(single, prompt(200, 3))
    _both_drained(cluster, client)


def test_decode_killed_mid_run_errors_then_recovers(cluster, router, client):
    """Decode dies while it generates and holds at least four of eight requests: each
    of those gets an error naming decode (not a 200 cut short), and prefill holds
    nothing after. KV whose decode leg never reached decode (it was dead by then) is
    let go on the router's word, or, should that word be lost, after prefill's lease;
    what decode announced is let go a few heartbeats after its death."""
    try:
        _kill_mid_run(cluster, client, router, "decode", 4, prompt_len=600, answer=1400)
        lease = ProtocolConfig().lease_s  # the e2e prefill keeps the default
        state = client.wait_drained(cluster.identity_url("prefill"), seconds=lease + 15)
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, state
    finally:
        cluster.start("decode")  # whatever happened: the tests after this one need it
    single = cluster.servers["single"].url
    assert client.tokens(router, prompt(200, 4)) == client.tokens(single, prompt(200, 4))
    _both_drained(cluster, client)


def test_decode_holding_requests_that_wait_for_kv_costs_almost_no_cpu(cluster, client):
    """32 decode legs wait for KV their prefill has not started on. vLLM's engine
    loop would step empty a thousand times a second meanwhile (over a core, measured);
    kvpush sleeps those steps until a transfer ends. Then prefill runs, and every
    request answers as a plain instance does, from the pushed KV."""
    decode = cluster.servers["decode"]
    identity_url = cluster.identity_url("decode")
    identity = client.http.get(cluster.identity_url("prefill") + "/query").json()
    single = cluster.servers["single"].url
    prompts = [prompt(400, 700 + i) for i in range(32)]
    expected = [client.tokens(single, p) for p in prompts]
    delivered_before = client.metric(decode.url, "vllm:kvpush_delivered_total")
    legs = []
    for i in range(len(prompts)):
        params = {
            "do_remote_prefill": True, "transfer_id": f"xfer-waiting-{i}-{time.time_ns()}",
            "transfer_mode": "push", "remote_engine_id": identity["engine_id"],
            "remote_epoch": identity["epoch"], "remote_addresses": identity["addresses"],
            "tp_size": identity["tp_size"],
        }  # fmt: skip
        legs.append(params)
    with cf.ThreadPoolExecutor(2 * len(prompts)) as pool:
        answers = [
            pool.submit(client.complete, decode.url, p, kv_transfer_params=params)
            for p, params in zip(prompts, legs, strict=True)
        ]
        # Every leg in, its blocks allocated, waiting for its KV: then measure.
        deadline = time.monotonic() + 60
        while client.state(identity_url)["receiving"] < len(prompts):
            assert time.monotonic() < deadline, client.state(identity_url)
            time.sleep(0.05)
        landings_before = client.state_detail(identity_url)["landings"]
        before = tree_cpu_seconds(decode.process.pid)
        time.sleep(2.0)
        cores = (tree_cpu_seconds(decode.process.pid) - before) / 2.0
        print(f"decode holding {len(prompts)} requests that wait for KV: {cores:.3f} cores")
        prefill = cluster.servers["prefill"].url
        for p, params in zip(prompts, legs, strict=True):
            leg = {"do_remote_decode": True, "transfer_id": params["transfer_id"]}
            pool.submit(client.complete, prefill, p, max_tokens=1, kv_transfer_params=leg)
        got = [answer.result() for answer in answers]
    assert cores < 0.5, f"decode used {cores:.2f} cores while its requests waited for KV"
    assert [r.json()["choices"][0]["token_ids"] for r in got] == expected
    delivered = client.metric(decode.url, "vllm:kvpush_delivered_total") - delivered_before
    assert delivered == len(prompts), "some requests were recomputed, not pushed"
    _both_drained(cluster, client)
    # What made the wait cheap: vLLM hooks (kvpush.vllm.hooks), each attached.
    hooks = client.http.get(identity_url + "/kvpush/state?detail=1").json()["hooks"]
    for name in ("connector_registry", "engine_inbox", "idle_wait", "step_notify"):
        assert hooks["scheduler"].get(name) == "attached", hooks
    assert hooks["worker0"]["park_workers"] == "attached", hooks
    # Each landing was planned by the schedule() after it (kvpush.vllm.landings), not
    # a step later; one the workers reported first is vLLM's to take, and no landing
    # is taken twice.
    landings = client.state_detail(identity_url)["landings"]
    taken = landings["before_schedule"] - landings_before["before_schedule"]
    by_step = landings["by_step_report"] - landings_before["by_step_report"]
    assert hooks["scheduler"]["landings_before_schedule"] == "attached", hooks
    assert taken >= 1 and taken + by_step == len(prompts), (landings_before, landings)


def test_between_requests_neither_instance_spins(cluster, router, client):
    """vLLM's step and result queues spin for a second after every read; a decode
    answering a request a second would spin a core per worker all the time. With
    reader_spin_s (2 ms) the second after an answer costs almost nothing."""
    pids = {name: cluster.servers[name].process.pid for name in ("prefill", "decode")}
    idle: dict[str, float] = {}
    for attempt in range(2):
        client.tokens(router, prompt(300, 900 + attempt), max_tokens=4)
        before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(1.0)  # vLLM's readers would spin all of it
        for name, pid in pids.items():
            idle[name] = max(idle.get(name, 0.0), tree_cpu_seconds(pid) - before[name])
    print(f"CPU seconds in the second after an answer: {idle}")
    assert all(cores < 0.3 for cores in idle.values()), idle
    for name in ("prefill", "decode"):
        hooks = client.http.get(cluster.identity_url(name) + "/kvpush/state?detail=1").json()
        assert hooks["hooks"]["scheduler"].get("reader_spin") == "attached", hooks["hooks"]
        assert hooks["hooks"]["worker0"].get("reader_spin") == "attached", hooks["hooks"]


def test_spans_say_where_a_requests_time_went_at_the_router_and_both_instances(
    cluster, router, client
):
    assert client.tokens(router, prompt(300, 901)) == client.tokens(
        cluster.servers["single"].url, prompt(300, 901)
    )
    _both_drained(cluster, client)  # prefill's last milestone is its blocks' release
    (trace,) = client.http.get(router + "/kvpush/trace?last=1").json()
    marks = trace["ms_since_received"]
    assert marks["received"] == 0 <= marks["decode_sent"] <= marks["first_byte"] <= marks["done"]
    expected = {"decode": ["queued", "kv_wait", "to_step", "generate"],
                "prefill": ["queued", "compute", "send"]}  # fmt: skip
    for name, phases in expected.items():
        url = cluster.identity_url(name)
        mine = [t for t in client.http.get(url + "/kvpush/trace").json()
                if t["transfer_id"] == trace["transfer_id"]]  # fmt: skip
        assert len(mine) == 1, (name, mine)
        spans = mine[0]["spans_ms"]
        assert list(spans) == phases and all(v >= 0 for v in spans.values()), (name, spans)
        summary = client.http.get(url + "/kvpush/spans").json()
        assert all(summary[f"{name}.{p}"]["count"] >= 1 for p in phases), summary
    metrics = client.http.get(router + "/metrics").text
    assert "kvpush_router_first_byte_seconds_count" in metrics


def test_a_dead_instance_is_failed_over_and_ejected(cluster, client):
    """Half the instances behind this router are gone (nothing listens there): every
    request still answers, from the live pair, and the dead ones are ejected."""
    dead_prefill = f"http://127.0.0.1:{free_port()},bootstrap={free_port()}"
    dead_decode = f"http://127.0.0.1:{free_port()}"
    router = cluster.start_router(
        [dead_prefill, "prefill"], [dead_decode, "decode"], name="failover"
    )
    try:
        single = cluster.servers["single"].url
        for i in range(6):
            assert client.tokens(router, prompt(150, 950 + i)) == client.tokens(
                single, prompt(150, 950 + i)
            )
        metrics = client.http.get(router + "/metrics").text
        assert "kvpush_instance_ejections_total" in metrics
        assert "kvpush_retries_total" in metrics
    finally:
        cluster.stop_router("failover")
    # A prefill leg that finished before its decode leg failed to connect keeps its KV
    # for a decode that never registers: until its lease ends (lease_s, 60 s), no longer.
    _both_drained(cluster, client, seconds=60 + 15)
