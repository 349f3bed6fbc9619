"""A streaming client's first token from the prefill leg, on real vLLM, where it is
easiest to get wrong: prompts computed in chunks while other requests sample, stop
strings that begin in the first token, and characters split over tokens.

Every server here computes at most 256 prompt tokens a step
(`--max-num-batched-tokens 256`), the plain instance too, so that the oracle
computes each prompt in the same chunks as the pair does.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator

import pytest
from conftest import Client, prompt, streamed

from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

CHUNK = ["--max-num-batched-tokens", "256"]
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def chunked(workspace: Cluster) -> Iterator[tuple[str, str]]:
    """(router, plain instance): a push pair behind kvpush router, and a plain vLLM."""
    names = ("chunked_single", "chunked_prefill", "chunked_decode")
    workspace.add_server(names[0], None, core=1)
    workspace.add_server(names[1], "kv_producer", core=0)
    workspace.add_server(names[2], "kv_consumer", core=1)
    for name in names:
        workspace.servers[name].spec.extra_args = list(CHUNK)
    try:
        workspace.start(*names)
        router = workspace.start_router([names[1]], [names[2]], name="chunked")
        yield router, workspace.servers[names[0]].url
    finally:
        workspace.stop_router("chunked")
        for name in names:
            workspace.servers.pop(name).stop()


def test_unseeded_sampled_streams_over_chunked_prompts_leave_every_engine_alive(
    workspace, chunked, client
):
    """Four unseeded streams at vLLM's default temperature, prompts of 900-1800 tokens
    computed 256 at a time while the others sample. A seed minted for them killed
    prefill's CPU engine core (its generator cannot rewind); none is minted now."""
    router, single = chunked
    unseeded = {"model": MODEL_NAME, "max_tokens": 8, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
    bodies = [{**unseeded, "prompt": prompt(n, 9000 + n)} for n in (900, 1200, 1500, 1800)]
    for _ in range(2):  # the second round: the router has met prefill, both legs at once
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: streamed(client, router, COMPLETIONS, b), bodies))
        for answer in answers:
            assert not answer["errors"] and len(answer["choices"][0]["ids"]) == 8, answer
    counted = client.metric(router, "kvpush_first_token_from_decode_total")
    assert counted == 2 * len(bodies)
    for name in ("chunked_prefill", "chunked_decode"):
        assert workspace.servers[name].healthy(), f"{name} died: " + (
            workspace.servers[name].log_tail()
        )
    # A greedy stream after them: prefill's first token, equal to the plain instance's.
    greedy = {"model": MODEL_NAME, "prompt": prompt(700, 9100), "max_tokens": 8,
              "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    ours = streamed(client, router, COMPLETIONS, greedy)
    assert ours == streamed(client, single, COMPLETIONS, greedy)
    assert client.metric(router, "kvpush_first_token_from_decode_total") == counted
    _drained(workspace, client)


def _first_two(client: Client, single: str, tokens: list[int]) -> tuple[str, str, int]:
    """A plain instance's greedy first token's text, its first two tokens' text, and
    its second token's id."""
    one = client.complete(single, tokens, max_tokens=1).json()["choices"][0]["text"]
    two = client.complete(single, tokens, max_tokens=2, return_token_ids=True).json()
    return one, two["choices"][0]["text"], two["choices"][0]["token_ids"][1]


def test_stops_that_begin_in_the_first_token_stream_as_a_plain_instance_streams_them(
    workspace, chunked, client
):
    """A stop string made of the first two tokens' text: vLLM holds the first token's
    text back, then cuts it with the stop string, and streams nothing. The router
    had streamed prefill's first token at once. Likewise with the stop string kept
    (`include_stop_str_in_output`), with `min_tokens` past it, and with the second
    token as a stop token."""
    router, single = chunked
    cases = []
    for k in range(40):
        tokens = prompt(300, 9200 + k)
        one, two, second = _first_two(client, single, tokens)
        if one.strip() and len(two) > len(one):
            cases.append((tokens, two, second))
        if len(cases) == 4:
            break
    assert len(cases) == 4, "no prompts whose first token has text"
    wrong = []
    for tokens, stop, second in cases:
        shapes = {
            "stop": {"stop": [stop]},
            "stop kept": {"stop": [stop], "include_stop_str_in_output": True},
            "min_tokens past it": {"stop": [stop], "min_tokens": 3},
            "stop token": {"stop_token_ids": [second]},
        }
        for name, shape in shapes.items():
            body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True, **shape}  # fmt: skip
            ours = streamed(client, router, COMPLETIONS, body)
            theirs = streamed(client, single, COMPLETIONS, body)
            if ours != theirs:
                wrong.append((name, ours, theirs))
            whole = {**body, "stream": False}
            if (
                client.http.post(router + COMPLETIONS, json=whole).json()["choices"]
                != (client.http.post(single + COMPLETIONS, json=whole).json()["choices"])
            ):
                wrong.append((name + ", not streamed", None, None))
    assert not wrong, f"shapes that differ from a plain instance: {wrong}"
    # The case the router got wrong: a plain instance streams nothing for it.
    tokens, stop, _ = cases[0]
    body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 6, "temperature": 0,
            "stop": [stop]}  # fmt: skip
    assert streamed(client, router, COMPLETIONS, body)["choices"][0]["text"] == ""
    _drained(workspace, client)


def _byte_tokens(workspace: Cluster, *values: int) -> list[int]:
    """The ids of single-byte tokens in the tiny model's byte-level vocabulary."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(workspace.model / "tokenizer.json"))
    return [tokenizer.token_to_id(_byte_symbol(v)) for v in values]


def _byte_symbol(value: int) -> str:
    """How a byte-level BPE vocabulary spells byte `value`: printable Latin-1 bytes
    as themselves, the others shifted past 255 in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if value in printable:
        return chr(value)
    return chr(256 + [b for b in range(256) if b not in printable].index(value))


def test_characters_split_over_tokens_stream_as_a_plain_instance_streams_them(
    workspace, chunked, client
):
    """Output limited to the bytes of "é" and "ñ" (0xC3 0xA9, 0xC3 0xB1): where the
    first token is the lead byte, vLLM streams nothing for it and the character with
    the second. The router's stream must be the same, text and ids."""
    router, single = chunked
    lead, *tails = _byte_tokens(workspace, 0xC3, 0xA9, 0xB1)
    assert None not in (lead, *tails), "the tiny model's vocabulary has no byte tokens"
    found = 0
    for k in range(30):
        body = {"model": MODEL_NAME, "prompt": prompt(280, 9300 + k), "max_tokens": 6,
                "temperature": 0, "allowed_token_ids": [lead, *tails],
                "return_token_ids": True}  # fmt: skip
        theirs = streamed(client, single, COMPLETIONS, body)
        split = theirs["choices"][0]["ids"][0] == lead and any(
            c in theirs["choices"][0]["text"] for c in "éñ"
        )
        if not split:
            continue
        found += 1
        ours = streamed(client, router, COMPLETIONS, body)
        assert ours == theirs, (ours, theirs)
        if found == 3:
            break
    assert found, "no prompt whose first token is a lead byte"
    _drained(workspace, client)


def _drained(workspace: Cluster, client: Client) -> None:
    for name in ("chunked_prefill", "chunked_decode"):
        state = client.wait_drained(workspace.identity_url(name), 30)
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)
