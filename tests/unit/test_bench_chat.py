"""The chat workload: seeded, sessions whose turns grow one prefix, short and long
prompts, nothing past the length."""

from __future__ import annotations

import pytest

from kvpush.bench import chat
from kvpush.bench.serve import Settings
from kvpush.errors import KVPushError


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    assert chat.requests(60, 2.0, 7, 1024) == chat.requests(60, 2.0, 7, 1024)
    assert chat.requests(60, 2.0, 7, 1024) != chat.requests(60, 2.0, 8, 1024)


def test_each_turn_carries_its_sessions_last_prompt_and_the_mix_has_every_kind():
    asked = chat.requests(400, 4.0, 1, 1536)
    assert len(asked) == 400
    assert [r.at for r in asked] == sorted(r.at for r in asked)
    assert {r.kind for r in asked} == {"turn", "short", "long"}
    assert max(len(r.tokens) for r in asked) <= 1536
    last: dict[int, list[int]] = {}
    for r in (r for r in asked if r.kind == "turn"):
        previous = last.get(r.session)
        if previous is not None:
            assert r.tokens[: len(previous)] == previous and len(r.tokens) > len(previous)
        last[r.session] = r.tokens
    multi = [s for s in last if sum(r.session == s for r in asked) > 1]
    assert multi, "no session had a second turn"
    openings = {tuple(t[: chat.SYSTEM_TOKENS]) for t in last.values()}
    assert len(openings) == 1  # every session opens with the one system prompt
    shorts = [len(r.tokens) for r in asked if r.kind == "short"]
    assert (
        max(shorts) <= chat.SHORT_TOKENS[1] < min(len(r.tokens) for r in asked if r.kind == "long")
    )


def test_serve_refuses_a_workload_it_does_not_know():
    with pytest.raises(KVPushError, match="unknown workload 'chats'"):
        Settings(workload="chats", configs=("plain",))
