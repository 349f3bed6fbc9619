"""The model shapes users deploy, each a tiny random-weight model built on the spot:
MoE (Qwen3-MoE), MLA (DeepSeek-V3), sliding-window attention (Gemma 3, under vLLM's
hybrid KV cache manager: a full-attention and a sliding-window KV cache group) and an
FP8 KV cache. For each, a plain instance, a kvpush prefill and a kvpush decode behind
`kvpush router`: answers equal the plain instance's, every prompt token's KV arrives
by transfer, nothing is held."""

from __future__ import annotations

import json
import time

import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt

from kvpush.demo.tinymodel import build_tiny_model
from kvpush.errors import KVPushError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

# vLLM's CPU rotary kernel rotates MLA's strided query/key slices wrongly when its
# custom op runs (every --enforce-eager server): plain and P/D instances then differ
# from the model and from each other (docs/compatibility.md). Its own Python rotary
# is right, so these servers run that one.
NATIVE_ROPE = ("--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}))
MODELS = {  # name: (architecture, extra vLLM arguments for every server)
    "moe": ("qwen3_moe", ()),
    "mla": ("deepseek_v3", NATIVE_ROPE),
    # Two KV cache groups; the sliding layers keep only their window's blocks.
    "sliding": ("gemma3_text", ()),
    "sliding-pull": ("gemma3_text", ()),
    "fp8-kv": ("llama", ("--kv-cache-dtype", "fp8")),
}
MODES = {"sliding-pull": "pull"}  # the rest push
# What a P/D instance's log must say (role: words), and must not, per model.
SLIDING_SAYS = {"prefill": "window_margin", "decode": "KV cache groups: 2"}
SLIDING_NEVER = ("Turning off hybrid kv cache manager", "freed window blocks")
LOG_SAYS = {"sliding": SLIDING_SAYS, "sliding-pull": SLIDING_SAYS}
LOG_NEVER = {"sliding": SLIDING_NEVER, "sliding-pull": SLIDING_NEVER}
EXTERNAL = 'source="external_kv_transfer"'


@pytest.fixture(scope="module", params=list(MODELS))
def model_trio(request, cluster):
    """A plain instance, a prefill and a decode for one model shape; the router's URL."""
    name = request.param
    architecture, extra_args = MODELS[name]
    mode = MODES.get(name, "push")
    path = build_tiny_model(cluster.workdir / f"model-{name}", architecture=architecture)
    servers = {
        f"{name}_single": (None, 1, {}),
        f"{name}_prefill": ("kv_producer", 0, PREFILL_TIMERS),
        f"{name}_decode": ("kv_consumer", 1, DECODE_TIMERS),
    }
    for server, (role, core, timers) in servers.items():
        cluster.add_server(server, role, core=core, mode=mode, model=path, **timers)
        cluster.servers[server].spec.extra_args = list(extra_args)
    try:
        cluster.start(*servers)
        prefill, decode = [f"{name}_prefill"], [f"{name}_decode"]
        router = cluster.start_router(prefill, decode, mode=mode, name=name)
        yield name, router
    finally:
        cluster.stop_router(name)
        for server in servers:
            cluster.servers.pop(server).stop()


def _external(client: Client, url: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.http.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and EXTERNAL in line
    )


def test_the_model_answers_as_its_plain_instance_from_transferred_kv(cluster, client, model_trio):
    name, router = model_trio
    single, decode = (cluster.servers[f"{name}_{s}"].url for s in ("single", "decode"))
    # 383 and 511: the first token of the last token's window (N - 256) is the last
    # of its 128-token block, the block vLLM frees first on a prefill.
    lengths = (2, 17, 129, 300, 383, 511, 600)
    prompts = [prompt(n, 12000 + i) for i, n in enumerate(lengths)]
    before = _external(client, decode), client.metric(decode, "vllm:kvpush_delivered_total")
    got = [client.tokens(router, p) for p in prompts]
    assert got == [client.tokens(single, p) for p in prompts]
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(decode, "vllm:kvpush_delivered_total") < before[1] + len(prompts):
        assert time.monotonic() < deadline, "decode did not receive every prompt's KV"
        time.sleep(0.2)
    # A sliding-window model's decode computes each prompt's last token itself.
    computed_here = len(lengths) if name.startswith("sliding") else 0
    assert _external(client, decode) - before[0] == sum(lengths) - computed_here
    for server in ("prefill", "decode"):
        state = client.wait_drained(cluster.identity_url(f"{name}_{server}"))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (server, state)
        log = cluster.servers[f"{name}_{server}"].log_path.read_text(errors="replace")
        says = LOG_SAYS.get(name, {}).get(server)
        assert says is None or says in log, (server, says)
        for never in LOG_NEVER.get(name, ()):
            assert never not in log, (server, never)


def test_a_hybrid_linear_attention_model_is_refused_at_start_naming_why(cluster):
    """Qwen3-Next's gated DeltaNet layers keep recurrent state, not KV blocks, which
    kvpush does not move: the instance must not start, and its log must name the
    group it cannot move."""
    path = build_tiny_model(cluster.workdir / "model-gdn", architecture="qwen3_next")
    cluster.add_server("gdn_prefill", "kv_producer", core=0, model=path, **PREFILL_TIMERS)
    server = cluster.servers["gdn_prefill"]
    try:
        with pytest.raises(KVPushError, match="exited"):
            cluster.start("gdn_prefill", timeout=300)
        log = server.log_path.read_text(errors="replace")
        assert "is not attention KV" in log
        assert "gated DeltaNet" in log
    finally:
        cluster.servers.pop("gdn_prefill").stop()
