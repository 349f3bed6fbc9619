"""kvpush: push KV-cache transfer between vLLM prefill and decode engines."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from kvpush import arguments as a
from kvpush.bench.commands import add_bench
from kvpush.errors import KVPushError
from kvpush.router import LOOPS
from kvpush.router.policy import add_options as add_routing_options

# 128 + SIGPIPE, as a shell reports a command whose reader went away (`| head`).
BROKEN_PIPE = 141
EXIT_CODES = """exit status:
  0    done; a benchmark or check found nothing wrong
  1    a benchmark saw failed requests, or a contract check failed
  2    a usage or configuration error (a bad value, an unknown key), said in one line
  130  interrupted (Ctrl-C)
  141  the reader of the output went away (kvpush backends | head -1)
  143  stopped by SIGTERM, after stopping the servers it started
"""


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
        versions = ",".join(row["verified"])
        print(f"{row['hook']:<20} vLLM {row['vllm']:<12} verified on {versions}: {_state(row)}")
        if row["applies"] and not row["would_attach"]:  # n/a: there is nothing to miss
            print(f"{'':<20} costs: {row['cost_when_off']}")
    return 0


def _state(row: dict) -> str:
    """A hook's state as `kvpush doctor` prints it."""
    from kvpush.vllm.hooks import OFF_ENV

    if not row["applies"]:
        return "n/a (nothing to reach in this vLLM)"
    if row["turned_off"]:
        return f"off ({OFF_ENV})"
    return "ok" if row["would_attach"] else f"OFF ({row['problem']})"


def _contract(args: argparse.Namespace) -> int:
    """Check each wheel (pip download vllm==X --no-deps) or record; --record writes
    each wheel's record too. Exit status 1 if any version fails the check."""
    from kvpush.vllm import contract

    recorded = [contract.record(wheel) for wheel in args.vllm_wheel]
    for wheel in args.vllm_wheel if args.record else ():
        print(f"recorded {contract.write_record(wheel, args.record)}", file=sys.stderr)
    recorded += [_record(path) for path in args.vllm_record]
    checked = {r["vllm"]: contract.check(r) for r in recorded}
    if args.json:
        print(json.dumps(checked, indent=2))
    else:
        print(contract.side_by_side(checked))
    return 0 if all(contract.passes(rows) for rows in checked.values()) else 1


def _record(path: str) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise KVPushError(f"--vllm-record {path} is not a contract record (JSON): {exc}") from None
    if not isinstance(record, dict) or "vllm" not in record:
        raise KVPushError(f"--vllm-record {path} is not a contract record (no 'vllm' version)")
    return record


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
                "device_options": None
                if info.device_options is None
                else list(info.device_options),
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
        options = row["device_options"]
        known = "undeclared (unchecked)" if options is None else ",".join(options) or "none"
        print(f"{'':<8} device_options {known}")
        if row["not_implemented"]:
            print(f"{'':<8} not implemented for this backend: {', '.join(row['not_implemented'])}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from kvpush.vllm.config import new_secret

    print(new_secret())
    return 0


def _router(args: argparse.Namespace) -> int:
    from kvpush.router.app import RouterConfig, run
    from kvpush.router.instances import Instance
    from kvpush.router.policy import policy_of

    _show_router_logs()
    config = RouterConfig(
        prefill=[Instance.parse(spec, "prefill") for spec in args.prefill],
        decode=[Instance.parse(spec, "decode") for spec in args.decode],
        mode=args.mode,
        timeout_s=args.timeout,
        cooldown_s=args.cooldown,
        health_interval_s=args.health_interval,
        keepalive_s=args.keepalive,
        first_token=args.first_token,
        policy=policy_of(args),
        instances_file=args.instances_file,
    )
    run(config, args.host, args.port, args.loop)
    return 0


def _show_router_logs() -> None:
    """The router's INFO lines (where it listens, each instance's identity, each
    coming back) on stderr: Python shows only warnings from a logger nobody set up.
    Logging that the process set up already (a test's, an embedding program's) is
    left as it is."""
    kvpush_log = logging.getLogger("kvpush")
    if kvpush_log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    kvpush_log.addHandler(handler)
    kvpush_log.setLevel(logging.INFO)


def _demo(args: argparse.Namespace) -> int:
    from kvpush.demo.main import main

    return main(keep=args.keep, max_tokens=args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = a.Parser(prog="kvpush", description=__doc__, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"kvpush {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    backends = a.command(commands, "backends", "list device backends, their source and devices")
    backends.add_argument("--json", action="store_true", help="one JSON document")
    backends.set_defaults(run=_backends)

    doctor = a.command(
        commands, "doctor", "check kvpush's hooks into the installed vLLM (without starting it)"
    )
    doctor.add_argument("--json", action="store_true", help="one JSON document")
    doctor.add_argument(
        "--vllm-wheel", action="append", default=[], metavar="PATH", type=a.existing_file,
        help="check kvpush's contract with this vLLM wheel's source, not installing it "
        "(pip download vllm==X --no-deps); repeat for several, side by side",
    )  # fmt: skip
    doctor.add_argument(
        "--vllm-record", action="append", default=[], metavar="JSON", type=a.existing_file,
        help="check against a recorded contract surface (tests/vllm_contracts/X.json)",
    )  # fmt: skip
    doctor.add_argument(
        "--record", metavar="DIR", help="also write each wheel's record as DIR/<version>.json"
    )
    doctor.set_defaults(run=_doctor)

    add_bench(commands)

    router = a.command(
        commands, "router", "OpenAI-compatible router sending prefill and decode legs"
    )
    router.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[,identity=PORT][,kv_events=ENDPOINT][,device=LABEL]",
        help="a prefill vLLM server; identity= is its kvpush identity_port, not its "
        "bootstrap_port (bootstrap= is accepted too); kv_events= where its vLLM publishes "
        "KV-cache events; device= names what it computes on, where instances share it "
        "(docs/router.md) (repeatable)",
    )
    router.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL[,identity=PORT][,kv_events=ENDPOINT][,device=LABEL]",
        help="a decode vLLM server; identity= is its kvpush identity_port, so the router "
        "can refuse a pair that cannot exchange KV before sending it requests; the other "
        "options as --prefill's (repeatable)",
    )
    router.add_argument("--port", type=a.port, default=8000, help="port to listen on")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument(
        "--mode", choices=("push", "pull"), default="push", help="the instances' kvpush mode"
    )
    router.add_argument(
        "--timeout",
        type=a.seconds,
        default=300.0,
        help="seconds a leg may stay silent before it counts as failed (not a total)",
    )
    router.add_argument(
        "--cooldown",
        type=a.optional_seconds,
        default=10.0,
        help="seconds a failed instance is not picked",
    )
    router.add_argument(
        "--health-interval",
        type=a.optional_seconds,
        default=5.0,
        help="seconds between /health checks of every instance (0: none)",
    )
    router.add_argument(
        "--keepalive",
        type=a.optional_seconds,
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
    add_routing_options(router)
    router.set_defaults(run=_router)

    secret = a.command(
        commands,
        "secret",
        "print a new shared secret for a deployment (set it as KVPUSH_SECRET on every "
        "prefill and decode instance)",
    )
    secret.set_defaults(run=_secret)

    demo = a.command(
        commands, "demo", "tiny model, vLLM prefill + decode with kvpush, router, a few requests"
    )
    demo.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    demo.add_argument("--max-tokens", type=a.count, default=24, help="tokens each answer asks")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage error: already said
        return exc.code if isinstance(exc.code, int) else 0
    before = signal.signal(signal.SIGTERM, _unwind)
    try:
        code = args.run(args)
        sys.stdout.flush()  # inside the try: a reader gone away shows here
        return code
    except KVPushError as exc:
        print(f"kvpush: error: {exc}", file=sys.stderr)
        return a.USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Python would complain again flushing stdout at exit: point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    finally:
        signal.signal(signal.SIGTERM, before)


def _version() -> str:
    try:
        return metadata.version("kvpush")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _unwind(signum: int, frame: object) -> None:
    """SIGTERM (`timeout`, `kill`, a cancelled CI job) unwinds the command as Ctrl-C
    does. The vLLM servers and routers that `demo` and `bench` start run in their own
    sessions, out of reach of a signal to ours: only the command's own clean-up stops
    them, and Python's default for SIGTERM skips it."""
    # A second SIGTERM must not cut that clean-up short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)
