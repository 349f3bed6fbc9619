"""kvpush under Ray Serve LLM's prefill/decode application (`build_pd_openai_app`), on
a local Ray cluster: push mode with kvpush's connector backend (both legs at once),
and pull mode through Ray's sequential hand-off. Answers equal a plain instance's;
a prefill with other K/V weights changes decode's answer (so the KV really moved:
a silent recompute would answer right too); nothing stays in flight."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import Client, perturbed_copy, prompt

pytest.importorskip("ray.serve.llm", reason="Ray Serve LLM is not installed: pip install -e .[ray]")

import ray
from ray import serve
from ray.serve.llm import build_pd_openai_app

import kvpush.ray_serve
from kvpush.demo.cluster import free_port
from kvpush.demo.servers import MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

LENGTHS = (129, 300, 600)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with Serve on a free port: Serve's URL."""
    # Ray's socket paths must stay under 107 bytes; its token auth is for clusters
    # users start themselves.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")
    # Logical CPUs: each LLM replica takes one for its actor and one for its engine.
    ray.init(num_cpus=8, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    kvpush.ray_serve.register()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _llm_config(model, role: str, mode: str, core: int, identity_port: int) -> dict:
    extra = {"mode": mode, "identity_port": identity_port}
    return {
        "model_loading_config": {"model_id": MODEL_NAME, "model_source": str(model)},
        "engine_kwargs": {
            "kv_transfer_config": {"kv_connector": "KVPushConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra},
            "enforce_eager": True, "dtype": "float32", "max_model_len": 2048, "seed": 0,
        },
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "runtime_env": {"env_vars": {
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        }},
    }  # fmt: skip


def _deploy(prefill_model, decode_model, mode: str) -> dict[str, str]:
    """The P/D application, serving: each instance's identity URL."""
    ports = {"prefill": free_port(), "decode": free_port()}
    app = build_pd_openai_app({
        "prefill_config": _llm_config(prefill_model, "kv_producer", mode, 0, ports["prefill"]),
        "decode_config": _llm_config(decode_model, "kv_consumer", mode, 1, ports["decode"]),
    })  # fmt: skip
    serve.run(app, name="pd", route_prefix="/")
    host = ray.util.get_node_ip_address()  # the backend binds kvpush there, not loopback
    return {name: f"http://{host}:{port}" for name, port in ports.items()}


def _answers(client: Client, url: str) -> list[list[int]]:
    return [client.tokens(url, prompt(n, 3300 + n)) for n in LENGTHS]


def _both_legs_were_sent_at_once(client: Client, identities: dict[str, str]) -> None:
    """kvpush's backend shaped the legs (its transfer ids), and each decode leg
    arrived before prefill had computed its KV: Ray did not wait for prefill."""
    decoded = client.http.get(identities["decode"] + "/kvpush/trace").json()
    prefilled = client.http.get(identities["prefill"] + "/kvpush/trace").json()
    computed = {t["transfer_id"]: t["marks"]["computed"] for t in prefilled}
    assert len(decoded) == len(LENGTHS)
    for trace in decoded:
        assert trace["transfer_id"].startswith("ray-"), trace
        assert trace["marks"]["arrived"] < computed[trace["transfer_id"]], trace


def _drained(client: Client, identities: dict[str, str]) -> None:
    for name, identity in identities.items():
        state = client.wait_drained(identity)
        assert state == {"sending": 0, "producing": 0, "receiving": 0}, (name, state)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ray_pd_application_answers_as_a_plain_instance(cluster, ray_cluster, client, mode):
    expected = _answers(client, cluster.servers["single"].url)
    url, identities = ray_cluster, _deploy(cluster.model, cluster.model, mode)
    try:
        started = time.monotonic()
        assert _answers(client, url) == expected
        assert time.monotonic() - started < 120
        _drained(client, identities)
        if mode == "push":
            _both_legs_were_sent_at_once(client, identities)
    finally:
        serve.delete("pd")


def test_ray_pd_push_moves_the_kv_from_prefill(cluster, ray_cluster, client):
    """The negative control: a prefill whose K/V weights differ changes every answer."""
    expected = _answers(client, cluster.servers["single"].url)
    wrong = perturbed_copy(cluster.model, cluster.workdir / "model-other-kv-ray")
    url, identities = ray_cluster, _deploy(wrong, cluster.model, "push")
    try:
        got = _answers(client, url)
        changed = [n for n, a, b in zip(LENGTHS, got, expected, strict=True) if a != b]
        assert changed == list(LENGTHS), f"decode ignored the pushed KV for lengths {changed}"
        _drained(client, identities)
    finally:
        serve.delete("pd")
