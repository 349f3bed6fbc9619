"""`kvpush bench transfer --across-namespaces` refuses what it cannot do, in one line,
before it makes anything; a link rate is read as tc writes one."""

from __future__ import annotations

import argparse

import pytest

from kvpush import arguments
from kvpush.bench import across
from kvpush.cli import main


def test_it_refuses_without_root_naming_why(monkeypatch, capsys):
    monkeypatch.setattr(across.os, "geteuid", lambda: 1000)
    made = []
    monkeypatch.setattr(across.TwoHosts, "start", lambda self: made.append(self))
    assert main(["bench", "transfer", "--across-namespaces", "--sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "--across-namespaces needs root" in err and "network namespaces" in err
    assert not made, "it made namespaces before refusing"


def test_a_link_rate_needs_the_link(capsys):
    assert main(["bench", "transfer", "--link-rate", "1gbit"]) == 2
    assert "--link-rate caps the link --across-namespaces makes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, bits", [("300mbit", 300_000_000), ("1gbit", 10**9), ("1.5Gbit", 1_500_000_000)]
)
def test_a_rate_is_read_as_tc_writes_it(text, bits):
    assert arguments.bit_rate(text) == bits
    assert across.rate_name(bits).endswith("bit/s")


@pytest.mark.parametrize("text", ["300", "1gbps", "-1mbit", "xmbit", "nanmbit", "0gbit"])
def test_a_rate_tc_would_not_take_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a rate such as 300mbit"):
        arguments.bit_rate(text)
