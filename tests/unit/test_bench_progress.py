"""A long benchmark says how far it has got: a line per step where stderr is a log."""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import dataclass

from kvpush.bench.progress import Progress, duration
from kvpush.bench.report import Report


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(total: int = 4, **kwargs):
    stream, clock = io.StringIO(), FakeClock()
    steps = Progress("kvpush bench serve", "cell", total, stream=stream, clock=clock, **kwargs)
    return steps, stream, clock


def test_each_step_is_a_line_with_its_place_elapsed_and_eta():
    steps, stream, clock = _progress(bar=False)
    steps.show("push colocated 1024 tok 8/s")
    clock.now += 125
    steps.advance()
    steps.show("push colocated 1024 tok 1/s")
    assert stream.getvalue().splitlines() == [
        "kvpush bench serve: cell 1/4, push colocated 1024 tok 8/s, elapsed 0s, ETA unknown",
        # one cell in 125 s, three left
        "kvpush bench serve: cell 2/4, push colocated 1024 tok 1/s, elapsed 2m05s, ETA 6m15s",
    ]


def test_a_count_of_steps_done_and_steps_that_will_not_run():
    steps, stream, clock = _progress(total=1000, bar=False, counting_done=True)
    clock.now += 3600
    steps.show("sent 260", done=250)
    steps.drop(500)
    steps.show("sent 260")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kvpush bench serve: cell 250/1000, sent 260, elapsed 1h00m, ETA 3h00m"
    assert lines[1].endswith("cell 250/500, sent 260, elapsed 1h00m, ETA 1h00m")


def test_a_pipe_gets_lines_and_a_terminal_a_bar():
    steps, _, _ = _progress()  # a StringIO is no terminal
    assert not steps.is_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    bar = Progress("kvpush bench serve", "cell", 2, stream=terminal)
    bar.show("plain colocated")
    bar.advance()
    bar.close()
    assert bar.is_bar is False  # closed
    assert "1/2" in terminal.getvalue() and "plain colocated" in terminal.getvalue()


@dataclass
class Row:
    n: int


def test_a_report_counts_each_result_as_a_step(capsys):
    steps, stream, clock = _progress(total=2, bar=False)
    report = Report(False, steps)
    report.step("first")
    clock.now += 10
    report.add(Row(1))
    report.step("second")
    assert report.finish(lambda rows: print(len(rows))) == [Row(1)]
    assert capsys.readouterr().out == "1\n"
    assert stream.getvalue().splitlines()[-1].endswith("cell 2/2, second, elapsed 10s, ETA 10s")


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (0, 45, 125, 3600, 3725)] == [
        "0s",
        "45s",
        "2m05s",
        "1h00m",
        "1h02m",
    ]


def test_json_lines_stay_alone_on_stdout_whatever_writes_to_its_descriptor():
    # UCX logs to descriptor 1 ("failed to get interface index" while a network
    # namespace goes away); mixed into the JSON lines it broke a reader in CI.
    script = """
import os, sys
from dataclasses import dataclass
from kvpush.bench.progress import Progress
from kvpush.bench.report import Report

@dataclass
class Row:
    size: int

report = Report(True, Progress("kvpush bench transfer", "result", 2, stream=sys.stderr, bar=False))
os.write(1, b"UCX  ERROR   failed to get interface index\\n")
report.add(Row(1))
print("a stray print")
report.add(Row(4))
report.finish(print)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['{"size": 1}', '{"size": 4}']
    assert "failed to get interface index" in done.stderr and "a stray print" in done.stderr
