"""The model shapes users deploy, each a tiny random-weight model built on the spot:
MoE (Qwen3-MoE), MLA (DeepSeek-V3), sliding-window attention (Gemma 3, under vLLM's
hybrid KV cache manager: a full-attention and a sliding-window KV cache group),
hybrid linear attention (Qwen3-Next: gated DeltaNet layers, whose recurrent state
moves beside the full-attention KV) and an FP8 KV cache. For each, a plain instance,
a kvpush prefill and a kvpush decode behind `kvpush router`: answers equal the plain
instance's (up to bf16 ties, for the one model whose CPU kernels run only in bf16),
every prompt token's KV arrives by transfer, nothing is held."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from conftest import DECODE_TIMERS, PREFILL_TIMERS, Client, prompt

from kvpush.demo.servers import MODEL_NAME
from kvpush.demo.tinymodel import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

# vLLM's CPU rotary kernel rotates MLA's strided query/key slices wrongly when its
# custom op runs (every --enforce-eager server): plain and P/D instances then differ
# from the model and from each other (docs/compatibility.md). Its own Python rotary
# is right, so these servers run that one.
NATIVE_ROPE = ("--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}))
# On a CPU with AMX, vLLM picks its AMX MLA kernels, which take bf16 weights only: a
# float32 model fails to load. The reference CPU MLA backend runs on every CPU.
MLA_BACKEND = ("--attention-backend", "CPU_MLA")
MODELS = {  # name: (architecture, extra vLLM arguments for every server)
    "moe": ("qwen3_moe", ()),
    "mla": ("deepseek_v3", NATIVE_ROPE + MLA_BACKEND),
    # Two KV cache groups; the sliding layers keep only their window's blocks.
    "sliding": ("gemma3_text", ()),
    "sliding-pull": ("gemma3_text", ()),
    "fp8-kv": ("llama", ("--kv-cache-dtype", "fp8")),
    # A full-attention group and three of recurrent state; vLLM's CPU kernel for gated
    # DeltaNet runs in bf16 only.
    "gdn": ("qwen3_next", ("--dtype", "bfloat16")),
}
MODES = {"sliding-pull": "pull"}  # the rest push
# vLLM's CPU attention keeps an FP8 cache only with AVX-512 or AMX (cpu_attn.py); on
# other CPUs every server of that shape, a plain one too, refuses to start.
NEEDS_ISA = {"fp8-kv"}
# What a P/D instance's log must say (role: words), and must not, per model.
SLIDING_SAYS = {"prefill": "window_margin", "decode": "KV cache groups: 2"}
SLIDING_NEVER = ("Turning off hybrid kv cache manager", "freed window blocks")
LOG_SAYS = {"sliding": SLIDING_SAYS, "sliding-pull": SLIDING_SAYS,
            "gdn": {"decode": "KV cache groups: 4"}}  # fmt: skip
LOG_NEVER = {"sliding": SLIDING_NEVER, "sliding-pull": SLIDING_NEVER,
             "gdn": ("freed window blocks",)}  # fmt: skip
EXTERNAL = 'source="external_kv_transfer"'
# vLLM's CPU gated-DeltaNet kernel keeps the recurrent state in bf16, and a P/D decode
# starts from the state after all but the last prompt token: rounded once more than
# a plain instance's, which computes the prompt in one piece. A tiny random model's
# next-token distributions are nearly flat, so that flips greedy picks where two
# tokens tie to a few hundredths of a nat. Such a model's answers are compared token
# by token up to the first tie, where one instance must rate the other's pick within
# TIE nats of its own; every pick's logprob must agree within TIE. The rounding is
# the CPU's: most picks agree within 0.06 nats, but on a CPU with AMX (bf16 matrix
# tiles) one step of 84 was 0.14 apart, the next back within 0.02.
TIED = {"gdn"}
TIE = 0.2


class PlainInstance:
    """The plain instance for the shape under test. Shapes that differ only in kvpush's
    mode (sliding, sliding-pull, next to each other in MODELS) share one: a vLLM start
    fewer. Another model's stops it."""

    def __init__(self, workspace) -> None:
        self.workspace, self.name, self.serves = workspace, "", ("", ())

    def use(self, architecture: str, extra_args: tuple[str, ...], model) -> list[str]:
        """Make it this shape's; the servers to start (none if it answers already)."""
        shape = (architecture, extra_args)
        if self.serves == shape and self.workspace.servers[self.name].healthy():
            return []
        self.stop()
        self.name, self.serves = f"{architecture}_single", shape
        server = self.workspace.add_server(self.name, None, core=1, model=model)
        server.spec.extra_args = list(extra_args)
        return [self.name]

    @property
    def url(self) -> str:
        return self.workspace.servers[self.name].url

    def stop(self) -> None:
        if self.name in self.workspace.servers:
            self.workspace.servers.pop(self.name).stop()
        self.name, self.serves = "", ("", ())


@pytest.fixture(scope="module")
def plain_instance(workspace) -> Iterator[PlainInstance]:
    plain = PlainInstance(workspace)
    yield plain
    plain.stop()


@pytest.fixture(scope="module", params=list(MODELS))
def model_trio(request, workspace, plain_instance):
    """For one model shape, a kvpush prefill and decode behind the router, and the
    plain instance: its name, the router's URL and the plain instance's."""
    name = request.param
    if name in NEEDS_ISA and not _cpu_has_fp8_kv_kernels():
        pytest.skip("this CPU has neither AVX-512 nor AMX: vLLM's CPU build keeps no FP8 KV")
    architecture, extra_args = MODELS[name]
    mode = MODES.get(name, "push")
    path = build_tiny_model(workspace.workdir / f"model-{architecture}", architecture=architecture)
    servers = {
        f"{name}_prefill": ("kv_producer", 0, PREFILL_TIMERS),
        f"{name}_decode": ("kv_consumer", 1, DECODE_TIMERS),
    }
    for server, (role, core, timers) in servers.items():
        workspace.add_server(server, role, core=core, mode=mode, model=path, **timers)
        workspace.servers[server].spec.extra_args = list(extra_args)
    try:
        workspace.start(*plain_instance.use(architecture, extra_args, path), *servers)
        prefill, decode = [f"{name}_prefill"], [f"{name}_decode"]
        router = workspace.start_router(prefill, decode, mode=mode, name=name)
        yield name, router, plain_instance.url
    finally:
        workspace.stop_router(name)
        for server in servers:
            workspace.servers.pop(server).stop()


def _cpu_has_fp8_kv_kernels() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def _external(client: Client, url: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.http.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and EXTERNAL in line
    )


def _picks(client: Client, url: str, tokens: list[int]) -> list[tuple[int, dict[int, float]]]:
    """Each generated token with the top logprobs at its position (its own among them)."""
    response = client.complete(url, tokens, 12, logprobs=20, return_tokens_as_token_ids=True)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    return [
        (token, {int(k.rsplit(":", 1)[1]): v for k, v in top.items()})
        for token, top in zip(choice["token_ids"], tops, strict=True)
    ]


def _agree_up_to_a_tie(ours: list, plain: list) -> bool:
    """Whether the answers are equal; if not, they part only at a tie (TIE)."""
    for position, ((mine, my_top), (theirs, their_top)) in enumerate(zip(ours, plain, strict=True)):
        assert abs(my_top[mine] - their_top[theirs]) < TIE, (position, my_top, their_top)
        if mine != theirs:
            # Tied in either instance's eyes: the other's pick within TIE of its own.
            tied = [top[a] - top[b] < TIE for top, a, b in ((their_top, theirs, mine),
                    (my_top, mine, theirs)) if b in top]  # fmt: skip
            assert any(tied), (position, mine, theirs, my_top, their_top)
            return False
    return True


def test_the_model_answers_as_its_plain_instance_from_transferred_kv(workspace, client, model_trio):
    name, router, single = model_trio
    decode = workspace.servers[f"{name}_decode"].url
    # 383 and 511: the first token of the last token's window (N - 256) is the last
    # of its 128-token block, the block vLLM frees first on a prefill.
    lengths = (2, 17, 129, 300, 383, 511, 600)
    prompts = [prompt(n, 12000 + i) for i, n in enumerate(lengths)]
    before = _external(client, decode), client.metric(decode, "vllm:kvpush_delivered_total")
    if name in TIED:
        whole = [_agree_up_to_a_tie(_picks(client, router, p), _picks(client, single, p))
                 for p in prompts]  # fmt: skip
        print(f"{name}: {sum(whole)} of {len(prompts)} answers equal to the plain instance's")
        # 5 (AVX2) or 6 (AMX) of 7 here; with the state not moved, none was.
        assert sum(whole) >= 3, f"only {sum(whole)} answers equal the plain instance's"
    else:
        got = [client.tokens(router, p) for p in prompts]
        assert got == [client.tokens(single, p) for p in prompts]
    deadline = time.monotonic() + 10  # decode's counters ride on its engine's steps
    while client.metric(decode, "vllm:kvpush_delivered_total") < before[1] + len(prompts):
        assert time.monotonic() < deadline, "decode did not receive every prompt's KV"
        time.sleep(0.2)
    # A sliding-window or recurrent model's decode computes each prompt's last token.
    computed_here = len(lengths) if name.startswith("sliding") or name in TIED else 0
    assert _external(client, decode) - before[0] == sum(lengths) - computed_here
    for server in ("prefill", "decode"):
        state = client.wait_drained(workspace.identity_url(f"{name}_{server}"))
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (server, state)
        log = workspace.servers[f"{name}_{server}"].log_path.read_text(errors="replace")
        says = LOG_SAYS.get(name, {}).get(server)
        assert says is None or says in log, (server, says)
        for never in LOG_NEVER.get(name, ()):
            assert never not in log, (server, never)
    if name in TIED:
        # Its prefill leg stops before the last prompt token, so a streaming client's
        # first token comes from decode: the stream is the answer, not prefill's pick.
        body = {"model": MODEL_NAME, "prompt": prompts[3], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        answer = client.http.post(router + "/v1/completions", json=body).json()
        unusable = client.metric(router, "kvpush_first_token_unusable_total")
        assert client.stream_text(router, "/v1/completions", body) == answer["choices"][0]["text"]
        assert client.metric(router, "kvpush_first_token_unusable_total") == unusable + 1
