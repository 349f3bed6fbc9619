"""The consumer's states, the events that move them, and its (state, event) table.

A pair nobody wrote down is a bug, refused where it happens; docs/protocol.md
shows the table as the code has it.
"""

from __future__ import annotations

import enum

from kvpush.protocol.states import EventTable, allowed


class State(enum.StrEnum):
    """A transfer on the decode side."""

    ANNOUNCED = "announced"  # the request arrived; its blocks are not allocated yet
    CONNECTING = "connecting"  # blocks allocated; the session to the producer is not up
    REGISTERED = "registered"  # push: our blocks are the producer's to write into
    LANDING = "landing"  # push: the producer is done; NIXL's notification is due
    REQUESTED = "requested"  # pull: a read grant asked for
    READING = "reading"  # pull: our READ is in flight
    CANCELLING = "cancelling"  # ended, but a WRITE may still land: the blocks are held
    ENDED = "ended"  # delivered or failed (and forgotten)


class Event(enum.StrEnum):
    """What happens to one part of a transfer."""

    EXPECT = "expect"  # the engine allocated blocks for it
    REGISTER = "register"  # push: our blocks went to the producer
    REQUEST = "request"  # pull: we asked to READ
    COMPLETE = "complete"  # push: the producer is done; its notification is due
    GRANT = "grant"  # pull: the producer granted a READ, which we posted
    CANCEL = "cancel"  # we gave up while the producer may still write
    LOST = "lost"  # the link to the producer broke while it may still write
    MAY_LAND = "may land"  # over, but a WRITE or READ may still land in our blocks
    END = "end"  # delivered or failed, and forgotten


S, E = State, Event

EVENTS = EventTable(
    "consumer",
    {
        S.ANNOUNCED: {E.EXPECT: S.CONNECTING, E.END: S.ENDED},
        S.CONNECTING: {E.REGISTER: S.REGISTERED, E.REQUEST: S.REQUESTED, E.END: S.ENDED},
        S.REGISTERED: {
            E.COMPLETE: S.LANDING,
            E.CANCEL: S.CANCELLING,
            E.LOST: S.CANCELLING,
            E.MAY_LAND: S.CANCELLING,
            E.END: S.ENDED,
        },
        S.LANDING: {E.MAY_LAND: S.CANCELLING, E.END: S.ENDED},
        S.REQUESTED: {E.GRANT: S.READING, E.END: S.ENDED},
        S.READING: {E.MAY_LAND: S.CANCELLING, E.END: S.ENDED},
        S.CANCELLING: {E.MAY_LAND: S.CANCELLING, E.END: S.ENDED},
    },
)

# Where each state may go, by any event: the index docs/protocol.md opens with.
TRANSITIONS = allowed("consumer", State, EVENTS)

# States in which the producer may hold our blocks and write into them.
PRODUCER_MAY_WRITE = (S.REGISTERED,)
# States whose heartbeats keep the producer's hold on the transfer alive.
HEARTBEATING = (S.ANNOUNCED, S.REGISTERED, S.REQUESTED, S.READING)
# States in which a WRITE the producer posted may still land in our blocks.
WRITES_MAY_LAND = (S.REGISTERED, S.LANDING, S.CANCELLING)
