"""The router's per-request decision, its placement scores, and its prefix index
(fed by the router's own record or by vLLM's KV-cache events, encoded here by
vLLM's own classes where vLLM is installed)."""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import pytest

from kvpush.errors import ConfigError
from kvpush.metrics import Metrics
from kvpush.router.decide import DecisionRule, decide
from kvpush.router.instances import Instance, Pool
from kvpush.router.kv_events import Subscription, apply
from kvpush.router.pace import BOUND, HALF_LIFE_S, KEEP, Pace, factors
from kvpush.router.placement import Candidate, Weights, pair_cost, place_alone, place_pair
from kvpush.router.policy import RoutingPolicy, add_options, policy_of, roles
from kvpush.router.prefix import Blocks, PrefixIndex, chain
from kvpush.router.request import Trace
from kvpush.router.route import Computing, Planner

AUTO = DecisionRule("auto", min_uncached_tokens=2048, alone_when_idle=True,
                    prefill_busier_tokens=1024)  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "cached", "decode_queue", "backlogs", "path", "reason"),
    [
        (300, 0, 3, (0, 0), "decode_alone", "short"),
        (5000, 4096, 3, (0, 0), "decode_alone", "cached_on_decode"),
        (5000, 0, 0, (0, 0), "decode_alone", "decode_idle"),
        # The prefill instance is computing a long prompt, decode only decodes.
        (5000, 0, 1, (0, 2800), "decode_alone", "prefill_busier"),
        (5000, 0, 1, (2000, 3024), "decode_alone", "prefill_busier"),
        (5000, 0, 1, (2000, 3023), "disaggregated", "long_uncached"),
        # Many requests in flight at decode, none computing: prefill's one long
        # prompt outweighs them.
        (5000, 0, 9, (0, 1024), "decode_alone", "prefill_busier"),
        (5000, 0, 1, (3000, 2500), "disaggregated", "long_uncached"),
        (5000, 2952, 2, (0, 0), "disaggregated", "long_uncached"),  # 2,048 uncached: not under
        (None, 0, 0, (0, 0), "disaggregated", "untokenized"),
    ],
)
def test_auto_runs_on_decode_alone_unless_a_long_uncached_prompt_meets_a_busy_decode(
    prompt, cached, decode_queue, backlogs, path, reason
):
    decode_backlog, prefill_backlog = backlogs
    decision = decide(AUTO, prompt, cached, decode_queue, decode_backlog=decode_backlog,
                      prefill_backlog=prefill_backlog)  # fmt: skip
    assert (decision.path, decision.reason) == (path, reason)


def test_always_and_never_ignore_the_numbers_and_idle_can_be_turned_off():
    assert decide(DecisionRule("always"), 10, 0, 0).reason == "rule_always"
    assert decide(DecisionRule("never"), 10**6, 0, 9).path == "decode_alone"
    busy_or_not = DecisionRule("auto", alone_when_idle=False)
    assert decide(busy_or_not, 5000, 0, 0).path == "disaggregated"
    assert decide(DecisionRule("auto", min_uncached_tokens=0), 1, 0, 1).disaggregate


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rule": "sometimes"}, "sometimes"),
        ({"min_uncached_tokens": -1}, "-1"),
        ({"prefill_busier_tokens": 0}, "prefill_busier_tokens"),
    ],
)
def test_a_bad_rule_is_refused_naming_what_is_wrong(fields, named):
    with pytest.raises(ConfigError, match=named):
        DecisionRule(**fields)


def test_a_pair_is_scored_on_compute_saved_transfer_saved_and_both_queues():
    w = Weights(compute=1.0, transfer=0.25, queue_tokens=512)
    fresh, warm = Candidate("p0", 0, 0), Candidate("p1", 1024, 0)
    cold_d, warm_d = Candidate("d0", 0, 0), Candidate("d1", 1024, 0)
    assert pair_cost(w, 2048, fresh, cold_d) == 2048 + 512
    assert pair_cost(w, 2048, warm, warm_d) == 1024 + 256
    # Prefill's prefix saves compute, decode's saves transfer: the pair holding both wins.
    assert place_pair(w, 2048, [fresh, warm], [cold_d, warm_d]) == (warm, warm_d)
    # A queue outweighs a prefix once its requests weigh more than the prefix saves.
    busy_warm = Candidate("p1", 1024, 3)
    assert place_pair(w, 2048, [fresh, busy_warm], [warm_d]) == (fresh, warm_d)
    # Pairs that cannot exchange KV are not scored while another can.
    assert place_pair(w, 2048, [fresh, warm], [cold_d, warm_d],
                      pairs=lambda p, d: d != "d1") == (warm, cold_d)  # fmt: skip


def test_a_session_goes_where_its_prefix_is_unless_that_decode_is_much_busier():
    w = Weights(queue_tokens=512)
    holds, other = Candidate("d0", 3000, 1), Candidate("d1", 0, 0)
    assert place_alone(w, 3200, [holds, other], turn=0).key == "d0"
    assert place_alone(w, 3200, [Candidate("d0", 3000, 8), other], turn=0).key == "d1"
    ties = {
        place_alone(w, 100, [Candidate("a", 0, 0), Candidate("b", 0, 0)], t).key for t in (0, 1)
    }
    assert ties == {"a", "b"}  # equals go round robin


def test_the_index_finds_the_longest_leading_run_of_blocks_an_instance_holds():
    index = PrefixIndex()
    first = list(range(100))
    index.sent("d0", first, block_size=16)
    assert index.cached_tokens("d0", first, 16) == 96  # six whole blocks
    turn = first + [7] * 40  # the next turn: the same start, more after
    assert index.cached_tokens("d0", turn, 16) == 96
    assert index.cached_tokens("d1", turn, 16) == 0
    other = [1] + first[1:]  # one token differs at the start: nothing matches
    assert index.cached_tokens("d0", other, 16) == 0
    index.forget("d0")
    assert index.cached_tokens("d0", first, 16) == 0


def test_the_index_forgets_the_least_recently_used_blocks_first():
    blocks = Blocks(block_size=4, capacity=3)
    a, b = [1, 2, 3, 4] * 3, [9, 9, 9, 9] * 3
    blocks.add(chain(a, 4))
    assert blocks.cached_tokens(a) == 12
    blocks.add(chain(b, 4))
    assert blocks.cached_tokens(a) == 0 and blocks.cached_tokens(b) == 12


def _batch(*events):
    """A KVEventBatch as vLLM's publisher encodes it (and this module decodes it)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=list(events)))
    return msgspec.msgpack.decode(payload)


def test_vllms_kv_events_say_what_an_instance_holds():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    stored = kv_events.BlockStored(
        block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=list(range(32)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    more = kv_events.BlockStored(
        block_hashes=[b"h3"], parent_block_hash=b"h2", token_ids=list(range(32, 48)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    blocks = Blocks()
    assert apply(blocks, _batch(stored, more)) == 2
    assert blocks.cached_tokens(list(range(60))) == 48
    assert not PrefixIndex().of("x").from_events and blocks.from_events
    apply(blocks, _batch(kv_events.BlockRemoved(block_hashes=[b"h2"], medium="GPU")))
    assert blocks.cached_tokens(list(range(60))) == 16  # the run stops at the hole
    apply(blocks, _batch(kv_events.AllBlocksCleared()))
    assert blocks.cached_tokens(list(range(60))) == 0


def test_events_of_a_parent_never_heard_of_or_another_group_name_nothing():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    orphan = kv_events.BlockStored(
        block_hashes=[b"h9"], parent_block_hash=b"missed", token_ids=list(range(16)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    other_group = kv_events.BlockStored(
        block_hashes=[b"g1"], parent_block_hash=None, token_ids=list(range(16)),
        block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=1,
    )  # fmt: skip
    blocks = Blocks()
    apply(blocks, _batch(orphan, other_group))
    assert blocks.cached_tokens(list(range(16))) == 0
    assert apply(blocks, "not a batch") == 0


def test_load_placement_alternates_equal_decodes_and_decides_on_the_one_it_picked():
    prefill = Pool([Instance("http://p:1", "prefill")])
    decode = Pool([Instance("http://d:1", "decode"), Instance("http://d:2", "decode")])
    index, metrics = PrefixIndex(), Metrics()
    planner = Planner(RoutingPolicy(AUTO, "load"), prefill, decode, index, metrics)
    index.sent("http://d:2", LONG_PROMPT)
    routes = [planner.plan(LONG_PROMPT, None, lambda p, d: True) for _ in range(4)]
    assert [r.decode.url for r in routes] == ["http://d:1", "http://d:2"] * 2
    assert [r.decision.reason for r in routes] == ["decode_idle", "cached_on_decode"] * 2
    decode.instances[1].draining = True
    assert {planner.plan(LONG_PROMPT, None, lambda p, d: True).decode.url for _ in range(3)} == {
        "http://d:1"
    }
    assert metrics.counter("router_decisions", path="decode_alone", reason="decode_idle") == 5


LONG_PROMPT = list(range(3000))


def test_a_subscription_reads_vllms_wire_format_and_starts_over_after_a_gap():
    """Over a real ZMQ PUB socket, frames as vLLM's ZmqEventPublisher sends them:
    topic, sequence number (8 bytes, big-endian), msgpack batch."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    zmq = pytest.importorskip("zmq")

    def stored(hashes, parent, first):
        return kv_events.BlockStored(
            block_hashes=hashes, parent_block_hash=parent,
            token_ids=list(range(first, first + 16 * len(hashes))), block_size=16,
            lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip

    async def scenario():
        publisher = zmq.Context.instance().socket(zmq.PUB)
        port = publisher.bind_to_random_port("tcp://127.0.0.1")
        blocks, metrics = Blocks(), Metrics()
        subscription = Subscription(f"tcp://127.0.0.1:{port}", "d", blocks, metrics)
        subscription.start()
        encode = msgspec.msgpack.Encoder().encode

        async def send(seq, *events):
            batch = encode(kv_events.KVEventBatch(ts=1.0, events=list(events)))
            publisher.send_multipart((b"", seq.to_bytes(8, "big"), batch))

        # A slow joiner misses the first messages: send until the stored block is seen.
        for _ in range(100):
            await send(0, stored([b"a", b"b"], None, 0))
            await asyncio.sleep(0.05)
            if blocks.cached_tokens(list(range(40))) == 32:
                break
        assert blocks.cached_tokens(list(range(40))) == 32
        assert metrics.counter("kv_events", instance="d") >= 1
        gaps = metrics.counter("kv_events_gaps", instance="d")
        await send(7, stored([b"c"], None, 100))  # 1 expected: events were lost
        for _ in range(100):
            await asyncio.sleep(0.05)
            if metrics.counter("kv_events_gaps", instance="d") > gaps:
                break
        assert blocks.cached_tokens(list(range(40))) == 0  # the old blocks: forgotten
        assert blocks.cached_tokens(list(range(100, 120))) == 16
        await subscription.close()
        publisher.close(linger=0)

    asyncio.run(scenario())


def test_one_prompt_asked_of_many_instances_is_hashed_once_per_block_size(monkeypatch):
    from kvpush.router import prefix

    calls = []
    real = prefix.chain
    monkeypatch.setattr(prefix, "chain", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    index = prefix.PrefixIndex()
    tokens = list(range(64))
    index.sent("a", tokens, 16)
    calls.clear()
    chains: dict[int, list[int]] = {}
    held = [index.cached_tokens(url, tokens, 16, chains) for url in ("a", "b", "c")]
    assert held == [64, 0, 0]
    assert index.cached_tokens("d", tokens, 32, chains) == 0
    assert calls == [16, 32]


def _fleet(aggregate_on, placement="prefix", rule=AUTO):
    """A planner over one prefill and two decode instances, and its counters."""
    prefill = Pool([Instance("http://p:1", "prefill")])
    decode = Pool([Instance("http://d:1", "decode"), Instance("http://d:2", "decode")])
    metrics = Metrics()
    policy = RoutingPolicy(rule, placement, aggregate_on=aggregate_on)
    return Planner(policy, prefill, decode, PrefixIndex(), metrics), metrics


def _whole_where(planner, prompt):
    route = planner.plan(prompt, None, lambda p, d: True)
    assert route.prefill is None, route.as_dict()
    planner.sent(route)
    return route.decode


def test_a_whole_request_may_run_on_an_idle_prefill_instance_while_decodes_are_busy():
    for aggregate_on, role in ((("decode",), "decode"), (("prefill", "decode"), "prefill")):
        planner, metrics = _fleet(aggregate_on)
        for d in planner.decode.instances:
            d.outstanding = 1
        assert _whole_where(planner, list(range(300))).role == role
        assert metrics.counter("router_whole_requests", role=role) == 1
        assert metrics.counter("router_decisions", path="decode_alone", reason="short") == 1


def test_a_sessions_turns_follow_their_prefix_onto_a_prefill_instance():
    """The index learns what a prefill instance holds from the whole requests it ran."""
    planner, _ = _fleet(("prefill", "decode"))
    p = planner.prefill.instances[0]
    for d in planner.decode.instances:
        d.outstanding = 1
    first = _whole_where(planner, LONG_PROMPT)
    assert first is p
    for d in planner.decode.instances:
        d.outstanding = 0  # the decodes idle now: only the prefix draws the turn to p
    turn = LONG_PROMPT + [7] * 100
    route = planner.plan(turn, None, lambda p, d: True)
    assert (route.decode, route.decision.reason) == (p, "cached_on_decode")
    assert route.cached >= 2992 and route.as_dict()["decode_role"] == "prefill"


def test_a_draining_or_ejected_prefill_instance_runs_no_whole_request():
    planner, _ = _fleet(("prefill", "decode"))
    p = planner.prefill.instances[0]
    planner.prefill.instances.append(Instance("http://p:2", "prefill", outstanding=9))
    planner.index.sent(p.url, LONG_PROMPT)  # its prefix would draw the request there
    p.draining = True  # (the router drains no role's last instance)
    assert {_whole_where(planner, LONG_PROMPT).role for _ in range(4)} == {"decode"}
    p.draining, p.ejected_until = False, time.monotonic() + 60
    assert {_whole_where(planner, LONG_PROMPT).role for _ in range(4)} == {"decode"}


def test_a_disaggregated_request_still_pairs_a_prefill_with_a_decode_instance():
    busy = DecisionRule("auto", alone_when_idle=False)
    planner, metrics = _fleet(("prefill", "decode"), rule=busy)
    for _ in range(4):
        route = planner.plan(LONG_PROMPT, None, lambda p, d: True)
        assert route.decision.reason == "long_uncached"
        assert (route.prefill.role, route.decode.role) == ("prefill", "decode")
    assert metrics.counter("router_whole_requests", role="prefill") == 0


def test_a_burst_of_long_prompts_does_not_pile_onto_the_prefill_instance():
    """The decodes each run a decode and compute nothing; four long prompts come at
    once. The prefill instance takes the first; while it computes that, the next two
    would wait behind it, so they run on the decodes, one each; the fourth finds
    every instance as far behind, and is disaggregated again."""
    planner, metrics = _fleet(("decode",))
    for d in planner.decode.instances:
        d.outstanding = 1
    reasons, computers = [], []
    for i in range(4):
        route = planner.plan(list(range(i * 5000, i * 5000 + 3000)), None, lambda p, d: True)
        for leg in (route.prefill, route.decode):
            if leg is not None:
                leg.outstanding += 1
        Computing(route.computer, route.computing)  # as the router counts it until answered
        reasons.append(route.decision.reason)
        computers.append(route.computer.url)
    assert reasons == ["long_uncached", "prefill_busier", "prefill_busier", "long_uncached"]
    assert computers[0] == computers[3] == "http://p:1"
    assert {computers[1], computers[2]} == {"http://d:1", "http://d:2"}
    assert metrics.counter("router_decisions", path="decode_alone", reason="prefill_busier") == 2


def test_instances_on_one_device_count_each_others_compute():
    """Both decodes compute on one device. One of them computes a long prompt; a
    short prompt then waits behind it on the idle other just as much, so it runs on
    the prefill instance, whose device is free (it decodes one request). Without the
    labels the idle decode looks free and takes it."""
    for device, where in ((True, "http://p:1"), (False, "http://d:2")):
        planner, _ = _fleet(("prefill", "decode"))
        p, d1, d2 = planner.prefill.instances + planner.decode.instances
        if device:
            p.device, d1.device, d2.device = "core0", "core1", "core1"
        p.outstanding = d1.outstanding = 1
        Computing(d1, 2000)
        assert _whole_where(planner, list(range(300))).url == where
    # A prefill instance whose device-mate computes a long prompt is as far behind:
    # the next long prompt runs on the idle decode instance rather than wait there.
    for device, reason in ((False, "long_uncached"), (True, "prefill_busier")):
        planner, _ = _fleet(("decode",), rule=DecisionRule("auto", alone_when_idle=False))
        p, d1, d2 = planner.prefill.instances + planner.decode.instances
        if device:
            p.device = d1.device = "shared"
        d1.outstanding = d2.outstanding = 1
        Computing(d1, 2000)
        route = planner.plan(LONG_PROMPT, None, lambda p, d: True)
        assert route.decision.reason == reason
        assert route.computer.url == ("http://d:2" if device else "http://p:1")


def test_load_placement_spreads_whole_requests_over_every_instance_and_retries_across_roles():
    planner, _ = _fleet(("prefill", "decode"), placement="load", rule=DecisionRule("never"))
    used = {_whole_where(planner, [1, 2, 3]).url for _ in range(3)}
    assert used == {"http://p:1", "http://d:1", "http://d:2"}
    p = planner.prefill.instances[0]
    whole = planner.plan([1, 2, 3], p, lambda p, d: True)
    assert whole.decode is not p  # a retry avoids the instance that failed it
    assert planner.has_other(p, whole)  # a whole request may go to a decode instead
    paired = planner.plan(LONG_PROMPT, None, lambda p, d: True)
    paired.prefill = p
    assert not planner.has_other(p, paired)  # a prefill leg needs another prefill


def test_aggregate_on_names_prefill_decode_or_both():
    assert roles("decode, prefill") == ("prefill", "decode") and roles("decode") == ("decode",)
    for bad in ("", "gpu", "decode,gpu"):
        with pytest.raises(ConfigError):
            roles(bad)
    with pytest.raises(ConfigError, match="aggregate"):
        RoutingPolicy(aggregate_on=())
    parser = argparse.ArgumentParser()
    add_options(parser)
    assert policy_of(parser.parse_args([])).aggregate_on == ("decode",)
    args = parser.parse_args(["--aggregate-on", "prefill,decode"])
    assert policy_of(args).aggregate_on == ("prefill", "decode")


def test_a_turn_stays_on_its_prefix_when_what_is_in_flight_shares_its_device():
    """A turn's prefix sits on d1, which decodes five requests; d2 decodes none. On
    devices of their own, d2 is the less loaded and takes the turn. On one device, d2's
    prompt would wait for d1's five decodes just the same, so the prefix keeps the
    turn on d1; the decision still sees d1's own queue."""
    for device, where in ((False, "http://d:2"), (True, "http://d:1")):
        planner, _ = _fleet(("decode",), rule=DecisionRule("never"))
        _, d1, d2 = planner.prefill.instances + planner.decode.instances
        if device:
            d1.device = d2.device = "core1"
        planner.index.sent(d1.url, LONG_PROMPT[:200])
        d1.outstanding = 5
        route = planner.plan(LONG_PROMPT[:260], None, lambda p, d: True)
        assert route.decode.url == where, device
    planner, _ = _fleet(("decode",), rule=DecisionRule("auto", min_uncached_tokens=0))
    _, d1, d2 = planner.prefill.instances + planner.decode.instances
    d1.device = d2.device = "core1"
    planner.index.sent(d1.url, LONG_PROMPT[:200])
    d2.outstanding = 1
    route = planner.plan(LONG_PROMPT[:300], None, lambda p, d: True)
    assert (route.decode, route.decision.reason) == (d1, "decode_idle")


def test_compute_queued_on_an_instance_outweighs_the_prefix_it_holds():
    """A turn whose 1,000-token prefix sits where a long prompt is being computed
    goes elsewhere: one request in flight weighs 512 tokens, but that request's
    2,000 uncomputed tokens are what the turn would wait behind."""
    w = Weights(queue_tokens=512)
    decoding = Candidate("d0", 1000, 1, computing=0)  # its one request is past its first token
    computing = Candidate("d0", 1000, 1, computing=2000)
    other = Candidate("d1", 0, 0)
    assert place_alone(w, 1050, [decoding, other], turn=0).key == "d0"
    assert place_alone(w, 1050, [computing, other], turn=0).key == "d1"
    # A pair counts what prefill and decode each still compute.
    p, d = Candidate("p0", 0, 0, computing=300), Candidate("d0", 0, 0, computing=200)
    assert pair_cost(w, 1000, p, d) == 1000 + 300 + 200 + 0.25 * 1000


def test_a_route_names_the_tokens_its_computing_instance_lacks():
    planner, _ = _fleet(("decode",), rule=DecisionRule("never"))
    first = _whole_where(planner, LONG_PROMPT)
    route = planner.plan(LONG_PROMPT + [7] * 100, None, lambda p, d: True)
    assert route.decode is first and route.computer is first
    assert route.computing == len(LONG_PROMPT) + 100 - route.cached > 0
    assert route.as_dict()["computing"] == route.computing
    busy = DecisionRule("auto", alone_when_idle=False)
    planner, _ = _fleet(("decode",), rule=busy)
    paired = planner.plan(LONG_PROMPT, None, lambda p, d: True)
    assert paired.computer is paired.prefill and paired.computing == len(LONG_PROMPT)


def test_computing_counts_on_its_instance_until_done_once():
    instance = Instance("http://d:1", "decode")
    first, second = Computing(instance, 300), Computing(instance, 200)
    assert instance.computing == 500
    first.done()
    first.done()  # the milestone, then the attempt's end: counted off once
    assert instance.computing == 200
    second.done()
    assert instance.computing == 0


def test_a_milestone_runs_what_waits_on_it_at_its_next_mark_only():
    trace, ran = Trace(), []
    trace.mark("first_byte")  # an earlier attempt's
    trace.at("first_byte", lambda: ran.append(1))
    assert ran == []
    trace.mark("prefill_answered")
    assert ran == []
    trace.mark("first_byte")
    trace.mark("first_byte")
    assert ran == [1]


def test_a_pace_is_the_busy_time_over_the_tokens_and_drops_a_failed_attempts_time():
    pace = Pace()
    pace.busy(10.0)
    pace.busy(10.5)  # a second request while busy: the clock already runs
    pace.answered(3000, 11.0)
    assert pace.seconds_per_token(11.0) is None  # under LEARNT tokens: not used yet
    pace.answered(3000, 12.0)
    keep = KEEP * 0.5 ** (1 / HALF_LIFE_S)
    assert pace.seconds_per_token(12.0) == pytest.approx((keep + 1) / (3000 * keep + 3000))
    pace.idle()
    pace.busy(20.0)  # idle in between: not charged
    pace.idle()  # an attempt that failed: its 5 s are charged to nothing
    pace.busy(25.0)
    before = pace.seconds
    pace.answered(100, 25.1)
    assert pace.seconds == pytest.approx(before * KEEP * 0.5 ** (13.1 / HALF_LIFE_S) + 0.1)


def test_a_pace_not_charged_for_a_while_is_forgotten():
    """An instance the router stopped sending to is tried again: what it learnt
    fades with age until it counts as not learnt."""
    pace = Pace()
    pace.busy(0.0)
    pace.answered(20_000, 10.0)
    assert pace.seconds_per_token(10.0) == pytest.approx(10 / 20_000)
    assert pace.seconds_per_token(10.0 + 2 * HALF_LIFE_S) is not None  # 5,000 tokens left
    assert pace.seconds_per_token(10.0 + 3 * HALF_LIFE_S) is None  # 2,500


def test_paces_weigh_each_instance_against_the_mean_within_the_bound():
    fast, also, slow, new, stuck = Pace(), Pace(), Pace(), Pace(), Pace()
    for pace, seconds in ((fast, 1.0), (also, 1.0), (slow, 3.0), (stuck, 100.0)):
        pace.busy(100.0 - seconds)
        pace.answered(10_000, 100.0)
    assert factors([fast, new], 100.0) == [1.0, 1.0]  # one learnt alone is the mean
    assert factors([fast, slow, new], 100.0) == pytest.approx([0.5, 1.5, 1.0])
    assert factors([fast, also, stuck], 100.0) == [1 / BOUND, 1 / BOUND, BOUND]
    assert factors([new, Pace()], 100.0) == [1.0, 1.0]


def test_a_whole_request_goes_to_the_instance_that_computes_faster():
    """Two idle decodes hold nothing: the one that has been computing its prompts
    twice as fast wins, with the tokens queued on it that would tie at one pace."""
    w = Weights()
    slow, fast = Candidate("slow", 0, 0, pace=1.5), Candidate("fast", 0, 0, 500, pace=0.75)
    assert place_alone(w, 1000, [slow, fast], turn=0).key == "fast"
    assert (
        place_alone(w, 1000, [Candidate("slow", 0, 0), Candidate("fast", 0, 0, 500)], 0).key
        == "slow"
    )
    p = Candidate("p", 0, 0, computing=400, pace=0.5)
    assert pair_cost(w, 1000, p, fast) == 0.5 * 1400 + 0.75 * 500 + 0.25 * 1000


def test_the_planner_learns_each_instances_pace_from_its_first_tokens():
    for pace, expected in ((True, "http://d:2"), (False, None)):
        planner, _ = _fleet(("decode",), rule=DecisionRule("never"))
        planner.policy = RoutingPolicy(DecisionRule("never"), "prefix", pace=pace)
        d1, d2 = planner.decode.instances
        for instance, seconds in ((d1, 0.08), (d2, 0.02)):
            for _ in range(3):
                computing = Computing(instance, 2000)
                time.sleep(seconds)
                computing.answered()
        now = time.monotonic()
        assert d1.pace.seconds_per_token(now) > 2 * d2.pace.seconds_per_token(now)
        picked = {_whole_where(planner, [i] * 300).url for i in range(4)}
        assert picked == ({expected} if expected else {d1.url, d2.url})


def test_pace_is_weighed_only_when_asked():
    parser = argparse.ArgumentParser()
    add_options(parser)
    assert not policy_of(parser.parse_args([])).pace
    assert policy_of(parser.parse_args(["--pace"])).pace
