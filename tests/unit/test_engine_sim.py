"""The request ledgers of a prefill and a decode engine, driven over the protocol
simulation: whatever order requests arrive, compute, finish, abort and fail in,
every block is freed once, never while a WRITE reads it, and no request is left
waiting."""

from __future__ import annotations

from engine_sim import BLOCK, Engines
from hypothesis import HealthCheck, given, settings, target
from hypothesis import event as label
from hypothesis import strategies as st


def test_a_chunked_prefill_pushes_each_chunk_and_decode_lands_every_block():
    engines = Engines(progressive=True)
    r = engines.add(0, prompt_len=5 * BLOCK, local_tokens=BLOCK)
    engines.decode_arrives(r)  # decode first: its blocks are announced while prefill computes
    engines.prefill_arrives(r)
    engines.decode_allocates(r)
    for _ in range(3):
        engines.prefill_step(r, 2 * BLOCK)
        engines.sim.deliver()
        engines.sim.finish_writes()
    engines.sim.poll_notifs()
    engines.prefill_finishes(r)
    engines.sim.settle()
    engines.collect()
    assert engines.landed(r)
    assert len(engines.sim.chunks_sent) >= 1  # an earlier chunk went before the last step
    engines.decode_finishes(r)
    engines.sim.settle()
    engines.collect()
    engines.check()


def test_a_decode_aborted_while_prefill_computes_frees_both_sides():
    engines = Engines()
    r = engines.add(0, prompt_len=3 * BLOCK, local_tokens=0)
    engines.prefill_arrives(r)
    engines.decode_arrives(r)
    engines.decode_allocates(r)
    engines.prefill_step(r, BLOCK)
    engines.decode_finishes(r)  # the client went away
    engines.prefill_step(r, 2 * BLOCK)
    engines.prefill_finishes(r)
    engines.sim.settle()
    engines.collect()
    assert not engines.landed(r)
    engines.check()


WINDOW = 3 * BLOCK
BOUNDARY = WINDOW - 1 + 2 * BLOCK  # its last token's window starts at a block's last token


def _one_sliding_life(margin: int, progressive: bool) -> Engines:
    engines = Engines(progressive=progressive, window=WINDOW, margin=margin)
    r = engines.add(0, prompt_len=BOUNDARY, local_tokens=0)
    engines.decode_arrives(r)
    engines.prefill_arrives(r)
    engines.decode_allocates(r)
    while r.computed < r.prompt_len:
        engines.prefill_step(r, 2 * BLOCK)
    engines.prefill_finishes(r)
    engines.sim.settle()
    engines.collect()
    engines.decode_finishes(r)
    engines.sim.settle()
    engines.collect()
    return engines


def test_a_sliding_window_groups_kv_lands_where_decodes_window_reads_it():
    for progressive in (False, True):
        engines = _one_sliding_life(margin=1, progressive=progressive)
        assert engines.landed(engines.requests[0])
        engines.check()


def test_without_the_window_margin_a_write_reads_a_block_the_prefill_engine_freed():
    engines = _one_sliding_life(margin=0, progressive=False)
    assert any("had freed" in e for e in engines.sim.errors), engines.sim.errors


requests = st.lists(
    # prompt blocks, local blocks, and whether it is the previous request's sibling
    st.tuples(st.integers(1, 6), st.integers(0, 6), st.booleans()),
    min_size=1,
    max_size=4,
)
event = st.one_of(
    st.tuples(st.just("p_arrive"), st.integers(0, 3)),
    st.tuples(st.just("p_step"), st.integers(0, 3), st.integers(1, 3 * BLOCK)),
    st.tuples(st.just("p_finish"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("d_arrive"), st.integers(0, 3)),
    st.tuples(st.just("d_alloc"), st.integers(0, 3)),
    st.tuples(st.just("d_finish"), st.integers(0, 3)),
    st.tuples(st.just("deliver"), st.integers(1, 4)),
    st.tuples(st.just("writes"), st.booleans()),
    st.tuples(st.just("reads"), st.booleans()),
    st.tuples(st.just("notifs")),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 5.0])),
    st.tuples(st.just("collect")),
    st.tuples(st.just("pump"), st.booleans()),
    # Mostly, each request's life goes on in the usual order, the world keeping up.
    *[st.tuples(st.just("next"), st.integers(0, 3))] * 12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["push", "pull"]),
    progressive=st.booleans(),
    window=st.sampled_from([0, 0, WINDOW, 2 * BLOCK + 5]),
    shapes=requests,
    events=st.lists(event, max_size=60),
)
def test_random_request_lifecycles_leave_nothing_held_or_waiting(
    mode, progressive, window, shapes, events
):
    engines = Engines(mode=mode, progressive=progressive, window=window)
    for index, (blocks, local, sibling) in enumerate(shapes):
        prompt = blocks * BLOCK - (index % 3)  # not always a whole number of blocks
        leader = engines.requests.get(index - 1) if sibling else None
        if leader is not None and leader.follows is None:
            engines.add(index, leader.prompt_len, 0, follows=leader.index)
        else:
            engines.add(index, prompt, min(local * BLOCK, prompt))
    for ev in events:
        kind = ev[0]
        r = engines.requests[ev[1] % len(shapes)] if kind[:2] in ("p_", "d_", "ne") else None
        if kind == "next" and r:
            engines.next_step(r)
            engines.sim.deliver()
            engines.sim.finish_writes()
            engines.sim.finish_reads()
            engines.sim.poll_notifs()
            engines.collect()
        elif kind == "p_arrive" and r:
            engines.prefill_arrives(r)
        elif kind == "p_step" and r:
            engines.prefill_step(r, ev[2])
        elif kind == "p_finish" and r:
            engines.prefill_finishes(r, sendable=ev[2])
        elif kind == "d_arrive" and r:
            engines.decode_arrives(r)
        elif kind == "d_alloc" and r:
            engines.decode_allocates(r)
        elif kind == "d_finish" and r:
            engines.decode_finishes(r)
        elif kind == "deliver":
            engines.sim.deliver(ev[1])
        elif kind == "writes":
            engines.sim.finish_writes(ok=ev[1])
        elif kind == "reads":
            engines.sim.finish_reads(ok=ev[1])
        elif kind == "notifs":
            engines.sim.poll_notifs()
        elif kind == "advance":
            engines.sim.advance(ev[1])
        elif kind == "collect":
            engines.collect()
        elif kind == "pump":  # the world catches up: messages, WRITEs or READs, notifications
            engines.sim.deliver()
            engines.sim.finish_writes(ok=ev[1])
            engines.sim.finish_reads(ok=ev[1])
            engines.sim.poll_notifs()
            engines.collect()
    landed_early = sum(engines.landed(r) for r in engines.requests.values())
    label(f"landed before the drain: {min(landed_early, 2)}")
    target(float(landed_early), label="landed before the drain")
    engines.drain()
    outcomes = {engines.landed(r) for r in engines.requests.values()}
    label(f"outcomes after the drain: {sorted(outcomes)}")
    for r in engines.requests.values():
        if r.follows is not None:
            label(f"a follower ended {engines.ended_as.get(r.d_id)}")
    engines.check()
