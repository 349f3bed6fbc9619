"""The request ledger and the workers' outcomes, driven with plain events."""

from __future__ import annotations

import pathlib

import pytest

from kvpush.engine.decode import DECODE_TRANSITIONS, DecodeState
from kvpush.engine.ledger import Ledger
from kvpush.engine.outcomes import Outcomes
from kvpush.engine.prefill import PREFILL_TRANSITIONS, PrefillState
from kvpush.engine.steps import Announce, Expect, Pending, Produce, Progress
from kvpush.errors import ProtocolError

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "engine.md"
BLOCK = 16
ANNOUNCE = Announce("t1", ("10.0.0.5:7100",), "engine-p", ("b0",))


def _decode(ledger: Ledger, request_id: str = "d1", tid: str = "t1") -> None:
    ledger.decode.announced(request_id, tid, Announce(tid, ANNOUNCE.producers, "engine-p"))


def test_a_decode_leg_claims_the_blocks_after_its_cached_prefix_and_lands():
    ledger = Ledger(BLOCK)
    _decode(ledger)
    assert ledger.take_plan().announces == [Announce("t1", ANNOUNCE.producers, "engine-p")]
    match = ledger.decode.matched("d1", prompt_len=100, computed=32)
    assert (match.tokens, match.load_async, match.local) == (68, True, False)
    assert ledger.decode.allocated("d1", [list(range(10, 17))], external_tokens=68)
    plan = ledger.take_plan()
    # Tokens 32..99 are blocks 2..6 of the request's seven.
    assert plan.expects == [Expect("d1", "t1", ANNOUNCE.producers, (12, 13, 14, 15, 16), 2,
                                   "engine-p")]  # fmt: skip
    assert ledger.counts()["receiving"] == 1 and ledger.waiting_on_transfers()
    ledger.decode.loaded("d1", failed=False)
    assert ledger.decode.legs["d1"].state == DecodeState.LANDED
    assert ledger.counts() == {"sending": 0, "producing": 0, "receiving": 0}
    assert not ledger.finished("d1").keep_blocks and not ledger.knows("d1")
    assert not ledger.take_plan().carries_work()  # landed: nothing to abort


def test_a_decode_leg_cached_whole_here_lets_the_producer_free_its_copy():
    ledger = Ledger(BLOCK)
    _decode(ledger)
    ledger.take_plan()
    match = ledger.decode.matched("d1", prompt_len=64, computed=64)
    assert (match.tokens, match.local) == (0, True)
    assert ledger.take_plan().aborts == ["t1"]
    assert not ledger.decode.allocated("d1", [[1, 2, 3, 4]], external_tokens=0)


@pytest.mark.parametrize("claimed", [False, True])
def test_a_decode_leg_aborted_before_its_kv_arrived_ends_its_transfer(claimed):
    ledger = Ledger(BLOCK)
    _decode(ledger)
    if claimed:
        ledger.decode.matched("d1", 40, 0)
        ledger.decode.allocated("d1", [[5, 6, 7]], 40)
    ledger.take_plan()
    ledger.finished("d1")
    assert ledger.take_plan().aborts == ["t1"]
    assert ledger.counts()["receiving"] == 0 and not ledger.waiting_on_transfers()


def test_a_rejected_leg_fails_when_allocated_with_its_reason():
    ledger = Ledger(BLOCK)
    ledger.decode.rejected("d1", "t1", "transfer mode mismatch")
    assert ledger.decode.matched("d1", 40, 40).tokens == 1  # always something to fail
    assert not ledger.decode.allocated("d1", [[1, 2, 3]], 40)
    assert ledger.take_plan().rejects == [("d1", "transfer mode mismatch")]
    ledger.decode.loaded("d1", failed=True)
    assert ledger.decode.legs["d1"].state == DecodeState.FAILED


def _leader_and_follower(ledger: Ledger) -> None:
    _decode(ledger, "0_d")
    ledger.decode.matched("0_d", 40, 0)
    ledger.decode.allocated("0_d", [[1, 2, 3]], 40)
    assert not ledger.decode.follows("1_d", "t1.1", "0_d", Announce("t1.1", ("p:1",)))


def test_a_follower_waits_for_its_siblings_kv_then_reads_the_prefix_cache():
    ledger = Ledger(BLOCK)
    _leader_and_follower(ledger)
    plan = ledger.take_plan()
    assert "t1.1" in plan.aborts  # whatever the producer made for it goes at once
    assert ledger.decode.matched("1_d", 40, 0).tokens is None  # ask again later
    ledger.decode.loaded("0_d", failed=False)
    assert ledger.decode.matched("1_d", 40, 40).local


def test_under_the_fail_policy_a_failed_load_fails_its_followers_too():
    ledger = Ledger(BLOCK, recompute_on_failure=False)
    _leader_and_follower(ledger)
    loaded = ledger.decode.loaded("0_d", failed=True)
    assert [r for r, _ in loaded.followers_failed] == ["1_d"]
    assert ledger.decode.legs["1_d"].state == DecodeState.REJECTED
    assert "0_d" in ledger.decode.problem("1_d")
    # A sibling arriving after the failure fails at once.
    assert "0_d" in ledger.decode.follows("2_d", "t1.2", "0_d", Announce("t1.2", ("p:1",)))


def test_under_the_recompute_policy_followers_compute_the_prompt():
    ledger = Ledger(BLOCK, recompute_on_failure=True)
    _leader_and_follower(ledger)
    loaded = ledger.decode.loaded("0_d", failed=True)
    assert loaded.recomputed and not loaded.followers_failed
    assert ledger.decode.matched("1_d", 40, 0).local


def _prefill(ledger: Ledger, prompt_len: int = 40) -> None:
    ledger.prefill.arrived("p1", "t1", "base", prompt_len, named_here=False)
    ledger.prefill.blocks_assigned("p1", [[7, 8, 9]], resumed=True)


def test_a_prefill_leg_is_handed_over_chunk_by_chunk_then_held_until_released():
    ledger = Ledger(BLOCK, progressive=True)
    _prefill(ledger)
    assert ledger.take_plan().pending == [Pending("t1")]
    marks = ledger.prefill.step_scheduled({"p1": 20})
    assert marks == [("p1", "computing")]
    assert ledger.take_plan().progress == [Progress("p1", "t1", (7, 8, 9), 1)]
    assert ledger.prefill.step_scheduled({"p1": 40}) == [("p1", "computing"), ("p1", "last_step")]
    assert ledger.take_plan().produces == [Produce("p1", "t1", (7, 8, 9))]
    assert ledger.prefill.step_scheduled({"p1": 41}) == []  # decoding its one token: nothing more
    finish = ledger.finished("p1", sendable=True)
    assert finish.keep_blocks and finish.echo is not None and finish.echo.transfer_id == "t1"
    assert ledger.counts() == {"sending": 1, "producing": 0, "receiving": 0}
    assert ledger.prefill.released(["p1", "other"]) == ["p1"] and not ledger.knows("p1")


def test_a_prefill_finished_before_any_step_frees_at_once():
    ledger = Ledger(BLOCK)
    _prefill(ledger)
    ledger.take_plan()
    assert not ledger.finished("p1").keep_blocks
    assert ledger.take_plan().aborts == ["t1"] and not ledger.knows("p1")


def test_a_prefill_preempted_once_its_kv_was_handed_over_is_spoiled():
    ledger = Ledger(BLOCK)
    _prefill(ledger)
    ledger.prefill.step_scheduled({"p1": 40})
    ledger.take_plan()
    assert ledger.prefill.preempted("p1")
    assert ledger.take_plan().aborts == ["t1"]
    assert ledger.prefill.step_scheduled({"p1": 40}) == []  # recomputed: nothing sent again
    finish = ledger.finished("p1", sendable=True)
    assert finish.keep_blocks and finish.echo is None  # a WRITE may still read them


def test_a_prefill_preempted_before_any_hand_over_just_resumes():
    ledger = Ledger(BLOCK, progressive=False)
    _prefill(ledger)
    ledger.prefill.step_scheduled({"p1": 16})
    assert not ledger.prefill.preempted("p1")
    assert ledger.prefill.legs["p1"].state == PrefillState.ADMITTED
    ledger.prefill.blocks_assigned("p1", [[3, 4, 5]], resumed=True)
    ledger.prefill.step_scheduled({"p1": 40})
    assert ledger.take_plan().produces == [Produce("p1", "t1", (3, 4, 5))]


def test_a_prefill_that_ends_unsendable_still_waits_for_the_producer():
    ledger = Ledger(BLOCK)
    _prefill(ledger)
    ledger.prefill.step_scheduled({"p1": 40})
    ledger.take_plan()
    finish = ledger.finished("p1", sendable=False)  # aborted in its last step
    assert finish.keep_blocks
    assert ledger.take_plan().aborts == ["t1"]


def test_a_move_the_table_does_not_allow_fails_naming_the_request():
    ledger = Ledger(BLOCK)
    _decode(ledger)
    ledger.decode.loaded("d1", failed=False)  # never claimed: not a landing
    leg = ledger.decode.legs["d1"]
    assert leg.state == DecodeState.ANNOUNCED
    with pytest.raises(ProtocolError, match=r"t1.*announced.*landed"):
        DECODE_TRANSITIONS.move(leg, DecodeState.LANDED)


def test_docs_show_the_tables_the_code_enforces():
    text = DOCS.read_text()
    for name, table in (("decode", DECODE_TRANSITIONS), ("prefill", PREFILL_TRANSITIONS)):
        marker = f"<!-- {name}-leg-transitions: rendered from kvpush.engine.{name} -->"
        assert marker in text
        assert text.split(marker, 1)[1].lstrip().startswith(table.markdown())


def test_outcomes_report_a_prefill_only_once_both_the_engine_and_the_producer_let_go():
    outcomes = Outcomes()
    outcomes.sending("p1", "t1")
    outcomes.receiving("d1", "t2")
    outcomes.engine_finished({"p1", "unrelated"})
    assert outcomes.take() == (set(), set(), set())
    assert outcomes.let_go("t1") == "p1" and outcomes.let_go("t1") is None
    assert outcomes.received("t2", ok=False) == "d1"
    assert outcomes.take() == ({"p1"}, {"d1"}, {"d1"})
    assert outcomes.take() == (set(), set(), set())


def test_outcomes_of_a_producer_release_before_the_engine_finished_wait_for_it():
    outcomes = Outcomes()
    outcomes.sending("p1", "t1")
    outcomes.let_go("t1")
    assert outcomes.take()[0] == set()
    outcomes.engine_finished({"p1"})
    assert outcomes.take()[0] == {"p1"}


def test_the_ledger_hands_out_each_legs_beginning_moves_and_end_in_order():
    """What a request's timeline is read from (kvpush.vllm.spans): a move the ledger
    made but did not hand out, or handed out twice, would put a milestone wrong."""
    ledger = Ledger(BLOCK)
    ledger.announced("d1", "t1", ANNOUNCE, "", "router-t1")
    ledger.matched("d1", 40, 0)
    ledger.allocated("d1", [[5, 6, 7]], 40)
    ledger.loaded("d1", failed=False)
    ledger.finished("d1")
    ledger.arrived("p1", "t2", "router-t2", 20, named_here=False)
    ledger.blocks_assigned("p1", [[1, 2]], resumed=False)
    ledger.step_scheduled({"p1": 20})
    ledger.finished("p1", sendable=True)
    ledger.released(["p1"])
    moves = [(m.request_id, m.before, m.after, m.transfer_id) for m in ledger.take_moves()]
    assert moves == [
        ("d1", None, "announced", "router-t1"),
        ("d1", "announced", "loading", "router-t1"),
        ("d1", "loading", "landed", "router-t1"),
        ("d1", "landed", None, "router-t1"),
        ("p1", None, "admitted", "router-t2"),
        ("p1", "admitted", "computing", "router-t2"),
        ("p1", "computing", "sending", "router-t2"),
        ("p1", "sending", "held", "router-t2"),
        ("p1", "held", "released", "router-t2"),
    ]
    assert ledger.take_moves() == []


def test_a_transfer_let_go_between_chunks_is_not_held_again_by_a_later_plan():
    """Each chunk's step names the transfer again: a record that went back to
    sending would report its blocks only after a release that never comes."""
    outcomes = Outcomes()
    outcomes.sending("p1", "t1")
    assert outcomes.sender("t1") == "p1"
    assert outcomes.let_go("t1") == "p1"
    outcomes.sending("p1", "t1")  # the next chunk's plan
    assert outcomes.sender("t1") is None and outcomes.let_go("t1") is None
    outcomes.engine_finished({"p1"})
    assert outcomes.take() == ({"p1"}, set(), set())
    outcomes.rejected("d1")  # refused at once: reported failed, with no transfer
    assert outcomes.received("t9", ok=True) is None
    assert outcomes.take() == (set(), {"d1"}, {"d1"})


def test_docs_show_the_outcome_table_the_worker_enforces():
    from kvpush.engine.outcomes import OUTCOME_TRANSITIONS

    marker = "<!-- outcome-transitions: rendered from kvpush.engine.outcomes -->"
    text = DOCS.read_text()
    assert marker in text
    assert text.split(marker, 1)[1].lstrip().startswith(OUTCOME_TRANSITIONS.markdown())
