"""The producer's states, the events that move them, and a table for each level.

A transfer id's Source is the engine's KV; each consumer that claims it holds a
claim of its own, push or pull. Source and claims name their states in one enum,
and each kind has its table keyed (state, event) -> state: a pair nobody wrote
down is a bug, refused where it happens. docs/protocol.md shows these tables.
"""

from __future__ import annotations

import enum

from kvpush.protocol.states import EventTable, allowed


class State(enum.StrEnum):
    """A transfer on the prefill side: its source while nobody claims it, else a claim."""

    COMPUTING = "computing"  # the engine computes its KV; no consumer has claimed it
    HELD = "held"  # all its KV is computed, nobody claimed it yet: kept under a lease
    EARLY = "early"  # claimed before the engine had the request: nothing to heartbeat
    CLAIMED = "claimed"  # a consumer claimed it (push: its blocks; pull: a READ); idle
    WRITING = "writing"  # push: a WRITE is in flight
    RETRYING = "retrying"  # push: a WRITE failed; it is posted again after a back-off
    CANCELLING = "cancelling"  # the consumer cancelled during a WRITE: ack when it ends
    FAILING = "failing"  # given up on during a WRITE: Failed when it ends
    GRANTED = "granted"  # pull: the consumer may READ the KV under a lease
    ABANDONED = "abandoned"  # a grant given up on: kept while a READ may still copy it
    ENDED = "ended"  # released or never computed (and forgotten)


class Event(enum.StrEnum):
    """What happens to a source or a claim."""

    CLAIM = "claim"  # source: a consumer claimed the KV; its claims hold it now
    HOLD = "hold"  # source: all the KV is computed and no claim holds it
    ENGINE = "engine"  # claim: the engine reported the request
    POST = "post"  # push: a WRITE is posted
    WRITE_DONE = "write done"  # push: the WRITE in flight is over
    WRITE_FAILED = "write failed"  # push: the WRITE in flight failed; it will go again
    CANCEL = "cancel"  # the consumer cancelled while a WRITE is in flight
    GIVE_UP = "give up"  # given up on while a WRITE is in flight
    GRANT = "grant"  # pull: the consumer may READ the KV
    ABANDON = "abandon"  # pull: a grant given up on while a READ may copy it
    END = "end"  # released or failed, and forgotten


S, E = State, Event

# The engine's KV while no claim holds it. A claim that sent its part returns it
# to held when more consumer ranks will claim it.
SOURCE = EventTable(
    "producer",
    {
        S.COMPUTING: {E.HOLD: S.HELD, E.CLAIM: S.CLAIMED, E.END: S.ENDED},
        S.HELD: {E.CLAIM: S.CLAIMED, E.END: S.ENDED},
        S.CLAIMED: {E.HOLD: S.HELD, E.END: S.ENDED},
    },
)

# A push claim. A WRITE in flight is never ended: its completion brings the claim
# back to claimed first, so nothing releases blocks a WRITE still reads or lands in.
# A WRITE that failed waits (retrying, nothing in flight) to be posted again; a
# cancel, a loss or an expiry meanwhile ends the claim, and nothing is posted.
PUSH = EventTable(
    "producer",
    {
        S.EARLY: {E.ENGINE: S.CLAIMED, E.END: S.ENDED},
        S.CLAIMED: {E.POST: S.WRITING, E.END: S.ENDED},
        S.WRITING: {
            E.WRITE_DONE: S.CLAIMED,
            E.WRITE_FAILED: S.RETRYING,
            E.CANCEL: S.CANCELLING,
            E.GIVE_UP: S.FAILING,
        },
        S.RETRYING: {E.POST: S.WRITING, E.END: S.ENDED},
        S.CANCELLING: {E.WRITE_DONE: S.CLAIMED, E.CANCEL: S.CANCELLING, E.GIVE_UP: S.CANCELLING},
        S.FAILING: {E.WRITE_DONE: S.CLAIMED, E.CANCEL: S.CANCELLING, E.GIVE_UP: S.FAILING},
    },
)

# A pull claim: a grant given up on stays out of the pool while a READ may copy it.
PULL = EventTable(
    "producer",
    {
        S.EARLY: {E.ENGINE: S.CLAIMED, E.END: S.ENDED},
        S.CLAIMED: {E.GRANT: S.GRANTED, E.END: S.ENDED},
        S.GRANTED: {E.ABANDON: S.ABANDONED, E.END: S.ENDED},
        S.ABANDONED: {E.ABANDON: S.ABANDONED, E.END: S.ENDED},
    },
)

# Where each state may go, by any event: the index docs/protocol.md opens with.
TRANSITIONS = allowed("producer", State, SOURCE, PUSH, PULL)

# States with a WRITE in flight: it cannot be recalled, only waited for.
WRITE_IN_FLIGHT = (S.WRITING, S.CANCELLING, S.FAILING)
# States a consumer's READ may be copying the KV in (pull).
READABLE = (S.GRANTED, S.ABANDONED)
# States that end on their own terms, whatever the consumer's heartbeats say.
ENDING = (S.CANCELLING, S.FAILING, S.ABANDONED)
# States whose consumer hears, by our heartbeats, that the KV is still coming.
HEARTBEATING = (S.CLAIMED, S.RETRYING, *WRITE_IN_FLIGHT)
# States that may yet need heartbeats: the round keeps running while any is present.
MAY_HEARTBEAT = (S.COMPUTING, S.EARLY, *HEARTBEATING)
