"""`kvpush bench ...`: each benchmark's options, and the run they start.

Every value is checked as it is parsed (kvpush.arguments), and the connector
settings a bench hands its kvpush servers (--kv-extra) through the connector's own
parser, so a typo fails before the first engine starts, not minutes into a grid.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvpush import arguments as a
from kvpush.errors import KVPushError

TINY = "(default: the tiny model)"


def add_bench(commands: Any) -> None:
    bench = a.command(commands, "bench", "benchmarks of the parts and of kvpush on real vLLM")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _transfer(benches)
    _protocol(benches)
    _serve(benches)
    _handoff(benches)
    _inflight(benches)
    _soak(benches)


def _transfer(benches: Any) -> None:
    p = a.command(benches, "transfer", "NIXL WRITE bandwidth between two processes")
    p.add_argument("--json", action="store_true", help="one JSON object per size")
    p.add_argument(
        "--sizes",
        type=a.listing(a.number(above=0)),
        help="MiB per transfer, comma-separated (default: 1,16,256; 16,256 across namespaces)",
    )
    p.add_argument("--runs", type=a.count, default=20, help="timed transfers per size")
    p.add_argument(
        "--idle-seconds", type=a.seconds, default=3.0, help="window for the receiver's idle CPU"
    )
    p.add_argument(
        "--across-namespaces",
        action="store_true",
        help="as root: WRITE between two network namespaces over a veth link, UCX on TCP, "
        "against the same link's plain TCP",
    )
    p.add_argument(
        "--link-rate",
        type=a.bit_rate,
        metavar="RATE",
        help="with --across-namespaces: cap the link with tc's tbf, e.g. 300mbit, 1gbit",
    )
    p.set_defaults(run=_run_transfer)


def _run_transfer(args: argparse.Namespace) -> int:
    from kvpush.bench import transfer

    if args.link_rate and not args.across_namespaces:
        raise KVPushError("--link-rate caps the link --across-namespaces makes: give both")
    if args.across_namespaces:
        from kvpush.bench import across

        return across.main(args.sizes or across.SIZES_MIB, args.runs, args.link_rate, args.json)
    return transfer.main(args.sizes or transfer.SIZES_MIB, args.runs, args.idle_seconds, args.json)


def _protocol(benches: Any) -> None:
    p = a.command(benches, "protocol", "producer-done to consumer-ready time, push against pull")
    p.add_argument("--json", action="store_true", help="one JSON object per point")
    p.add_argument(
        "--in-flight",
        type=a.listing(a.count),
        default="1,8,32",
        help="concurrent requests, comma-separated",
    )
    p.add_argument(
        "--requests-per-stream",
        type=a.count,
        default=8,
        help="requests each concurrent stream sends in turn",
    )
    p.add_argument(
        "--prefill-ms-per-request",
        type=a.number(0),
        default=20.0,
        help="prefill compute per request in a batch; a step takes this times the batch",
    )
    p.add_argument(
        "--decode-step-ms",
        type=a.number(0),
        default=10.0,
        help="decode step (upstream measured 7-10 ms TPOT); 0: notice transfers at once",
    )
    p.add_argument(
        "--idle-seconds", type=a.seconds, default=3.0, help="window for the consumer's idle CPU"
    )
    p.add_argument("--repeat", type=a.count, default=1, help="runs per point; medians reported")
    p.set_defaults(run=_run_protocol)


def _run_protocol(args: argparse.Namespace) -> int:
    from kvpush.bench import protocol

    settings = protocol.Settings(
        prefill_s_per_request=args.prefill_ms_per_request / 1e3,
        decode_step_s=args.decode_step_ms / 1e3,
        requests_per_stream=args.requests_per_stream,
        idle_seconds=args.idle_seconds,
    )
    return protocol.main(args.in_flight, settings, args.json, args.repeat)


def _serve(benches: Any) -> None:
    p = a.command(
        benches,
        "serve",
        "end to end on real vLLM: plain, kvpush push and pull, upstream NIXL; the one to decide by",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per cell")
    p.add_argument(
        "--lengths",
        type=a.listing(a.count),
        default="1024,3072",
        help="prompt lengths in tokens, comma-separated",
    )
    p.add_argument(
        "--rates",
        type=a.listing(a.number(above=0)),
        default="1,8",
        help="Poisson request rates per second, comma-separated",
    )
    p.add_argument("--requests", type=a.count, default=24, help="requests per cell")
    p.add_argument("--output-tokens", type=a.count, default=16, help="tokens each answer asks")
    p.add_argument(
        "--configs",
        help="comma-separated, of plain, push, pull, upstream, "
        "upstream-push, push-decode-first, prefill-alone (default: all but "
        "prefill-alone that the installed vLLM can run)",
    )
    p.add_argument(
        "--placements",
        default="colocated,pinned",
        help="colocated: servers share cores; pinned: each server tree on its own CPUs",
    )
    _cpus_and_model(p, TINY)
    p.add_argument(
        "--vllm-args", action="append", default=[], help="extra `vllm serve` arguments (repeatable)"
    )
    p.add_argument(
        "--kv-extra",
        type=a.json_object,
        metavar="JSON",
        help="more kvpush connector settings, e.g. '{\"idle_wait_s\": 0}'",
    )
    p.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="CONFIG=URL",
        help="measure a server or router already running as CONFIG (plain, push, pull)",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=a.number(above=0),
        default=1000.0,
        help="goodput's bound on time to first token",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=a.number(above=0),
        default=100.0,
        help="goodput's bound on time per output token",
    )
    p.add_argument(
        "--idle-seconds", type=a.seconds, default=3.0, help="window for each server's idle CPU"
    )
    p.add_argument("--seed", type=a.integer(), default=0, help="seeds the prompts and arrivals")
    p.add_argument(
        "--request-timeout", type=a.seconds, default=120.0, help="seconds before a request failed"
    )
    p.add_argument(
        "--workload", choices=("fresh", "chat"), default="fresh",
        help="fresh: new prompts of each length; chat: sessions sharing a growing prefix, "
        "short and long prompts (kvpush.bench.chat), the long ones of each length",
    )  # fmt: skip
    p.add_argument(
        "--router-args", action="append", default=[],
        help="extra `kvpush router` arguments for push and pull, e.g. '--disaggregate auto'",
    )  # fmt: skip
    p.add_argument(
        "--fleet", metavar="SHAPES",
        help="fleets behind kvpush's router, e.g. 1p2d,2p2d; --configs then takes "
        "rr-aggregated, disagg-all, decide (kvpush.bench.fleet, docs/router.md)",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=a.count, default=1,
        help="with --fleet: split each cell's requests into N parts, every configuration "
        "serving each part in turn, so a host that slows for a while slows all alike",
    )  # fmt: skip
    p.add_argument("--out", help="output directory (default: kvpush-bench-serve-<time>)")
    p.add_argument(
        "--across-namespaces",
        action="store_true",
        help="as root: prefill and decode in two network namespaces joined by a veth link, "
        "UCX on TCP, the KV-heavy tiny model unless --model; placements are link rates",
    )
    p.add_argument(
        "--link-rate",
        type=a.listing(a.bit_rate),
        metavar="RATES",
        help="with --across-namespaces: the link's tbf caps in turn, e.g. 300mbit,1gbit "
        "(default: uncapped)",
    )
    p.set_defaults(run=_run_serve)


def _cpus_and_model(p: argparse.ArgumentParser, model_default: str) -> None:
    p.add_argument(
        "--prefill-cpus",
        type=a.cpus,
        default="0",
        help="CPUs of prefill (and plain), as taskset takes them",
    )
    p.add_argument("--decode-cpus", type=a.cpus, default="1", help="CPUs of decode")
    p.add_argument("--model", type=a.directory, help=f"a local model directory {model_default}")


def _run_serve(args: argparse.Namespace) -> int:
    from kvpush.bench import serve, serve_report

    kv_extra = checked_kv_extra(args.kv_extra)
    settings = serve.Settings(
        lengths=args.lengths,
        rates=args.rates,
        requests=args.requests,
        output_tokens=args.output_tokens,
        configs=_names(args.configs) or _default_configs(args.fleet),
        placements=_names(args.placements),
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        model=Path(args.model) if args.model else None,
        vllm_args=tuple(arg for chunk in args.vllm_args for arg in chunk.split()),
        kv_extra=kv_extra,
        attach=_attach(args.attach),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        idle_seconds=args.idle_seconds,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        workload=args.workload,
        router_args=tuple(arg for chunk in args.router_args for arg in chunk.split()),
        fleet=_names(args.fleet or ""),
        rounds=args.rounds,
    )
    if args.link_rate and not args.across_namespaces:
        raise KVPushError("--link-rate caps the link --across-namespaces makes: give both")
    if settings.fleet:
        from kvpush.bench import fleet

        return fleet.main(settings, _out(args.out, "serve"), args.json)
    if args.across_namespaces:
        from kvpush.bench import across_serve

        rates = tuple(args.link_rate or (None,))
        return across_serve.main(settings, rates, _out(args.out, "serve"), args.json)
    return serve_report.main(settings, _out(args.out, "serve"), args.json)


def _default_configs(fleet: str | None) -> tuple[str, ...]:
    from kvpush.bench import fleet as fleets
    from kvpush.bench import serve

    return fleets.CONFIGS if fleet else serve.default_configs()


def _handoff(benches: Any) -> None:
    p = a.command(
        benches,
        "handoff",
        "real vLLM, chunked prefill: what of the KV hand-off "
        "is left after prefill computed, per push granularity",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--lengths",
        type=a.listing(a.count),
        default="512,8192",
        help="prompt lengths in tokens, comma-separated",
    )
    p.add_argument(
        "--granularities", default="request,layer,chunk", help="push granularities, comma-separated"
    )
    p.add_argument("--requests", type=a.count, default=6, help="prompts per length, one at a time")
    p.add_argument(
        "--step-tokens",
        type=a.count,
        default=1024,
        help="vLLM's --max-num-batched-tokens (chunk size)",
    )
    _cpus_and_model(p, "(default: the KV-heavy tiny model)")
    p.add_argument("--seed", type=a.integer(), default=0, help="seeds the prompts")
    p.add_argument("--out", help="output directory (default: kvpush-bench-handoff-<time>)")
    p.set_defaults(run=_run_handoff)


def _run_handoff(args: argparse.Namespace) -> int:
    from kvpush.bench import handoff

    settings = handoff.Settings(
        lengths=args.lengths,
        granularities=_names(args.granularities),
        requests=args.requests,
        step_tokens=args.step_tokens,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        model=Path(args.model) if args.model else None,
        seed=args.seed,
    )
    return handoff.main(settings, _out(args.out, "handoff"), args.json)


def _inflight(benches: Any) -> None:
    p = a.command(
        benches, "inflight", "real vLLM: what a request in flight costs a new prompt's TTFT, "
        "in prompt tokens, on its instance and on one beside it (--queue-tokens)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--lengths", type=a.listing(a.count), default="256,512",
                   help="the measured prompt's lengths in tokens, comma-separated")  # fmt: skip
    p.add_argument("--in-flight", type=a.listing(a.count), default="1,2,4",
                   help="how many requests decode meanwhile, comma-separated")  # fmt: skip
    p.add_argument("--context", type=a.count, default=2048,
                   help="prompt tokens of each request in flight")  # fmt: skip
    p.add_argument("--reps", type=a.count, default=9, help="tries a figure is the median of")
    p.add_argument("--cpus", type=a.cpus, default="0", help="the CPUs both instances share")
    p.add_argument("--model", type=a.directory, help=f"a local model directory {TINY}")
    p.add_argument("--seed", type=a.integer(), default=0, help="seeds the prompts")
    p.add_argument("--out", help="output directory (default: kvpush-bench-inflight-<time>)")
    p.set_defaults(run=_run_inflight)


def _run_inflight(args: argparse.Namespace) -> int:
    from kvpush.bench import inflight

    settings = inflight.Settings(
        lengths=args.lengths, in_flight=args.in_flight, context=args.context, reps=args.reps,
        cpus=args.cpus, model=Path(args.model) if args.model else None, seed=args.seed,
    )  # fmt: skip
    return inflight.main(settings, _out(args.out, "inflight"), args.json)


def _soak(benches: Any) -> None:
    p = a.command(
        benches, "soak", "real vLLM under a seeded mix and injected faults: nothing lost or leaked"
    )
    p.add_argument("--requests", type=a.count, default=1000, help="requests of the mix")
    p.add_argument(
        "--rate", type=a.number(above=0), help="requests a second (default: from --load)"
    )
    p.add_argument(
        "--load",
        type=a.number(above=0),
        default=0.5,
        help="fraction of the warm-up's flat-out rate",
    )
    p.add_argument("--prefill", type=a.count, default=1, help="prefill instances")
    p.add_argument("--decode", type=a.count, default=1, help="decode instances")
    p.add_argument(
        "--faults",
        help="fault kinds, injected in turn, of kill-prefill, kill-decode, stop-prefill, "
        "stop-decode, cut, partition (as root: the servers in network namespaces), "
        "drain-prefill, drain-decode (drained at the router, then added back), "
        "add-prefill, add-decode (a new instance started and added) "
        "(default: kill-prefill,stop-decode,cut,kill-decode,stop-prefill)",
    )
    p.add_argument(
        "--fault-interval",
        type=a.optional_seconds,
        default=120.0,
        help="seconds between faults (0: none)",
    )
    p.add_argument(
        "--max-faults",
        type=a.optional_count,
        help="inject this many; the load goes on past --requests until the last is over",
    )
    p.add_argument(
        "--recovery",
        type=a.optional_count,
        default=0,
        help="once the last fault is over, this many more requests: whether it serves again",
    )
    p.add_argument(
        "--compare",
        type=a.optional_count,
        help="ask the plain instance at most this many answers, spread over the run "
        "(default: every deterministic one)",
    )
    p.add_argument(
        "--stop-seconds", type=a.seconds, help="SIGSTOP this long (default: past the timers)"
    )
    p.add_argument(
        "--fault-grace",
        type=a.optional_seconds,
        default=20.0,
        help="seconds a fault's window outlasts it",
    )
    p.add_argument(
        "--disconnect-share", type=a.share, default=0.05, help="clients that go away early"
    )
    p.add_argument(
        "--deadline", type=a.seconds, default=120.0, help="seconds before a request counts as hung"
    )
    p.add_argument("--router-timeout", type=a.seconds, default=30.0, help="router --timeout")
    p.add_argument("--max-model-len", type=a.count, default=2048, help="the context limit")
    p.add_argument(
        "--policy",
        choices=("fail", "recompute"),
        default="fail",
        help="decode's kv_load_failure_policy",
    )
    p.add_argument(
        "--kv-extra", type=a.json_object, metavar="JSON", help="more kvpush connector settings"
    )
    p.add_argument(
        "--insecure", action="store_true", help="run the instances without a shared secret"
    )
    p.add_argument("--model", type=a.directory, help=f"a local model directory {TINY}")
    p.add_argument("--warm-up", type=a.optional_count, default=64, help="flat-out warm-up requests")
    p.add_argument(
        "--settle-max",
        type=a.optional_seconds,
        default=300.0,
        help="seconds at most of the mix at the run's rate, before it, for RSS to level off",
    )
    p.add_argument("--seed", type=a.integer(), default=0, help="seeds the mix and the faults")
    p.add_argument("--out", help="output directory (default: kvpush-bench-soak-<time>)")
    p.set_defaults(run=_run_soak)


def _run_soak(args: argparse.Namespace) -> int:
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
        compare=args.compare,
        stop_s=args.stop_seconds,
        grace_s=args.fault_grace,
        disconnect_share=args.disconnect_share,
        deadline_s=args.deadline,
        router_timeout_s=args.router_timeout,
        max_model_len=args.max_model_len,
        policy=args.policy,
        kv_extra=checked_kv_extra(args.kv_extra),
        insecure=args.insecure,
        model=Path(args.model) if args.model else None,
        warm_up=args.warm_up,
        settle_max_s=args.settle_max,
        seed=args.seed,
    )
    return soak.main(settings, _out(args.out, "soak"))


def checked_kv_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """--kv-extra as the connector will read it, refused now if it would be then.
    device_options are checked against every installed backend: which one serves the
    servers' device is known only once they start."""
    from kvpush.backend.plugins import get_backends
    from kvpush.vllm.config import ConnectorConfig

    extra = dict(extra or {})
    try:
        ConnectorConfig.from_extra(extra)
        get_backends().check_device_options(extra.get("device_options") or {})
    except KVPushError as exc:
        raise KVPushError(f"--kv-extra: {exc}") from None
    return extra


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


def _attach(items: list[str]) -> dict[str, str]:
    attach = {}
    for item in items:
        config, sep, url = item.partition("=")
        if not sep or not url:
            raise KVPushError(f"--attach takes CONFIG=URL, got {item!r}")
        attach[config] = url
    return attach


def _out(given: str | None, bench: str) -> Path:
    return Path(given or f"kvpush-bench-{bench}-{time.strftime('%Y%m%d-%H%M%S')}")
