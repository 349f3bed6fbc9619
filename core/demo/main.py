"""`kvpush demo`: a prefill and a decode vLLM instance, the router, a few requests.

Everything runs on this machine with a tiny model built on the spot: no GPU, no
download. It prints each answer with its time to first token, then what kvpush
moved, and stops every process it started, on Ctrl-C too.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import MODEL_NAME
from kvpush.demo.tinymodel import cached_tiny_model

PROMPTS = [
    "The kv cache of a long prompt",
    "Prefill computes, decode waits; push the blocks before decode asks for them",
    "Hello world",
]


def _say(message: str) -> None:
    print(f"[kvpush demo] {message}", flush=True)


def _stream(url: str, body: dict) -> tuple[str, float, float]:
    """(text, seconds to first token, seconds in all) of a streamed completion."""
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    started, first, text = time.monotonic(), None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
            if piece and first is None:
                first = time.monotonic() - started
            text.append(piece)
    return "".join(text), first or 0.0, time.monotonic() - started


def _kvpush_totals(url: str) -> dict[str, float]:
    """kvpush's counters from a vLLM server's Prometheus page, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    totals: dict[str, float] = {}
    for line in lines:
        if not line.startswith("vllm:kvpush_") or "_created" in line or "_bucket" in line:
            continue
        name, value = line.split("{")[0].removeprefix("vllm:kvpush_"), float(line.rsplit(" ", 1)[1])
        totals[name] = totals.get(name, 0.0) + value
    return totals


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def main(keep: bool = False, max_tokens: int = 24) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop cleanly on TERM too
    workdir = Path(tempfile.mkdtemp(prefix="kvpush-demo-"))
    cluster = None
    try:
        _say("building the tiny model (no download)")
        model = cached_tiny_model()
        cluster = Cluster(workdir, model)
        cluster.add_server("prefill", "kv_producer", core=0)
        cluster.add_server("decode", "kv_consumer", core=1)
        _say("starting vLLM prefill (core 0) and decode (core 1) with KVPushConnector ...")
        started = time.monotonic()
        cluster.start()
        _say(f"both healthy after {time.monotonic() - started:.0f}s; logs in {workdir}")
        router = cluster.start_router(["prefill"], ["decode"])
        _say(f"router on {router} (push: both legs at once)")
        for index, prompt in enumerate(PROMPTS):
            body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0}
            if index == len(PROMPTS) - 1:
                url = router + "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                url = router + "/v1/completions"
                body["prompt"] = prompt
            text, ttft, total = _stream(url, body)
            print(f"\n  prompt: {prompt!r}\n  answer: {text!r}")
            print(f"  time to first token {ttft * 1e3:.0f} ms, whole answer {total:.2f} s")
        time.sleep(2)  # let both sides publish their stats
        print()
        _say("what kvpush did (from each server's /metrics):")
        for name in ("prefill", "decode"):
            t = _kvpush_totals(cluster.servers[name].url)
            state = _get_json(cluster.identity_url(name) + "/kvpush/state")
            count = t.get("done_to_ready_seconds_count", 0)
            mean = 1e3 * t.get("done_to_ready_seconds_sum", 0) / count if count else 0
            wait = f", prefill done -> decode ready {mean:.1f} ms on average" if count else ""
            print(
                f"  {name}: {t.get('delivered_total', 0):.0f} KV transfers received, "
                f"{t.get('failed_total', 0):.0f} failed, {t.get('released_total', 0):.0f} sent and "
                f"freed, {t.get('bytes_total', 0) / 1024:.0f} KiB moved{wait}"
            )
            print(f"  {name}: still in flight {state}")
        return 0
    except KeyboardInterrupt:
        _say("interrupted: stopping everything")
        return 130
    finally:
        if cluster is not None:
            _say("stopping servers and router")
            cluster.stop()
        if keep:
            _say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
