"""The benchmarks' helper processes: a bench hears at once when one is gone, and none
outlives a killed bench."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kvpush.bench import children
from kvpush.errors import KVPushError


@pytest.fixture
def inbox():
    box = mp.get_context("spawn").Queue()
    yield box
    box.close()


def test_an_answer_put_just_before_the_child_ends_is_taken(inbox):
    child = children.start("answerer", inbox.put, "the answer")
    assert children.take(inbox, "its answer", 60, [child]) == "the answer"
    children.stop([child])
    assert child.exitcode == 0


def test_a_child_that_fails_is_named_at_once_not_at_the_deadline(inbox):
    child = children.start("sender", os._exit, 3)
    started = time.monotonic()
    with pytest.raises(KVPushError, match=r"bench sender \(code 3\) ended before its result"):
        children.take(inbox, "its result", 120, [child])
    assert time.monotonic() - started < 30


def test_children_that_all_end_without_answering_are_named(inbox):
    quiet = [children.start(name, time.sleep, 0) for name in ("receiver", "sender")]
    with pytest.raises(KVPushError, match=r"receiver \(code 0\), sender \(code 0\) ended before"):
        children.take(inbox, "the result", 120, quiet)


def test_a_silent_child_is_named_at_the_deadline(inbox):
    child = children.start("receiver", time.sleep, 30)
    with pytest.raises(KVPushError, match=r"no the port in 1s \(receiver still running\)"):
        children.take(inbox, "the port", 1, [child])
    child.kill()
    children.stop([child])


@pytest.mark.parametrize("after_s", [0, 3], ids=["while-it-starts", "once-it-runs"])
def test_no_child_outlives_a_killed_bench(after_s):
    script = (
        "import time\n"
        "from kvpush.bench import children\n"
        "child = children.start('sender', time.sleep, 120)\n"
        f"time.sleep({after_s})\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(bench.stdout.readline()))
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the bench's child outlived it"
    finally:
        bench.kill()
        bench.wait(10)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
