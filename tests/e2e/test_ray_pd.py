"""kvpush under Ray Serve LLM's prefill/decode application (kvpush.ray_serve's
`build_pd_app`; Ray's own `build_pd_openai_app` unregistered), on a local Ray cluster:
push mode with kvpush's connector backend (both legs at once), push mode through
Ray's default sequential hand-off (backend not registered), pull mode, and two
prefill and two decode replicas at once. Answers equal a plain instance's, streamed
ones too, whose first token comes from prefill in both modes; every decode request's
KV landed from the prefill that computed it (a silent recompute would answer right
too, and leave no such trace); nothing stays in flight."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from conftest import (
    KV_BLOCKS,
    Client,
    assert_streams_match,
    perturbed_copy,
    prompt,
    streamed,
)

pytest.importorskip("ray.serve.llm", reason="Ray Serve LLM is not installed: pip install -e .[ray]")

import ray
from ray import serve
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory
from ray.serve.llm import build_pd_openai_app

import kvpush.ray_serve
from kvpush.demo.servers import MODEL_NAME
from kvpush.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

LENGTHS = (129, 300, 600)
BURSTS = 4  # of eight concurrent prompts, for Ray to spread over the decode replicas


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with Serve on a free port: Serve's URL."""
    # Ray's socket paths must stay under 107 bytes; its token auth is for clusters
    # users start themselves.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")
    # vLLM's ZeroMQ sockets are files that outlive its engines: in our directory, not
    # /tmp (Ray's processes take the environment ray.init finds).
    sockets = os.path.join(temp, "ipc")
    os.mkdir(sockets)
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = sockets
    # Logical CPUs: each LLM replica takes one for its actor and one for its engine, and
    # the ingress one: two prefill and two decode replicas take nine.
    ray.init(num_cpus=9, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    kvpush.ray_serve.register()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if before is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = before
        shutil.rmtree(temp, ignore_errors=True)


def _llm_config(
    model, role: str, mode: str, core: int, identity_port: int, replicas: int = 1
) -> dict:
    extra = {"mode": mode, "identity_port": identity_port}  # replica r: identity_port + r
    return {
        "model_loading_config": {"model_id": MODEL_NAME, "model_source": str(model)},
        "engine_kwargs": {
            "kv_transfer_config": {"kv_connector": "KVPushConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra},
            "enforce_eager": True, "dtype": "float32", "max_model_len": 2048, "seed": 0,
            "num_gpu_blocks_override": KV_BLOCKS,
        },
        "deployment_config": {"autoscaling_config": {"min_replicas": replicas,
                                                     "max_replicas": replicas}},
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "runtime_env": {"env_vars": {
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_RPC_BASE_PATH": os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()),
            # And its file store for torch.distributed (vllm_dist_*), which a stopped
            # engine leaves behind: in our directory too.
            "TMPDIR": os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()),
        }},
    }  # fmt: skip


def _deploy(
    prefill_model, decode_model, mode: str, prefills: int = 1, decodes: int = 1
) -> dict[str, str]:
    """The P/D application, serving: each instance's identity URL (prefill replicas
    are prefill0, prefill1, ...; a second decode replica is decode1)."""
    prefill_port, decode_port = free_port(span=prefills), free_port(span=decodes)
    config = {
        "prefill_config": _llm_config(prefill_model, "kv_producer", mode, 0, prefill_port,
                                      prefills),
        "decode_config": _llm_config(decode_model, "kv_consumer", mode, 1, decode_port,
                                     decodes),
    }  # fmt: skip
    kvpush.ray_serve.share_secret(config)
    # kvpush's backend binds kvpush on the node's address; without it, loopback.
    registered = KVConnectorBackendFactory.is_registered(kvpush.ray_serve.CONNECTOR)
    # Where kvpush is not registered, users build with Ray's own builder.
    build = kvpush.ray_serve.build_pd_app if registered else build_pd_openai_app
    serve.run(build(config), name="pd", route_prefix="/")
    host = ray.util.get_node_ip_address() if registered else "127.0.0.1"
    identities = {f"prefill{r}": f"http://{host}:{prefill_port + r}" for r in range(prefills)}
    decoders = {"decode" + (str(r) if r else ""): f"http://{host}:{decode_port + r}"
                for r in range(decodes)}  # fmt: skip
    return {**identities, **decoders}


def _answers(client: Client, url: str) -> list[list[int]]:
    return [client.tokens(url, prompt(n, 3300 + n)) for n in LENGTHS]


def _trace(client: Client, identity: str) -> list[dict]:
    return client.http.get(identity + "/kvpush/trace").json()


def _traces(client: Client, identities: dict[str, str]) -> tuple[list[dict], dict[str, dict]]:
    """Every decode replica's recent requests, and every prefill replica's by transfer id."""
    decoded, prefilled = [], {}
    for name, identity in identities.items():
        traces = _trace(client, identity)
        if name.startswith("decode"):
            decoded += traces
        else:
            prefilled.update({t["transfer_id"]: {**t, "replica": name} for t in traces})
    return decoded, prefilled


def _hand_off(client: Client, identities: dict[str, str], concurrent: bool) -> None:
    """Concurrent: kvpush's backend shaped the legs (its transfer ids: decode's leg was
    sent with nothing from prefill's answer). Sequential: Ray's default shape (the
    prefill instance named the transfer) and decode arrived only after prefill had
    computed. Whether a concurrent decode leg arrives before prefill computes is a race
    that a fast machine loses, so only the sequential order, which is causal, is checked."""
    decoded, prefilled = _traces(client, identities)
    assert len(decoded) == len(LENGTHS)
    for trace in decoded:
        assert trace["transfer_id"].startswith("ray-") == concurrent, trace
        if not concurrent:
            computed = prefilled[trace["transfer_id"]]["marks"]["computed"]
            assert trace["marks"]["arrived"] > computed, trace


def _landed(client: Client, identities: dict[str, str]) -> None:
    """Every request a decode replica served started from KV that landed in its blocks
    by transfer; kvpush's negative control (a prefill with other K/V weights changes
    decode's answer) runs outside Ray, in test_vllm_push.py."""
    decoded, _ = _traces(client, identities)
    assert decoded
    for trace in decoded:
        assert {"landed", "scheduled", "finished"} <= trace["marks"].keys(), trace
        assert not trace.get("error"), trace


def _drained(client: Client, identities: dict[str, str]) -> None:
    for name, identity in identities.items():
        state = client.wait_drained(identity)
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


# Push with kvpush's backend is checked with several replicas (below).
@pytest.mark.parametrize("mode", ["push-sequential", "pull"])
def test_ray_pd_application_answers_as_a_plain_instance(
    workspace, single, ray_cluster, client, mode
):
    expected = _answers(client, single)
    if mode == "push-sequential":  # Ray's default backend: NIXL's sequential shape
        KVConnectorBackendFactory.unregister_backend(kvpush.ray_serve.CONNECTOR)
    try:
        url, identities = ray_cluster, _deploy(workspace.model, workspace.model, mode.split("-")[0])
        assert _answers(client, url) == expected
        _drained(client, identities)
        _landed(client, identities)
        if mode != "pull":
            _hand_off(client, identities, concurrent=False)
        else:  # the first token from prefill, though Ray hands off one leg after the other
            assert_streams_match(client, single, url, seed=720)
            _drained(client, identities)
    finally:
        serve.delete("pd")
        kvpush.ray_serve.register()


def test_ray_pd_push_answers_as_a_plain_instance_and_every_replica_serves(
    workspace, single, ray_cluster, client
):
    """Two prefill and two decode replicas: each prefill computes some prompts and each
    decode serves some, every one from KV a prefill replica pushed to it."""
    alone = _answers(client, single)
    prompts = [prompt(150 + 50 * i, 3400 + i) for i in range(8)]
    expected = [client.tokens(single, p) for p in prompts]
    url, identities = ray_cluster, _deploy(workspace.model, workspace.model, "push", 2, 2)
    try:
        # One request at a time first: kvpush's backend sends both legs at once.
        assert _answers(client, url) == alone
        _drained(client, identities)
        _hand_off(client, identities, concurrent=True)
        decoders = [name for name in identities if name.startswith("decode")]
        # Ray's router, not kvpush, picks each request's decode replica: on a loaded
        # machine one replica can lose every queue-length probe for a burst, so bursts
        # repeat (a bounded number) until each decode replica has served one.
        for _ in range(BURSTS):
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: client.tokens(url, p), prompts))
            assert got == expected
            _drained(client, identities)
            idle = [name for name in decoders if not _trace(client, identities[name])]
            if not idle:
                break
        assert not idle, f"{idle} decoded no request in {BURSTS} bursts"
        _, prefilled = _traces(client, identities)
        served = {trace["replica"] for trace in prefilled.values()}
        prefill_replicas = {name for name in identities if name.startswith("prefill")}
        assert served == prefill_replicas, f"only {served} computed any prompt"
        for name in decoders:
            decoded = _trace(client, identities[name])
            # Each of its requests took a transfer prefill computed: the KV moved.
            assert all(t["transfer_id"] in prefilled for t in decoded), name
        _landed(client, identities)
        # Streamed, with the first token from prefill: every shape as a plain instance
        # streams it; an unseeded sampled one is decode's own.
        assert_streams_match(client, single, url, seed=700)
        _unseeded_stream_is_decodes_own(client, url)
        _drained(client, identities)
    finally:
        serve.delete("pd")


def _unseeded_stream_is_decodes_own(client: Client, url: str) -> None:
    """On vLLM's CPU build no seed is minted for an unseeded sampled stream (a CPU
    generator cannot rewind, and a prompt computed in chunks would kill the engine):
    the stream is decode's own, whole."""
    # ignore_eos: unseeded, it may sample EOS early.
    body = {"model": MODEL_NAME, "prompt": prompt(220, 3477), "max_tokens": 10,
            "temperature": 1.0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    ours = streamed(client, url, "/v1/completions", body)
    assert not ours["errors"] and len(ours["choices"][0]["ids"]) == 10


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ray_pd_streams_the_first_token_prefill_sampled(
    workspace, single, ray_cluster, client, mode
):
    """A prefill whose output head differs (its KV is decode's own): where it samples
    another first token than decode would, the client gets prefill's, and the stream
    goes on as a plain instance continues the prompt plus that token."""
    other = perturbed_copy(workspace.model, workspace.workdir / "model-other-head", head=True,
                           kv=False)  # fmt: skip
    url, identities = ray_cluster, _deploy(other, workspace.model, mode)
    try:
        prefills = 0
        for n in (200, 256, 300, 384, 512):
            tokens = prompt(n, 3500 + n)
            body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            ids = streamed(client, url, "/v1/completions", body)["choices"][0]["ids"]
            assert len(ids) == 6 and ids[1:] == client.tokens(single, tokens + ids[:1], 5), n
            prefills += ids[0] != client.tokens(single, tokens, 1)[0]
        assert prefills, "every first token was decode's: none came from the prefill leg"
        _drained(client, identities)
    finally:
        serve.delete("pd")
