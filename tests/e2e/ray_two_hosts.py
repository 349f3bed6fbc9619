"""Ray Serve LLM across two hosts, run by hand (as root; several minutes):

    .venv/bin/python tests/e2e/ray_two_hosts.py [--mode push|pull] [--prompts 4]

Two network namespaces joined by a veth link (kvpush.netns) stand in for two machines.
A Ray head node runs in namespace a and a worker node in b, each with a custom
resource naming its host (`host_a`, `host_b`); kvpush's P/D application
(kvpush.ray_serve.build_pd_app) asks for `host_a` in its prefill replica's bundle and
`host_b` in its decode replica's, so the prefill engine runs on a and the decode
engine on b. The replicas run with UCX held to TCP on the host-to-host link.

The driver (this script, again, in namespace a) deploys the application, sends
fresh prompts through Serve's HTTP proxy on the head, and checks that:

  - every request answered 200 with as many tokens as it asked for;
  - decode's kvpush trace shows each request's KV landed in its blocks by transfer;
  - prefill's host sent at least the prompts' KV on the link (the bytes crossed);
  - nothing is in flight on either side afterwards.

It prints what it saw and exits 0 only if all held. Too slow for CI's time (two Ray
nodes and two engines on two cores); a script the two-host notes show run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6380
SERVE_PORT = 8450
IDENTITY = {"prefill": 18461, "decode": 18471}
OUTPUT_TOKENS = 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("push", "pull"), default="push")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--driver", nargs=3, metavar=("A", "B", "DEVICES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        return drive(*args.driver, args.mode, args.prompts)
    return orchestrate(args.mode, args.prompts)


# -- in the root namespace: the hosts, the Ray nodes, the driver ----------------------


def orchestrate(mode: str, prompts: int) -> int:
    from kvpush.demo.tinymodel import cached_tiny_model
    from kvpush.netns import TwoHosts, unavailable

    reason = unavailable()
    if reason:
        print(f"ray_two_hosts: cannot run here: {reason}", file=sys.stderr)
        return 2
    cached_tiny_model()  # built before any Ray process needs it
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths stay short
    hosts = TwoHosts(reachable=True)
    try:
        hosts.start()
        env = ray_env(temp)
        for host, resource, head in ((hosts.a, "host_a", True), (hosts.b, "host_b", False)):
            join = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if head else [
                f"--address={hosts.a.address}:{GCS_PORT}"]  # fmt: skip
            started = hosts.popen(host, [
                RAY, "start", *join, f"--node-ip-address={host.address}", "--num-cpus=6",
                f"--resources={json.dumps({resource: 10})}",
                f"--temp-dir={temp}/{resource}", "--disable-usage-stats",
            ], env=env)  # fmt: skip
            if started.wait(180) != 0:
                print(f"ray_two_hosts: `ray start` on {resource} failed", file=sys.stderr)
                return 1
        devices = f"{hosts.a.device},{hosts.b.device}"
        driver = [sys.executable, __file__, "--mode", mode, "--prompts", str(prompts),
                  "--driver", hosts.a.address, hosts.b.address, devices]  # fmt: skip
        before = hosts.a.sent_bytes()
        code = hosts.popen(hosts.a, driver, env=env).wait(1500)
        crossed = hosts.a.sent_bytes() - before
        print(f"prefill's host sent {crossed} bytes on the host-to-host link during the run")
        from kvpush.demo.tinymodel import SHAPE, kv_bytes_per_token

        least = prompts * (PROMPT_TOKENS - 1) * kv_bytes_per_token(SHAPE)
        if crossed < least:
            print(f"FAIL: less than the prompts' KV ({least} bytes) crossed the link")
            code = code or 1
        print("PASS" if code == 0 else f"FAIL ({code})")
        return code
    finally:
        for host in (hosts.a, hosts.b):
            subprocess.run(host.command([RAY, "stop", "--force"]), capture_output=True,
                           env=ray_env(temp), timeout=120)  # fmt: skip
        hosts.close()
        shutil.rmtree(temp, ignore_errors=True)


def ray_env(temp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RAY_AUTH_MODE": "disabled", "VLLM_RPC_BASE_PATH": temp, "TMPDIR": temp,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })  # fmt: skip
    return env


# -- in namespace a: the driver -------------------------------------------------------

PROMPT_TOKENS = 600


ROLES = {"prefill": ("kv_producer", "host_a"), "decode": ("kv_consumer", "host_b")}


def llm_config(model: Path, side: str, mode: str, device: str) -> dict:
    role, resource = ROLES[side]
    extra = {"mode": mode, "identity_port": IDENTITY[side]}
    return {
        "model_loading_config": {"model_id": "tiny", "model_source": str(model)},
        "engine_kwargs": {
            "kv_transfer_config": {"kv_connector": "KVPushConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra},
            "enforce_eager": True, "dtype": "float32", "max_model_len": 2048, "seed": 0,
            "num_gpu_blocks_override": 1024,
        },
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        "placement_group_config": {"bundles": [{"CPU": 1, resource: 1}]},
        "runtime_env": {"env_vars": {
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_RPC_BASE_PATH": os.environ["VLLM_RPC_BASE_PATH"],
            "TMPDIR": os.environ["VLLM_RPC_BASE_PATH"],
            "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": device,
        }},
    }  # fmt: skip


def drive(a: str, b: str, devices: str, mode: str, prompts: int) -> int:
    import random

    import ray
    from ray import serve

    import kvpush.ray_serve
    from kvpush.demo.tinymodel import cached_tiny_model

    device_a, device_b = devices.split(",")
    ray.init(address=f"{a}:{GCS_PORT}", log_to_driver=False)
    nodes = {n["NodeManagerAddress"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    print(f"Ray nodes: {json.dumps(nodes, sort_keys=True)}")
    kvpush.ray_serve.register()
    # One HTTP proxy, on the head: one on b could not bind a's address.
    serve.start(http_options={"host": a, "port": SERVE_PORT, "location": "HeadOnly"})
    model = cached_tiny_model()
    config = {
        "prefill_config": llm_config(model, "prefill", mode, device_a),
        "decode_config": llm_config(model, "decode", mode, device_b),
    }
    kvpush.ray_serve.share_secret(config)
    started = time.monotonic()
    serve.run(kvpush.ray_serve.build_pd_app(config), name="pd", route_prefix="/")
    print(f"P/D application serving after {time.monotonic() - started:.0f}s")
    identities = {"prefill": f"http://{a}:{IDENTITY['prefill']}",
                  "decode": f"http://{b}:{IDENTITY['decode']}"}  # fmt: skip
    rng = random.Random(41)
    failures = []
    for n in range(prompts):
        prompt = [rng.randrange(6, 2000) for _ in range(PROMPT_TOKENS)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        t0 = time.monotonic()
        answer = post(f"http://{a}:{SERVE_PORT}/v1/completions", body)
        text = answer["choices"][0]["text"] if "choices" in answer else ""
        tokens = answer.get("usage", {}).get("completion_tokens")
        print(f"request {n}: {PROMPT_TOKENS} prompt tokens, {tokens} answered in "
              f"{time.monotonic() - t0:.2f}s: {text[:40]!r}")  # fmt: skip
        if tokens != OUTPUT_TOKENS:
            failures.append(f"request {n}: {answer}")
    decoded = get(identities["decode"] + "/kvpush/trace")
    landed = [t for t in decoded if "landed" in t.get("marks", {}) and not t.get("error")]
    print(f"decode on {b}: {len(landed)} of {len(decoded)} traced requests landed by transfer")
    if len(landed) < prompts:
        failures.append(f"only {len(landed)} of {prompts} requests' KV landed: {decoded}")
    for side, url in identities.items():
        state = drained(url)
        print(f"{side} in flight afterwards: {state}")
        if state != {"sending": 0, "producing": 0, "receiving": 0}:
            failures.append(f"{side} still holds {state}")
    serve.shutdown()
    ray.shutdown()
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return {"error": error.code, "body": error.read().decode(errors="replace")[:300]}


def get(url: str) -> list | dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def drained(identity: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        state = get(identity + "/kvpush/state")
        counts = {k: state.get(k) for k in ("sending", "producing", "receiving")}
        if counts == {"sending": 0, "producing": 0, "receiving": 0} or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
