"""What a node's outcome says when a transfer failed: the words a trace and the client
get (the router quotes decode's trace to the client)."""

from __future__ import annotations

from kvpush.node.interpreter import Outcome


def test_a_failure_with_no_detail_says_its_reason_alone():
    # A transfer failed as the watchdog's or a WRITE's reason carries no detail: the
    # client read "…could not load the prompt's KV: write_failed: " with a dangling colon.
    assert Outcome("failed", "t1", "write_failed").said() == "write_failed"


def test_a_failure_with_a_detail_says_both():
    outcome = Outcome("failed", "t1", "peer_lost", "connection reset")
    assert outcome.said() == "peer_lost: connection reset"
