"""The `kvpush` command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvpush.errors import KVPushError
from kvpush.router import LOOPS


def _doctor(args: argparse.Namespace) -> int:
    """kvpush's reaches into the installed vLLM, probed without starting an engine;
    or, given wheels or records, kvpush's contract with each, read from its source."""
    if args.vllm_wheel or args.vllm_record:
        return _contract(args)
    from kvpush.vllm.hooks import probe

    rows = probe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = "ok" if row["would_attach"] else f"OFF ({row['problem']})"
        state = state if row["applies"] else "n/a (nothing to reach in this vLLM)"
        versions = ",".join(row["verified"])
        print(f"{row['hook']:<20} vLLM {row['vllm']:<12} verified on {versions}: {state}")
        if not row["would_attach"]:
            print(f"{'':<20} costs: {row['cost_when_off']}")
    return 0


def _contract(args: argparse.Namespace) -> int:
    """Check each wheel (pip download vllm==X --no-deps) or record; --record writes
    each wheel's record too. Exit status 1 if any version fails the check."""
    from kvpush.vllm import contract

    recorded = [contract.record(wheel) for wheel in args.vllm_wheel]
    for wheel in args.vllm_wheel if args.record else ():
        print(f"recorded {contract.write_record(wheel, args.record)}", file=sys.stderr)
    recorded += [json.loads(Path(path).read_text()) for path in args.vllm_record]
    checked = {r["vllm"]: contract.check(r) for r in recorded}
    if args.json:
        print(json.dumps(checked, indent=2))
    else:
        print(contract.side_by_side(checked))
    return 0 if all(contract.passes(rows) for rows in checked.values()) else 1


def _backends(args: argparse.Namespace) -> int:
    from kvpush.backend.plugins import get_backends

    backends = get_backends()
    probes = backends.probes()
    rows = []
    for loaded in backends.loaded():
        probe = probes.get(loaded.name)
        info = loaded.info
        rows.append(
            {
                "name": loaded.name,
                "source": loaded.source,
                "module": loaded.module,
                "present": bool(probe and probe.present),
                "detail": probe.detail if probe else "no probe",
                "device_types": list(info.device_types),
                "mem_types": list(info.mem_types),
                "transfer_paths": list(info.transfer_paths),
                "not_implemented": list(info.missing),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = "present" if row["present"] else "absent"
        print(f"{row['name']:<8} {row['source']:<12} device {state:<8} {row['detail']}")
        print(
            f"{'':<8} devices {','.join(row['device_types'])}; memory "
            f"{','.join(row['mem_types'])}; paths {','.join(row['transfer_paths'])}"
        )
        if row["not_implemented"]:
            print(f"{'':<8} not implemented for this backend: {', '.join(row['not_implemented'])}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from kvpush.vllm.config import new_secret

    print(new_secret())
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvpush.bench import transfer

    sizes = tuple(float(s) for s in args.sizes.split(","))
    return transfer.main(sizes, args.runs, args.idle_seconds, args.json)


def _bench_protocol(args: argparse.Namespace) -> int:
    from kvpush.bench import protocol

    settings = protocol.Settings(
        prefill_s_per_request=args.prefill_ms_per_request / 1e3,
        decode_step_s=args.decode_step_ms / 1e3,
        requests_per_stream=args.requests_per_stream,
        idle_seconds=args.idle_seconds,
    )
    points = tuple(int(p) for p in args.in_flight.split(","))
    return protocol.main(points, settings, args.json, args.repeat)


def _bench_serve(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvpush.bench import serve

    attach = {}
    for item in args.attach:
        config, sep, url = item.partition("=")
        if not sep:
            raise KVPushError(f"--attach takes CONFIG=URL, got {item!r}")
        attach[config] = url
    settings = serve.Settings(
        lengths=serve.parse_list(args.lengths, int),
        rates=serve.parse_list(args.rates, float),
        requests=args.requests,
        output_tokens=args.output_tokens,
        configs=tuple(c for c in (args.configs or "").split(",") if c) or serve.default_configs(),
        placements=tuple(p for p in args.placements.split(",") if p),
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        model=Path(args.model) if args.model else None,
        vllm_args=tuple(arg for chunk in args.vllm_args for arg in chunk.split()),
        kv_extra=_json_object("--kv-extra", args.kv_extra),
        attach=attach,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        idle_seconds=args.idle_seconds,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
    )
    out = Path(args.out or f"kvpush-bench-serve-{time.strftime('%Y%m%d-%H%M%S')}")
    return serve.main(settings, out, args.json)


def _bench_handoff(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvpush.bench import handoff, serve

    settings = handoff.Settings(
        lengths=serve.parse_list(args.lengths, int),
        granularities=tuple(g for g in args.granularities.split(",") if g),
        requests=args.requests,
        step_tokens=args.step_tokens,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        model=Path(args.model) if args.model else None,
        seed=args.seed,
    )
    out = Path(args.out or f"kvpush-bench-handoff-{time.strftime('%Y%m%d-%H%M%S')}")
    return handoff.main(settings, out, args.json)


def _bench_soak(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvpush.bench import faults, soak

    settings = soak.Settings(
        requests=args.requests,
        rate=args.rate,
        load=args.load,
        prefill=args.prefill,
        decode=args.decode,
        faults=faults.parse_kinds(args.faults) if args.faults else faults.DEFAULT_FAULTS,
        fault_interval_s=args.fault_interval,
        max_faults=args.max_faults,
        recovery=args.recovery,
        stop_s=args.stop_seconds,
        grace_s=args.fault_grace,
        disconnect_share=args.disconnect_share,
        deadline_s=args.deadline,
        router_timeout_s=args.router_timeout,
        max_model_len=args.max_model_len,
        policy=args.policy,
        kv_extra=_json_object("--kv-extra", args.kv_extra),
        insecure=args.insecure,
        model=Path(args.model) if args.model else None,
        warm_up=args.warm_up,
        settle_max_s=args.settle_max,
        seed=args.seed,
    )
    out = Path(args.out or f"kvpush-bench-soak-{time.strftime('%Y%m%d-%H%M%S')}")
    return soak.main(settings, out)


def _json_object(option: str, text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KVPushError(f"{option} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise KVPushError(f"{option} must be a JSON object, got {text!r}")
    return value


def _router(args: argparse.Namespace) -> int:
    from kvpush.router.app import RouterConfig, run
    from kvpush.router.instances import Instance

    config = RouterConfig(
        prefill=[Instance.parse(spec, "prefill") for spec in args.prefill],
        decode=[Instance.parse(spec, "decode") for spec in args.decode],
        mode=args.mode,
        timeout_s=args.timeout,
        cooldown_s=args.cooldown,
        health_interval_s=args.health_interval,
        keepalive_s=args.keepalive,
        first_token=args.first_token,
    )
    run(config, args.host, args.port, args.loop)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvpush.demo.main import main

    return main(keep=args.keep, max_tokens=args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    backends = commands.add_parser("backends", help="list device backends and their devices")
    backends.add_argument("--json", action="store_true", help="one JSON document")
    backends.set_defaults(run=_backends)

    doctor = commands.add_parser(
        "doctor", help="check kvpush's hooks into the installed vLLM (without starting it)"
    )
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument(
        "--vllm-wheel", action="append", default=[], metavar="PATH",
        help="check kvpush's contract with this vLLM wheel's source, not installing it "
        "(pip download vllm==X --no-deps); repeat for several, side by side",
    )  # fmt: skip
    doctor.add_argument(
        "--vllm-record", action="append", default=[], metavar="JSON",
        help="check against a recorded contract surface (tests/vllm_contracts/X.json)",
    )  # fmt: skip
    doctor.add_argument(
        "--record", metavar="DIR", help="also write each wheel's record as DIR/<version>.json"
    )
    doctor.set_defaults(run=_doctor)

    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    transfer = benches.add_parser("transfer", help="NIXL WRITE bandwidth between two processes")
    transfer.add_argument("--json", action="store_true", help="one JSON object per size")
    transfer.add_argument("--sizes", default="1,16,256", help="MiB per transfer (default 1,16,256)")
    transfer.add_argument("--runs", type=int, default=20, help="timed transfers per size")
    transfer.add_argument(
        "--idle-seconds", type=float, default=3.0, help="window for the receiver's idle CPU"
    )
    transfer.set_defaults(run=_bench_transfer)

    proto = benches.add_parser(
        "protocol", help="producer-done to consumer-ready time, push against pull"
    )
    proto.add_argument("--json", action="store_true", help="one JSON object per point")
    proto.add_argument("--in-flight", default="1,8,32", help="concurrent requests (default 1,8,32)")
    proto.add_argument("--requests-per-stream", type=int, default=8)
    proto.add_argument(
        "--prefill-ms-per-request",
        type=float,
        default=20.0,
        help="prefill compute per request in a batch; a step takes this times the batch",
    )
    proto.add_argument(
        "--decode-step-ms",
        type=float,
        default=10.0,
        help="decode step (upstream measured 7-10 ms TPOT); 0: notice transfers at once",
    )
    proto.add_argument("--idle-seconds", type=float, default=3.0)
    proto.add_argument("--repeat", type=int, default=1, help="runs per point; medians reported")
    proto.set_defaults(run=_bench_protocol)

    serve = benches.add_parser(
        "serve", help="end to end on real vLLM: plain, kvpush push and pull, upstream NIXL"
    )
    serve.add_argument("--json", action="store_true", help="one JSON object per cell")
    serve.add_argument("--lengths", default="1024,3072", help="prompt lengths in tokens")
    serve.add_argument("--rates", default="1,8", help="Poisson request rates per second")
    serve.add_argument("--requests", type=int, default=24, help="requests per cell")
    serve.add_argument("--output-tokens", type=int, default=16)
    serve.add_argument(
        "--configs",
        help="comma-separated, of plain, push, pull, upstream, upstream-push, "
        "push-decode-first, prefill-alone (default: all but prefill-alone that the "
        "installed vLLM can run)",
    )
    serve.add_argument(
        "--placements",
        default="colocated,pinned",
        help="colocated: servers share cores; pinned: each server tree on its own CPUs",
    )
    serve.add_argument("--prefill-cpus", default="0", help="CPUs of prefill (and plain)")
    serve.add_argument("--decode-cpus", default="1", help="CPUs of decode")
    serve.add_argument("--model", help="a local model directory (default: the tiny model)")
    serve.add_argument(
        "--vllm-args", action="append", default=[], help="extra `vllm serve` arguments"
    )
    serve.add_argument(
        "--kv-extra",
        metavar="JSON",
        help="more kvpush connector settings, e.g. '{\"idle_wait_s\": 0}'",
    )
    serve.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="CONFIG=URL",
        help="measure a server or router already running as CONFIG (plain, push, pull)",
    )
    serve.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    serve.add_argument("--slo-tpot-ms", type=float, default=100.0)
    serve.add_argument("--idle-seconds", type=float, default=3.0)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds before a request failed"
    )
    serve.add_argument("--out", help="output directory (default kvpush-bench-serve-<time>)")
    serve.set_defaults(run=_bench_serve)

    handoff = benches.add_parser(
        "handoff",
        help="real vLLM, chunked prefill: what of the KV hand-off is left after prefill "
        "computed, per push granularity",
    )
    handoff.add_argument("--json", action="store_true", help="one JSON object per row")
    handoff.add_argument("--lengths", default="512,8192", help="prompt lengths in tokens")
    handoff.add_argument("--granularities", default="request,layer,chunk")
    handoff.add_argument(
        "--requests", type=int, default=6, help="prompts per length, one at a time"
    )
    handoff.add_argument(
        "--step-tokens", type=int, default=1024, help="vLLM's --max-num-batched-tokens (chunk size)"
    )
    handoff.add_argument("--prefill-cpus", default="0")
    handoff.add_argument("--decode-cpus", default="1")
    handoff.add_argument(
        "--model", help="a local model directory (default: the KV-heavy tiny model)"
    )
    handoff.add_argument("--seed", type=int, default=0)
    handoff.add_argument("--out", help="output directory (default kvpush-bench-handoff-<time>)")
    handoff.set_defaults(run=_bench_handoff)

    soak = benches.add_parser(
        "soak", help="real vLLM under a seeded mix and injected faults: nothing lost or leaked"
    )
    soak.add_argument("--requests", type=int, default=1000)
    soak.add_argument("--rate", type=float, help="requests a second (default: from --load)")
    soak.add_argument(
        "--load", type=float, default=0.5, help="fraction of the warm-up's flat-out rate"
    )
    soak.add_argument("--prefill", type=int, default=1, help="prefill instances")
    soak.add_argument("--decode", type=int, default=1, help="decode instances")
    soak.add_argument(
        "--faults",
        help="fault kinds, injected in turn, of kill-prefill, kill-decode, stop-prefill, "
        "stop-decode, cut (default: kill-prefill,stop-decode,cut,kill-decode,stop-prefill)",
    )
    soak.add_argument(
        "--fault-interval", type=float, default=120.0, help="seconds between faults (0: none)"
    )
    soak.add_argument("--max-faults", type=int, help="inject at most this many")
    soak.add_argument(
        "--recovery", type=int, default=0,
        help="once the last fault is over, this many more requests: whether it serves again",
    )  # fmt: skip
    soak.add_argument(
        "--stop-seconds", type=float, help="SIGSTOP this long (default: past the timers)"
    )
    soak.add_argument(
        "--fault-grace", type=float, default=20.0, help="seconds a fault's window outlasts it"
    )
    soak.add_argument(
        "--disconnect-share", type=float, default=0.05, help="clients that go away early"
    )
    soak.add_argument(
        "--deadline", type=float, default=120.0, help="seconds before a request counts as hung"
    )
    soak.add_argument("--router-timeout", type=float, default=30.0, help="router --timeout")
    soak.add_argument("--max-model-len", type=int, default=2048, help="the context limit")
    soak.add_argument("--policy", choices=("fail", "recompute"), default="fail",
                      help="decode's kv_load_failure_policy")  # fmt: skip
    soak.add_argument("--kv-extra", metavar="JSON", help="more kvpush connector settings")
    soak.add_argument(
        "--insecure", action="store_true", help="run the instances without a shared secret"
    )
    soak.add_argument("--model", help="a local model directory (default: the tiny model)")
    soak.add_argument("--warm-up", type=int, default=64, help="flat-out warm-up requests")
    soak.add_argument(
        "--settle-max", type=float, default=300.0,
        help="seconds at most of the mix at the run's rate, before it, for RSS to level off",
    )  # fmt: skip
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", help="output directory (default kvpush-bench-soak-<time>)")
    soak.set_defaults(run=_bench_soak)

    router = commands.add_parser(
        "router", help="OpenAI-compatible router sending prefill and decode legs"
    )
    router.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[,bootstrap=PORT]",
        help="a prefill vLLM server; bootstrap= is its kvpush identity_port (repeatable)",
    )
    router.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL[,bootstrap=PORT]",
        help="a decode vLLM server; bootstrap= is its kvpush identity_port, so the router "
        "can refuse a pair that cannot exchange KV before sending it requests (repeatable)",
    )
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--mode", choices=("push", "pull"), default="push")
    router.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a leg may stay silent before it counts as failed (not a total)",
    )
    router.add_argument(
        "--cooldown", type=float, default=10.0, help="seconds a failed instance is not picked"
    )
    router.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="seconds between /health checks of every instance (0: none)",
    )
    router.add_argument(
        "--keepalive",
        type=float,
        default=2.0,
        help="seconds an idle connection to an instance is kept; keep it below the "
        "servers' keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)",
    )
    router.add_argument(
        "--no-first-token",
        dest="first_token",
        action="store_false",
        help="a streaming client's first token waits for the decode leg, as without "
        "disaggregation, instead of coming from the prefill leg",
    )
    router.add_argument(
        "--loop",
        choices=LOOPS,
        default="auto",
        help="event loop, as uvicorn's --loop: auto is uvloop where installed",
    )
    router.set_defaults(run=_router)

    secret = commands.add_parser(
        "secret",
        help="print a new shared secret for a deployment (set it as KVPUSH_SECRET on every "
        "prefill and decode instance)",
    )
    secret.set_defaults(run=_secret)

    demo = commands.add_parser(
        "demo", help="tiny model, vLLM prefill + decode with kvpush, router, a few requests"
    )
    demo.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = signal.signal(signal.SIGTERM, _unwind)
    try:
        return args.run(args)
    except KVPushError as exc:
        print(f"kvpush: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)


def _unwind(signum: int, frame: object) -> None:
    """SIGTERM (`timeout`, `kill`, a cancelled CI job) unwinds the command as Ctrl-C
    does. The vLLM servers and routers that `demo` and `bench` start run in their own
    sessions, out of reach of a signal to ours: only the command's own clean-up stops
    them, and Python's default for SIGTERM skips it."""
    # A second SIGTERM must not cut that clean-up short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)
